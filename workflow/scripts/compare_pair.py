"""Compare two combinations of one model (rule compare_pair)."""

from pathlib import Path

from qdiff.compare import compare_forced_runs, compare_runs
from qdiff.io import load_array, load_arrays, read_json, write_json
from qdiff.jobs import log_to

log_to(snakemake.log[0])
inputs = snakemake.input
result = compare_runs(
    read_json(Path(inputs.record_a)),
    load_array(Path(inputs.logits_a)),
    read_json(Path(inputs.record_b)),
    load_array(Path(inputs.logits_b)),
)
if "forced_a" in inputs.keys():  # teacher forcing is on
    result["forced"] = compare_forced_runs(
        read_json(Path(inputs.forced_record_a)),
        load_arrays(Path(inputs.forced_a)),
        read_json(Path(inputs.forced_record_b)),
        load_arrays(Path(inputs.forced_b)),
    )
write_json(Path(snakemake.output[0]), result)
