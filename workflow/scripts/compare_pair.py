"""Compare two combinations of one model (rule compare_pair)."""

from pathlib import Path

from qdiff.compare import compare_runs
from qdiff.io import load_array, read_json, write_json
from qdiff.jobs import log_to

log_to(snakemake.log[0])
result = compare_runs(
    read_json(Path(snakemake.input.record_a)),
    load_array(Path(snakemake.input.logits_a)),
    read_json(Path(snakemake.input.record_b)),
    load_array(Path(snakemake.input.logits_b)),
)
write_json(Path(snakemake.output[0]), result)
