"""Make a requantized or dequantized copy with llama_model_quantize, in a child process
(rules requantize_model, dequantize_model)."""

from pathlib import Path

from qdiff import jobs
from qdiff.core import records
from qdiff.core.hashcache import remember_made, sha256_of
from qdiff.core.io import read_json, write_json
from qdiff.engine.quant import derive

gguf, info = Path(snakemake.output.gguf), Path(snakemake.output.info)
target = snakemake.params.target
parent = read_json(Path(snakemake.input.info))
origin = f"{target} of {parent['file']} (sha256 {parent['sha256']})"
made: dict[str, str] = {}  # the copy's sha256, once it is known


def body(job: jobs.Job) -> None:
    staged = job.out(gguf)
    derive(
        Path(snakemake.input.gguf),
        parent,
        staged,
        target,
        snakemake.threads,
        Path(snakemake.log[0]),
        snakemake.config["run_timeout_s"],
    )
    made["sha256"] = sha256_of(staged)
    write_json(
        job.out(info),
        records.model_info(
            gguf.name,
            made["sha256"],
            staged.stat().st_size,
            origin,
            # llama_model_quantize copies the file's metadata: the source's licence and
            # tokenizer are the copy's
            parent.get("licence", "not recorded"),
            parent.get("tokenizer"),
            snakemake.params.retry_token,
        ),
    )


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    write_json(job.out(info), records.failed_model_info(gguf.name, origin, error))


jobs.run(snakemake, body, failed, committed=lambda: remember_made(gguf, made.get("sha256")))
