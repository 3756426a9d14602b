"""A SIGKILL of the whole running workflow loses nothing and leaves nothing that looks done."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, Workspace, tiny_config

pytestmark = pytest.mark.workflow


def test_sigkill_mid_run_then_rerun_completes(workspace: Workspace, tiny_gguf: Path) -> None:
    prompts = [{"id": f"p{i}", "text": f"Once upon a time {i}"} for i in range(40)]
    workspace.write_config(
        tiny_config(tiny_gguf, prompts=prompts, generation={"n_tokens": 200, "n_ctx": 512})
    )
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
           "--directory", str(workspace.root), "--cores", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    logs = workspace.root / "results/logs/run"
    deadline = time.monotonic() + 300
    try:
        # wait until a run is inside llama.cpp (its first prompt done), then kill everything
        while time.monotonic() < deadline:
            if any("[qdiff] prompt p0" in f.read_text(errors="replace") for f in logs.rglob("*.log")):
                break
            assert proc.poll() is None, "workflow ended before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("no run started within 300 s")
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    killed_at = time.time()
    interrupted = [
        f for f in logs.rglob("*.log")
        if "[qdiff] prompt p0" in f.read_text(errors="replace")
        and not (workspace.root / "results/runs" / f.relative_to(logs).with_suffix("") / "record.json").exists()
    ]
    assert interrupted, "the kill should have hit a run that had not finished"
    assert not (workspace.root / "results/summary.md").exists()

    # Snakemake keeps its lock after a kill (it cannot tell a dead run from a live one):
    # unlock, then a plain rerun; the workflow profile redoes the incomplete outputs
    locked = workspace.snakemake(check=False)
    assert locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr
    workspace.snakemake("--unlock")
    workspace.snakemake()
    for log in interrupted:
        record = workspace.root / "results/runs" / log.relative_to(logs).with_suffix("") / "record.json"
        assert json.loads(record.read_text())["status"] == "ok"
        assert record.stat().st_mtime > killed_at
        assert not list(record.parent.glob(".run-*"))
    records = list((workspace.root / "results/runs").glob("*/*/*/record.json"))
    assert len(records) == 8
    assert all(json.loads(r.read_text())["status"] == "ok" for r in records)
    assert workspace.planned_jobs() == []
