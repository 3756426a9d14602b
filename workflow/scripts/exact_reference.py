"""The exact answer of one model's weights, in float64, along the teacher's text (rule
exact_reference), or its first steps with llama.cpp's rounding sources switched on (rule
exact_roundings: params.configs), computed in a child process after a memory estimate
(qdiff.exact.stage)."""

import json
from pathlib import Path

from qdiff import jobs
from qdiff.core import records
from qdiff.core.io import read_json, write_json
from qdiff.core.labels import Combination
from qdiff.engine.provenance import machine
from qdiff.exact.stage import ExactInputs, exact_stage

i, out, model = snakemake.input, snakemake.output, snakemake.wildcards.model
# Namedlists: `in` looks at their values, so their keys() are asked
emulating = "configs" in snakemake.params.keys()  # noqa: SIM118
configs = json.loads(snakemake.params.configs) if emulating else None
head = {"stage": "roundings" if emulating else "exact", "model": model}
forcing = "teacher_record" in i.keys() and not emulating  # noqa: SIM118


def body(job: jobs.Job) -> None:
    run, info = read_json(Path(i.teacher_run)), read_json(Path(i.info))
    inputs = ExactInputs(
        model=Path(i.model),
        info=info,
        run=run,
        forced_data=Path(i.teacher_data) if forcing else None,
        forced=read_json(Path(i.teacher_record)) if forcing else None,
        top_k=0 if emulating else snakemake.params.top_k,  # only the reference keeps top-k
        configs=configs,
    )
    result = exact_stage(
        inputs,
        job.out(out.data),
        Path(snakemake.log[0]),
        snakemake.config["run_timeout_s"],
        snakemake.config["exact"]["max_memory_gib"],
    )
    details = (
        {"teacher": Combination.from_record(run).label, "model_file": info, "provenance": machine()}
        if result["status"] == "ok"
        else {}
    )
    token = {"run_token": snakemake.params.retry_token}
    write_json(job.out(out.record), {**head, **result, **details, **token})


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    write_json(
        job.out(out.record),
        {**head, "status": "failed", "error": error, "run_token": records.fresh_token()},
    )


jobs.run(snakemake, body, failed, reuse=True)
