"""Teacher-forced pass of one combination in an isolated process (rule force_combination)."""

import json
from pathlib import Path

from qdiff.io import read_json
from qdiff.jobs import log_to
from qdiff.run import force_combination

log_to(snakemake.log[0])
inputs = snakemake.input
force_combination(
    spec=json.loads(snakemake.params.spec),
    model=Path(inputs.model),
    model_info=read_json(Path(inputs.info)),
    teacher_run=Path(inputs.teacher_run),
    teacher_forced=(
        (Path(inputs.teacher_record), Path(inputs.teacher_data))
        if "teacher_data" in inputs.keys() else None
    ),
    own_logits=Path(inputs.own_logits),
    record_path=Path(snakemake.output.record),
    data_path=Path(snakemake.output.data),
    log_path=Path(snakemake.log[0]),
    token=snakemake.params.retry_token,
)
