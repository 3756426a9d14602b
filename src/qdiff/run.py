"""Run one combination in an isolated child process and record what happened.

The outcome is always a record, so the report can name every combination:
- ``ok``: the worker's record and logits.
- ``failed``: a crash (signal), an error, a timeout or weights on the wrong device. The
  record carries the reason and the tail of llama.cpp's log. Its files get an mtime of
  1970, older than their inputs, so the next ``snakemake`` run retries exactly these.
- ``unavailable``: this build cannot use the device's backend; the device is left out and
  the report says why. With ``strict_devices`` the job fails instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.io import read_json, save_array, write_json
from qdiff.llamalog import tail
from qdiff.provenance import failure_record
from qdiff.worker import EXIT_UNAVAILABLE

RETRY_MTIME = 0  # 1970: older than any input, so Snakemake plans the job again


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


def run_combination(
    spec: dict[str, Any],
    model: Path,
    model_info: dict[str, Any],
    record_path: Path,
    logits_path: Path,
    log_path: Path,
) -> str:
    """Run ``spec`` on ``model``; write record and logits; return the status."""
    worker_spec = {**spec, "model_path": str(model), "model_info": model_info}
    env = {**os.environ, **spec["settings"].get("env", {})}
    record_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=record_path.parent, prefix=".run-") as tmp:
        work = Path(tmp)
        write_json(work / "spec.json", worker_spec)
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "qdiff.worker", str(work / "spec.json"), str(work)],
                stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
            )
            try:
                returncode: int | None = proc.wait(timeout=spec["timeout_s"])
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                returncode = None
        if returncode == 0:
            os.replace(work / "logits.npy", logits_path)
            os.replace(work / "record.json", record_path)
            return "ok"
        error_file = work / "error.json"
        error = read_json(error_file) if error_file.exists() else None
    outcome = _classify(returncode, error)
    outcome["log_tail"] = tail(log_path.read_text(errors="replace"), 25)
    status = "unavailable" if returncode == EXIT_UNAVAILABLE else "failed"
    message = f"[qdiff] {spec['model']} {spec['device']}.{spec['dequant']}: {status}: {outcome['message']}"
    with log_path.open("a") as log:
        print(message, file=log)
    print(message, file=sys.stderr)
    if status == "unavailable" and spec["strict_devices"]:
        raise DeviceUnavailableError(
            f"device {spec['device']!r}: {outcome['message']} (strict_devices is on)"
        )
    save_array(logits_path, np.zeros((0, 0), dtype=np.float32))
    write_json(record_path, failure_record(spec, status, outcome))
    if status == "failed":
        for path in (record_path, logits_path):
            os.utime(path, (RETRY_MTIME, RETRY_MTIME))
    return status
