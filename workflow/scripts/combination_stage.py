"""One stage (qdiff.core.stages) of one model x device x dequant combination, with llama.cpp in an
isolated child process (rules <stage>_combination, qdiff.core.stages)."""

import json
from pathlib import Path

from qdiff import jobs
from qdiff.core import records
from qdiff.core.io import write_json
from qdiff.core.stages import STAGES
from qdiff.engine.provenance import machine
from qdiff.engine.stage import run_stage

stage = STAGES[snakemake.params.stage]
spec = json.loads(snakemake.params.spec)
record = Path(snakemake.output.record)
# a run with first_step_logits: top_k keeps no data file (qdiff.core.config)
data = Path(snakemake.output.data) if "data" in snakemake.output.keys() else None  # noqa: SIM118


def body(job: jobs.Job) -> None:
    run_stage(
        stage,
        spec,
        dict(snakemake.input.items()),
        job.out(record),
        job.out(data) if data else None,
        Path(snakemake.log[0]),
        snakemake.params.retry_token,
        strict_devices=snakemake.config["strict_devices"],
        timeout_s=snakemake.config["run_timeout_s"],
    )


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    write_json(
        job.out(record), records.failure_record(spec, stage.name, "failed", error, machine(), None)
    )


jobs.run(snakemake, body, failed, reuse=True)
