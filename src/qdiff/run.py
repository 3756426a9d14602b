"""Run one combination in an isolated child process and record what happened.

The outcome is always a record, so the report can name every combination:
- ``ok``: the worker's record and logits.
- ``failed``: a crash (signal), an error, a timeout or weights on the wrong device. The
  record carries the reason and the tail of llama.cpp's log, and a fresh ``run_token``.
- ``unavailable``: this build cannot use the device's backend; the device is left out and
  the report says why. With ``strict_devices`` the job fails instead.

Retrying failures uses Snakemake's params trigger: the run rule's ``retry_token`` param is
the ``run_token`` of the existing record (see ``retry_token``). A run that ends ok or
unavailable keeps the token it was launched with, so nothing changes; a failed run writes a
fresh token, so the next invocation sees a changed param and retries exactly that run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.io import load_array, read_json, save_array, save_arrays, write_json
from qdiff.llamalog import error_lines, parse_placement, tail
from qdiff.provenance import failure_record

# The worker's exit codes. Defined here, in the parent, so that importing this module (the
# Snakefile does, for retry_token) never loads llama.cpp's native code.
EXIT_OK, EXIT_ERROR, EXIT_UNAVAILABLE, EXIT_MISPLACED = 0, 1, 3, 4
# what the worker writes besides record.json, per mode (qdiff.worker.MODES)
DATA_FILES = {"generate": "logits.npy", "force": "forced.npz", "capture": "capture.npz"}


def retry_token(record_path: Path) -> str | None:
    """The run_token of an existing record (None if there is none): a run rule param."""
    try:
        return read_json(record_path).get("run_token")
    except (OSError, ValueError):
        return None


class DeviceUnavailableError(RuntimeError):
    pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _classify(returncode: int | None, error: dict[str, Any] | None) -> dict[str, Any]:
    if returncode is None:
        return {"kind": "timeout", "message": "stopped after run_timeout_s"}
    if returncode < 0:
        name = _signal_name(-returncode)
        return {
            "kind": "crash",
            "signal": name,
            "message": f"the llama.cpp process was killed by {name}",
        }
    if error is not None:
        return {**error, "exit_code": returncode}
    return {"kind": "error", "exit_code": returncode, "message": f"worker exited with {returncode}"}


def _attempt(worker_spec: dict[str, Any], work: Path, log_path: Path) -> int | None:
    """One worker process; its exit code, or None after a timeout."""
    work.mkdir()
    write_json(work / "spec.json", worker_spec)
    env = {**os.environ, **worker_spec["settings"].get("env", {})}
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qdiff.worker", str(work / "spec.json"), str(work)],
            stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
        )
        try:
            return proc.wait(timeout=worker_spec["timeout_s"])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None


def determinism(attempts: list[Path]) -> dict[str, Any]:
    """Whether repeated runs (each in a fresh process) gave bit-identical results."""
    first_logits = load_array(attempts[0] / "logits.npy")
    first_tokens = [p["tokens"] for p in read_json(attempts[0] / "record.json")["prompts"]]
    max_abs, logits_same, tokens_same = 0.0, True, True
    for other in attempts[1:]:
        logits = load_array(other / "logits.npy")
        logits_same &= bool(np.array_equal(first_logits, logits))
        max_abs = max(max_abs, float(np.abs(first_logits - logits).max(initial=0.0)))
        tokens = [p["tokens"] for p in read_json(other / "record.json")["prompts"]]
        tokens_same &= tokens == first_tokens
    return {
        "repeats": len(attempts),
        "bit_identical_logits": logits_same,
        "identical_tokens": tokens_same,
        "max_abs_between_repeats": max_abs,
    }


def _placeholder(data_path: Path) -> None:
    """An empty data file for a run that produced none, so the job's outputs exist."""
    if data_path.suffix == ".npz":
        save_arrays(data_path, {})
    else:
        save_array(data_path, np.zeros((0, 0), dtype=np.float32))


