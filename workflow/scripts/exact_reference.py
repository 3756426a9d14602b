"""The exact answer of one model's weights, in float64, along the teacher's text (rule
exact_reference) or along the windows of the configured text (rule exact_text:
input.text_record), or its first steps with llama.cpp's rounding sources switched on (rule
exact_roundings: params.configs), computed in a child process after a memory estimate
(qdiff.exact.stage)."""

import json
from pathlib import Path

from qdiff import jobs
from qdiff.core import records
from qdiff.core.forced import forced_text
from qdiff.core.io import load_arrays, read_json, write_json
from qdiff.core.labels import Combination
from qdiff.core.text import as_run
from qdiff.engine.provenance import machine
from qdiff.exact.stage import ExactInputs, exact_stage

i, out, model = snakemake.input, snakemake.output, snakemake.wildcards.model
# Namedlists: `in` looks at their values, so their keys() are asked
emulating = "configs" in snakemake.params.keys()  # noqa: SIM118
configs = json.loads(snakemake.params.configs) if emulating else None
scoring_text = "text_record" in i.keys()  # noqa: SIM118
head = {"stage": "roundings" if emulating else "text" if scoring_text else "exact", "model": model}
forcing = "teacher_record" in i.keys() and not emulating  # noqa: SIM118


def teacher_text() -> tuple[dict, dict]:
    """The teacher's text record, and its windows as the engine reads a run."""
    record = read_json(Path(i.text_record))
    if record["status"] != "ok":
        return record, record
    windows = load_arrays(Path(i.text_data))["window_tokens"].tolist()
    return record, as_run(windows, record["generation"]["n_ctx"])


def body(job: jobs.Job) -> None:
    info = read_json(Path(i.info))
    if scoring_text:
        teacher, run = teacher_text()
        forced_data, forced = Path(i.text_data), teacher
    else:
        # the teacher's text as the forced passes read it (teacher_forcing.n_tokens)
        teacher = run = forced_text(
            read_json(Path(i.teacher_run)), snakemake.params.get("n_tokens")
        )
        forced_data = Path(i.teacher_data) if forcing else None
        forced = read_json(Path(i.teacher_record)) if forcing else None
    inputs = ExactInputs(
        model=Path(i.model),
        info=info,
        run=run,
        forced_data=forced_data,
        forced=forced,
        top_k=0 if emulating else snakemake.params.top_k,  # only the reference keeps top-k
        configs=configs,
        n_top=snakemake.params.get("n_top", 2),
        keep_first=not scoring_text,
    )
    result = exact_stage(
        inputs,
        job.out(out.data),
        Path(snakemake.log[0]),
        snakemake.config["run_timeout_s"],
        snakemake.config["exact"]["max_memory_gib"],
        kind=head["stage"],
    )
    details = (
        {
            "teacher": Combination.from_record(teacher).label,
            "model_file": info,
            "provenance": machine(),
        }
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
