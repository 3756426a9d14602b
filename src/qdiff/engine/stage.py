"""Run one stage of one combination in an isolated child process and record what happened.

The outcome is always a record (qdiff.core.records), so the report can name every combination:
- ``ok``: the worker's record and data file (qdiff.core.stages).
- ``failed``: the model file is missing (an upstream stage failed), or llama.cpp crashed
  (a signal), errored, timed out or put the weights on the wrong device. The record carries
  the reason in llama.cpp's own words, the tail of its log, and a fresh ``run_token``.
- ``unavailable``: this build cannot use the device's backend (or, for a forced pass, the
  teacher did not run); the device is left out and the report says why. With
  ``strict_devices`` the job fails instead.

Retrying failures uses Snakemake's params trigger: each stage rule's ``retry_token`` param
is the ``run_token`` of the existing record (see ``retry_token``). A record that ends ok or
unavailable keeps the token it was launched with, so nothing changes; a failed one carries a
fresh token, so the next invocation sees a changed param and retries exactly that job.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qdiff import jobs
from qdiff.core import records, secrets
from qdiff.core.io import load_array, read_json, write_json
from qdiff.core.labels import Combination
from qdiff.core.stages import RECORD_FILE, RUN, Stage
from qdiff.engine.llamalog import failure_reason, parse_placement, tail
from qdiff.engine.provenance import machine
from qdiff.jobs import StopWorkflow

# The worker's exit codes. Defined here, in the parent, so that importing this module (the
# Snakefile does, for retry_token) never loads llama.cpp's native code.
EXIT_OK, EXIT_ERROR, EXIT_UNAVAILABLE, EXIT_MISPLACED = 0, 1, 3, 4
ERROR_FILE = "error.json"  # a handled failure, written by the worker
ERRORS_FILE = "errors.txt"  # llama.cpp's ERROR-level messages (qdiff.engine.log)
PROGRESS_FILE = "progress.json"  # a stage's work so far and what it runs now, if it says


def retry_token(path: Path | str) -> str | None:
    """The run_token of an existing record or sidecar (None if there is none): a param."""
    try:
        return read_json(Path(path)).get("run_token")
    except (OSError, ValueError, AttributeError):
        return None


def determinism(attempts: list[Path]) -> dict[str, Any]:
    """Whether repeated runs (each in a fresh process) gave bit-identical results."""
    import numpy as np  # here only: every per-combination job imports this module

    first_logits = load_array(attempts[0] / RUN.data_file)
    first_tokens = [p["tokens"] for p in read_json(attempts[0] / RECORD_FILE)["prompts"]]
    max_abs, logits_same, tokens_same = 0.0, True, True
    for other in attempts[1:]:
        logits = load_array(other / RUN.data_file)
        logits_same &= bool(np.array_equal(first_logits, logits))
        max_abs = max(max_abs, float(np.abs(first_logits - logits).max(initial=0.0)))
        tokens = [p["tokens"] for p in read_json(other / RECORD_FILE)["prompts"]]
        tokens_same &= tokens == first_tokens
    return {
        "repeats": len(attempts),
        "bit_identical_logits": logits_same,
        "identical_tokens": tokens_same,
        "max_abs_between_repeats": max_abs,
    }


def _worker_main(argv: list[str]) -> int:
    from qdiff.engine import worker  # in the child only: it loads llama.cpp

    return worker.main(argv)


def _attempt(worker_spec: dict[str, Any], work: Path, log_path: Path, timeout: float) -> int | None:
    """One worker process; its exit code, or None after a timeout."""
    work.mkdir()
    write_json(work / "spec.json", worker_spec)  # placeholders only: no hidden value
    env = {**os.environ, **secrets.reveal_env(worker_spec["settings"].get("env", {}))}
    argv = [str(work / "spec.json"), str(work)]
    if jobs.can_fork():  # the same worker, without a new interpreter's start and imports
        return jobs.fork(lambda: _worker_main(argv), log_path, timeout, env)
    return jobs.spawn([sys.executable, "-m", "qdiff.engine.worker", *argv], log_path, timeout, env)


def job_usage(started: float) -> dict[str, float]:
    """What a job measures of itself, instead of Snakemake's ``benchmark:`` sampler (which
    reads every process's memory map twice a second and slowed the inference it watched
    by 0.8-3.2% on the 2-core AMD EPYC): the stage's wall seconds since ``started``
    (``time.monotonic``; the job's interpreter start and imports come before), and the CPU
    seconds and peak resident memory of the llama.cpp children it has waited for (every
    repeat), from the kernel's own accounting."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss_unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
    wall = round(time.monotonic() - started, 3)
    cpu = round(usage.ru_utime + usage.ru_stime, 3)
    peak_mib = round(usage.ru_maxrss * rss_unit / 2**20, 1)
    return dict(zip(records.JOB_USAGE, (wall, cpu, peak_mib), strict=True))


def _write_failure(
    stage: Stage,
    worker_spec: dict[str, Any],
    status: str,
    error: records.ErrorInfo,
    record_path: Path,
    token: str | None,
) -> str:
    prov = {**machine(), "model_file": worker_spec.get("model_info", {})}
    write_json(
        record_path, records.failure_record(worker_spec, stage.name, status, error, prov, token)
    )
    return status


def run_stage(
    stage: Stage,
    spec: dict[str, Any],
    inputs: dict[str, str],
    record_path: Path,
    data_path: Path | None,
    log_path: Path,
    token: str | None,
    strict_devices: bool = False,
    timeout_s: float = 3600.0,
) -> str:
    """Run ``stage`` of the combination ``spec`` describes (``spec["repeats"]`` times for a
    generation, each in a fresh process); write the record and, unless ``data_path`` is
    None (a run that keeps no first-step logits), the data file of the first attempt;
    return the status. ``inputs`` are the rule's named input files (``model`` and
    its sidecar ``info`` first); ``token`` is the rule's retry_token param."""
    started = time.monotonic()
    model_info = read_json(Path(inputs["info"]))
    worker_spec = {
        **spec,
        "inputs": inputs,
        "model_path": inputs["model"],
        "model_info": model_info,
    }
    if model_info.get("status", "ok") != "ok":  # an upstream stage (fetch, derivation) failed
        error: records.ErrorInfo = {
            "kind": "upstream",
            "message": f"model file {model_info['file']} is missing: {records.failure_text(model_info)}",
        }
        return _write_failure(stage, worker_spec, "failed", error, record_path, token)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    for stale in record_path.parent.glob(".run-*"):  # left by a killed job of this stage
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=record_path.parent, prefix=".run-") as tmp:
        attempts: list[Path] = []
        returncode: int | None = 0
        for i in range(spec.get("repeats", 1) if stage is RUN else 1):
            attempts.append(Path(tmp) / f"attempt-{i}")
            returncode = _attempt(worker_spec, attempts[-1], log_path, timeout_s)
            if returncode != 0:
                break
        if returncode == 0:
            _keep(stage, attempts, record_path, data_path, token, started)
            return "ok"
        outcome = _outcome(returncode, attempts[-1], log_path, timeout_s)
    status = "unavailable" if returncode == EXIT_UNAVAILABLE else "failed"
    with log_path.open("a") as log:
        print(
            f"[qdiff] {spec['model']} {Combination.from_record(spec).label} {stage.name}: "
            f"{status}: {outcome['message']}",
            file=log,
        )
    if status == "unavailable" and strict_devices and outcome.get("kind") == "unavailable":
        raise StopWorkflow(
            f"device {spec['device']!r}: {outcome['message']} (strict_devices is on)"
        )
    return _write_failure(stage, worker_spec, status, outcome, record_path, token)


