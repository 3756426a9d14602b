"""Fetch one configured model into resources/models/ (rule fetch_model)."""

from pathlib import Path

from qdiff import jobs
from qdiff.core import records
from qdiff.core.config import load_experiment
from qdiff.core.hashcache import remember_made
from qdiff.core.io import write_json
from qdiff.sources import DownloadLimits, describe_source, fetch, file_facts

gguf, info = Path(snakemake.output.gguf), Path(snakemake.output.info)
spec = load_experiment(snakemake.config).models[snakemake.wildcards.model]
limits = DownloadLimits.from_config(snakemake.config["download"])


made: dict[str, str] = {}  # the fetched file's sha256, once it is known


def body(job: jobs.Job) -> None:
    made["sha256"] = fetch(
        spec.source, job.out(gguf), spec.sha256, limits, gguf.with_name(gguf.name + ".part")
    )
    size = job.out(gguf).stat().st_size
    origin = describe_source(spec.source)
    licence, tokenizer = file_facts(spec.source, job.out(gguf))
    write_json(
        job.out(info),
        records.model_info(
            gguf.name,
            made["sha256"],
            size,
            origin,
            licence,
            tokenizer,
            snakemake.params.retry_token,
        ),
    )


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    origin = describe_source(spec.source)
    write_json(job.out(info), records.failed_model_info(gguf.name, origin, error))


jobs.run(snakemake, body, failed, committed=lambda: remember_made(gguf, made.get("sha256")))
