"""Run one model x device x dequant combination in an isolated process: its generation (rule
run_combination) or its tensor capture (rule capture_combination); the spec names the mode."""

import json
from pathlib import Path

from qdiff.io import read_json
from qdiff.jobs import log_to
from qdiff.run import run_combination

log_to(snakemake.log[0])
run_combination(
    spec=json.loads(snakemake.params.spec),
    model=Path(snakemake.input.model),
    model_info=read_json(Path(snakemake.input.info)),
    record_path=Path(snakemake.output.record),
    data_path=Path(snakemake.output.data),
    log_path=Path(snakemake.log[0]),
    token=snakemake.params.retry_token,
)
