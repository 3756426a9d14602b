"""A SIGKILL of the workflow loses nothing, leaves nothing running, nothing half-written, and
no late writer can overwrite a newer result."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import Workspace, tiny_config
from qdiff.jobs import Job

pytestmark = pytest.mark.workflow


def session_processes(sid: int) -> list[str]:
    """The live processes of a session (Linux /proc): the workflow and everything it started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(
                stat.parent.name
                + " "
                + (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            )
    return found


def snapshot(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in (root / "results").rglob("*") if p.is_file()}


def test_sigkill_of_snakemake_alone_stops_every_job_then_rerun_completes(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    # long enough (about 8 s a run) that a run the kill hits cannot finish in the grace time
    prompts = [{"id": f"p{i}", "text": f"Once upon a time {i}"} for i in range(60)]
    config = tiny_config(
        tiny_gguf,
        prompts=prompts,
        generation={"n_tokens": 400, "n_ctx": 512},
        teacher_forcing={"enabled": False},
    )
    del config["models"]["tiny"]["requantize"]
    workspace.write_config(config)
    logs, runs = workspace.root / "results/logs/run", workspace.root / "results/runs"
    killed_at = kill_snakemake_inside_a_run(workspace, logs)
    interrupted = [
        runs / log.relative_to(logs).with_suffix("") / "record.json"
        for log in logs.rglob("*.log")
        if "[qdiff] prompt p0" in log.read_text(errors="replace")
    ]
    interrupted = [record for record in interrupted if not record.exists()]
    assert interrupted, "the kill should have hit a run that had not finished"
    assert not (workspace.root / "results/summary.md").exists()

    # Snakemake keeps its lock after a kill (it cannot tell a dead run from a live one):
    # unlock, then a plain rerun; the workflow profile redoes the incomplete outputs
    locked = workspace.snakemake(check=False)
    assert locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr
    workspace.snakemake("--unlock")
    workspace.snakemake()
    for record in interrupted:
        assert json.loads(record.read_text())["status"] == "ok"
        assert record.stat().st_mtime > killed_at
        assert not list(record.parent.glob(".*"))  # no staging or worker leftovers
    records = list(runs.glob("*/*/*/record.json"))
    assert len(records) == 4
    assert all(json.loads(r.read_text())["status"] == "ok" for r in records)
    assert workspace.planned_jobs() == []


def kill_snakemake_inside_a_run(workspace: Workspace, logs: Path) -> float:
    """Start the workflow in a session of its own (so the test can see, and clean up, all
    it started), wait until a run is inside llama.cpp (its first prompt done), SIGKILL
    Snakemake only, and check that its jobs and their llama.cpp processes did not go on
    without it, nor wrote anything after. Returns when it was killed."""
    proc = subprocess.Popen(
        workspace.command(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if any(
                "[qdiff] prompt p0" in f.read_text(errors="replace") for f in logs.rglob("*.log")
            ):
                break
            assert proc.poll() is None, "workflow ended before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("no run started within 300 s")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 3  # the watchdog looks twice a second
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session_processes(proc.pid) == [], "jobs outlived the workflow"
        before = snapshot(workspace.root)
        time.sleep(2)
        assert snapshot(workspace.root) == before, "something wrote into results/ after the kill"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return time.time()


def test_a_late_writer_never_overwrites_a_newer_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job A outlives its workflow; the rerun's job B starts for the same output and
    finishes. When A finally commits, B's result stays and A's is discarded."""
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "results" / "record.json"
    late = Job([str(output)], None, token="a" * 32)
    newer = Job([str(output)], None, token="b" * 32)
    newer.out(output).write_text("newer")
    assert newer.commit(lambda out, staged: None)
    late.out(output).write_text("late")
    assert not late.commit(lambda out, staged: None)
    assert output.read_text() == "newer"
    assert sorted(p.name for p in output.parent.iterdir()) == ["record.json"]


def test_a_second_workflow_in_the_same_directory_stops_before_any_job(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    """Snakemake's own lock checks, then writes, so two workflows started at one instant can
    both pass it and run every job twice. qdiff's own lock (an flock, taken just before the
    first job) cannot be held twice: a second `snakemake` started while the first runs jobs,
    even with --nolock, which skips Snakemake's lock, stops before any job; and of two
    started at one instant, one runs and the other stops."""
    prompts = [{"id": f"p{i}", "text": f"Once upon a time {i}"} for i in range(30)]
    config = tiny_config(
        tiny_gguf,
        prompts=prompts,
        generation={"n_tokens": 200, "n_ctx": 512},
        teacher_forcing={"enabled": False},
        capture={"enabled": False},
        exact={"enabled": False},
    )
    del config["models"]["tiny"]["requantize"]
    workspace.write_config(config)
    first = subprocess.Popen(
        workspace.command(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        logs = workspace.root / "results/logs/run"
        while first.poll() is None and not (logs.exists() and any(logs.rglob("*.log"))):
            time.sleep(0.05)  # until the first workflow runs a job
        second = workspace.snakemake("--nolock", check=False)
        assert second.returncode != 0
        said = second.stdout + second.stderr
        assert "another snakemake is running this workflow in" in said, said[-2000:]
        assert "rule run_combination" not in said and "localrule" not in said
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    workspace.snakemake("--unlock")
    quick = {**config, "prompts": prompts[:2], "generation": {"n_tokens": 4, "n_ctx": 128}}
    workspace.write_config(quick)
    for _ in range(3):  # at one instant
        for leftover in ("results", ".snakemake"):
            subprocess.run(["rm", "-rf", str(workspace.root / leftover)], check=True)
        both = [
            subprocess.Popen(
                workspace.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for _ in range(2)
        ]
        codes = sorted(p.wait(timeout=600) for p in both)
        outputs = [p.stdout.read() for p in both if p.stdout]
        assert codes[0] == 0 and codes[1] != 0, outputs
        records = list((workspace.root / "results/runs").rglob("record.json"))
        assert len(records) == 4
        assert all(json.loads(r.read_text())["status"] == "ok" for r in records)
