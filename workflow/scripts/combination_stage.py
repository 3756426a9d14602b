"""One stage (qdiff.stages) of one model x device x dequant combination, with llama.cpp in an
isolated child process (rules run_combination, force_combination, capture_combination)."""

import json
from pathlib import Path

from qdiff import jobs, records
from qdiff.io import write_json
from qdiff.provenance import machine
from qdiff.run import run_stage
from qdiff.stages import STAGES

stage = STAGES[snakemake.params.stage]
spec = json.loads(snakemake.params.spec)
record = Path(snakemake.output.record)
# a run with first_step_logits: top_k keeps no data file (qdiff.config)
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
