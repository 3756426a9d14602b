"""Localise where a model's pairs part, op by op (rule localise_model)."""

from pathlib import Path

from qdiff import jobs
from qdiff.compare.localise import FLOOR_FACTOR, localise_model
from qdiff.core.io import read_json, write_json

output, model = Path(snakemake.output[0]), snakemake.wildcards.model


def body(job: jobs.Job) -> None:
    result = localise_model(
        model=model,
        captures=[
            (read_json(Path(r)), Path(d))
            for r, d in zip(snakemake.input.records, snakemake.input.data, strict=True)
        ],
        pairs=read_json(Path(snakemake.input.pairs))["pairs"],
        configured=[tuple(p) for p in snakemake.params.pairs],
    )
    write_json(job.out(output), result)


def failed(job: jobs.Job, error: dict) -> None:
    write_json(
        job.out(output),
        {
            "model": model,
            "status": "failed",
            "reason": error["message"],
            "floor_factor": FLOOR_FACTOR,
            "pairs": [],
            "not_captured": {},
        },
    )


jobs.run(snakemake, body, failed)