def run_combination(
    spec: dict[str, Any],
    model: Path,
    model_info: dict[str, Any],
    record_path: Path,
    data_path: Path,
    log_path: Path,
    token: str | None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Run ``spec`` on ``model`` (``spec["repeats"]`` times, each in a fresh process);
    write the record and data file (``DATA_FILES``) of the first attempt; return the status.

    ``token`` is the rule's retry_token param, stored in ok and unavailable records.
    ``extra`` goes to the worker but not into the rule's params (e.g. input paths)."""
    worker_spec = {**spec, **(extra or {}), "model_path": str(model), "model_info": model_info}
    mode = spec.get("mode", "generate")
    record_path.parent.mkdir(parents=True, exist_ok=True)
    for stale in record_path.parent.glob(".run-*"):  # left by a killed job of this run
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=record_path.parent, prefix=".run-") as tmp:
        attempts: list[Path] = []
        returncode: int | None = 0
        for i in range(spec.get("repeats", 1)):
            attempts.append(Path(tmp) / f"attempt-{i}")
            returncode = _attempt(worker_spec, attempts[-1], log_path)
            if returncode != 0:
                break
        if returncode == 0:
            record = {**read_json(attempts[0] / "record.json"), "run_token": token}
            if len(attempts) > 1 and mode == "generate":
                record["determinism"] = determinism(attempts)
            os.replace(attempts[0] / DATA_FILES[mode], data_path)
            write_json(record_path, record)
            return "ok"
        error_file = attempts[-1] / "error.json"
        error = read_json(error_file) if error_file.exists() else None
    outcome = _classify(returncode, error)
    log_text = log_path.read_text(errors="replace")
    outcome["error_lines"] = error_lines(log_text)
    # where the weights were when it failed: names the kernels in use (e.g. AMX)
    outcome["model_buffers"] = parse_placement(log_text).model_buffers
    outcome["log_tail"] = tail(log_text, 25)
    if outcome["kind"] == "crash" and outcome["error_lines"]:
        outcome["message"] += f" ({outcome['error_lines'][-1]})"
    status = "unavailable" if returncode == EXIT_UNAVAILABLE else "failed"
    message = f"[qdiff] {spec['model']} {spec['device']}.{spec['dequant']}: {status}: {outcome['message']}"
    with log_path.open("a") as log:
        print(message, file=log)
    if status == "unavailable" and spec["strict_devices"]:
        raise DeviceUnavailableError(
            f"device {spec['device']!r}: {outcome['message']} (strict_devices is on)"
        )
    _placeholder(data_path)
    record = failure_record(worker_spec, status, outcome)
    record["run_token"] = uuid.uuid4().hex if status == "failed" else token
    write_json(record_path, record)
    return status


def force_combination(
    spec: dict[str, Any],
    model: Path,
    model_info: dict[str, Any],
    teacher_run: Path,
    teacher_forced: tuple[Path, Path] | None,
    own_logits: Path,
    record_path: Path,
    data_path: Path,
    log_path: Path,
    token: str | None,
) -> str:
    """Teacher-forced pass of one combination (qdiff.forcing). The sequences are the greedy
    output in the teacher's run record; ``teacher_forced`` is the teacher's own forced
    (record, data), whose slice ids every other combination uses, or None on the teacher.
    Without a successful teacher there is nothing to force: the run is ``unavailable``."""
    run = read_json(teacher_run)
    forced_status = read_json(teacher_forced[0])["status"] if teacher_forced else "ok"
    if run["status"] != "ok" or forced_status != "ok":
        which = "run" if run["status"] != "ok" else "teacher-forced run"
        status = run["status"] if run["status"] != "ok" else forced_status
        message = (
            f"the teacher {spec['forcing']['teacher']}'s {which} is {status}, "
            "so there is no sequence to force"
        )
        record_path.parent.mkdir(parents=True, exist_ok=True)
        _placeholder(data_path)
        worker_spec = {**spec, "model_path": str(model), "model_info": model_info}
        record = failure_record(worker_spec, "unavailable", {"kind": "teacher", "message": message})
        write_json(record_path, {**record, "run_token": token})
        return "unavailable"
    forcing = {
        **spec["forcing"],
        "sequences": {p["id"]: p["tokens"] for p in run["prompts"]},
        "teacher_data": str(teacher_forced[1]) if teacher_forced else None,
        "own_logits": str(own_logits),
    }
    return run_combination(
        spec, model, model_info, record_path, data_path, log_path, token, {"forcing": forcing}
    )
