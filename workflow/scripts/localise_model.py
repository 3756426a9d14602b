"""Localise where a model's largest pair (and configured pairs) part (rule localise_model)."""

from pathlib import Path

from qdiff.io import read_json, write_json
from qdiff.jobs import log_to
from qdiff.localise import localise_model

log_to(snakemake.log[0])
write_json(
    Path(snakemake.output[0]),
    localise_model(
        captures=[
            (read_json(Path(r)), Path(d))
            for r, d in zip(snakemake.input.records, snakemake.input.data)
        ],
        pairs=[read_json(Path(p)) for p in snakemake.input.pairs],
        configured=[tuple(p) for p in snakemake.params.pairs],
    ),
)