def _keep(
    stage: Stage,
    attempts: list[Path],
    record_path: Path,
    data_path: Path | None,
    token: str | None,
    started: float,
) -> None:
    """The first attempt's record, with the job's own measure of itself and, for repeated
    runs, whether they were bit-identical; and its data file where the run keeps one."""
    record = {**read_json(attempts[0] / RECORD_FILE), "run_token": token}
    record["timings"] = {**record["timings"], **job_usage(started)}
    if len(attempts) > 1:
        record["determinism"] = determinism(attempts)
    if data_path is not None:
        os.replace(attempts[0] / stage.data_file, data_path)
    write_json(record_path, record)


def _outcome(
    returncode: int | None, attempt: Path, log_path: Path, timeout_s: float
) -> records.ErrorInfo:
    """Why a worker's attempt failed, in llama.cpp's own words: its handled error, the
    ERROR-level messages and abort lines, where the weights were (which names the kernels in
    use, e.g. AMX) and the log's tail."""
    handled = read_json(attempt / ERROR_FILE) if (attempt / ERROR_FILE).exists() else None
    errors = attempt / ERRORS_FILE
    messages = errors.read_text().splitlines() if errors.exists() else []
    outcome = jobs.child_outcome(returncode, handled, "the llama.cpp process", timeout_s)
    log_text = log_path.read_text(errors="replace")
    outcome["error_lines"] = failure_reason(messages, log_text)
    outcome["model_buffers"] = parse_placement(log_text).model_buffers
    outcome["log_tail"] = tail(log_text, 25)
    outcome["log"] = str(log_path)
    if outcome["kind"] in ("crash", "timeout") and outcome["error_lines"]:
        outcome["message"] += f" ({outcome['error_lines'][-1]})"
    if outcome["kind"] in ("crash", "timeout") and (attempt / PROGRESS_FILE).exists():
        progress = read_json(attempt / PROGRESS_FILE)  # what it had done, and where it was
        outcome["message"] += f", in {progress['current']}"
        outcome["progress"] = progress
    return outcome
