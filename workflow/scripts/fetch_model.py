"""Fetch one configured model into resources/models/ (rule fetch_model)."""

from pathlib import Path

from qdiff import jobs, records
from qdiff.config import load_experiment
from qdiff.io import write_json
from qdiff.sources import StallLimit, declared_licence, describe_source, fetch

gguf, info = Path(snakemake.output.gguf), Path(snakemake.output.info)
spec = load_experiment(snakemake.config).models[snakemake.wildcards.model]
stall = StallLimit(**{k.removeprefix("stall_"): v for k, v in snakemake.config["download"].items()})


def body(job: jobs.Job) -> None:
    sha256 = fetch(
        spec.source, job.out(gguf), spec.sha256, stall, gguf.with_name(gguf.name + ".part")
    )
    size = job.out(gguf).stat().st_size
    origin = describe_source(spec.source)
    licence = declared_licence(spec.source, job.out(gguf))
    write_json(job.out(info), records.model_info(gguf.name, sha256, size, origin, licence))


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    origin = describe_source(spec.source)
    write_json(job.out(info), records.failed_model_info(gguf.name, origin, error))


jobs.run(snakemake, body, failed)
