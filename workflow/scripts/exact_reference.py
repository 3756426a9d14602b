"""The exact answer of one model's weights, in float64, along the teacher's text, computed
in a child process after a memory estimate (rule exact_reference)."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

from qdiff import jobs
from qdiff.core import records
from qdiff.core.io import read_json, write_json
from qdiff.core.labels import Combination
from qdiff.engine.provenance import machine
from qdiff.exact.reference import ERROR_FILE, UNSUPPORTED, memory_needed

i, out, model = snakemake.input, snakemake.output, snakemake.wildcards.model
head = {"stage": "exact", "model": model}
GIB = 2**30


def memory_check(run: dict) -> int:
    """The engine's estimate, in bytes, refused (StageError) beyond what it may take."""
    lengths = [len(p["prompt_tokens"]) + len(p["tokens"]) for p in run["prompts"]]
    needed = memory_needed(Path(i.model), len(lengths), max(lengths, default=0))
    configured = snakemake.config["exact"]["max_memory_gib"]
    limit, what = (
        (configured * GIB, "exact.max_memory_gib") if configured else jobs.available_memory()
    )
    if needed > limit:
        raise jobs.StageError(
            f"the float64 engine needs about {needed / GIB:.2f} GiB for {model}, and "
            f"{what} allows {max(limit, 0) / GIB:.2f} GiB: free memory, set "
            "exact.max_memory_gib if this machine can give more than qdiff sees, or set "
            "exact.enabled: false"
        )
    return needed


def body(job: jobs.Job) -> None:
    info, run = read_json(Path(i.info)), read_json(Path(i.teacher_run))
    forced = read_json(Path(i.teacher_record)) if "teacher_record" in i.keys() else None  # noqa: SIM118
    not_ok = [r for r in (info, run, forced) if r is not None and r.get("status", "ok") != "ok"]
    if not_ok:
        raise jobs.StageError(f"no exact reference: {records.failure_text(not_ok[0])}")
    needed = memory_check(run)
    folder = Path(out.record).parent
    for stale in folder.glob(".exact-*"):  # left by a killed job
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".exact-") as tmp:
        made = {
            "record": Path(tmp) / Path(out.record).name,
            "data": Path(tmp) / Path(out.data).name,
        }
        spec = {
            "model": i.model,
            "teacher_run": i.teacher_run,
            "teacher_data": i.teacher_data if forced is not None else None,
            "top_k": snakemake.params.top_k,
            **{name: str(path) for name, path in made.items()},
        }
        write_json(Path(tmp) / "spec.json", spec)
        timeout = snakemake.config["run_timeout_s"]
        code = jobs.spawn(
            [sys.executable, "-m", "qdiff.exact.reference", str(Path(tmp) / "spec.json")],
            Path(snakemake.log[0]),
            timeout,
        )
        error = Path(tmp) / ERROR_FILE
        handled = read_json(error) if error.exists() else None
        if code == UNSUPPORTED and handled is not None:
            write_json(
                job.out(out.record),
                {
                    **head,
                    "status": "unsupported",
                    "reason": handled["message"],
                    "run_token": snakemake.params.retry_token,
                },
            )
            return
        if code != 0:
            outcome = jobs.child_outcome(code, handled, "the float64 engine", timeout)
            raise jobs.StageError(
                f"{outcome['message']}; it was estimated to need {needed / GIB:.2f} GiB"
            )
        os.replace(made["data"], job.out(out.data))
        record = read_json(made["record"])
    write_json(
        job.out(out.record),
        {
            **head,
            "status": "ok",
            "teacher": Combination.from_record(run).label,
            **record,
            "memory_estimate_mib": round(needed / 2**20, 1),
            "model_file": info,
            "provenance": machine(),
            "run_token": snakemake.params.retry_token,
        },
    )


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    write_json(
        job.out(out.record),
        {**head, "status": "failed", "error": error, "run_token": records.fresh_token()},
    )


jobs.run(snakemake, body, failed, reuse=True)
