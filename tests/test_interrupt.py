"""A SIGKILL of the workflow loses nothing, leaves nothing running, nothing half-written, and
no late writer can overwrite a newer result."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import Workspace, tiny_config
from modelserver import ModelServer, serving
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


def held_download(workspace: Workspace, tiny_gguf: Path, server: ModelServer) -> None:
    """A 2-prompt workflow whose model comes from ``server``, with its body held back until
    the test lets it go: the workflow that holds the lock cannot finish before another has
    tried (a 30-prompt run once did, on a fast machine, and the other found nothing to do)."""
    config = tiny_config(
        tiny_gguf,
        prompts=[{"id": f"p{i}", "text": f"Once upon a time {i}"} for i in range(2)],
        generation={"n_tokens": 4, "n_ctx": 128},
        teacher_forcing={"enabled": False},
        capture={"enabled": False},
        exact={"enabled": False},
        download={"stall_window_s": 600},
    )
    config["models"]["tiny"] = {
        "url": f"{server.base}/tiny.gguf",
        "sha256": hashlib.sha256(tiny_gguf.read_bytes()).hexdigest(),
    }
    workspace.write_config(config)
    server.hold = threading.Event()


def test_a_second_workflow_in_the_same_directory_stops_before_any_job(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    """Snakemake's own lock checks, then writes, so two workflows started at one instant can
    both pass it and run every job twice. qdiff's own lock (an flock, taken just before the
    first job) cannot be held twice: a second `snakemake` started while the first runs jobs,
    even with --nolock, which skips Snakemake's lock, stops before any job."""
    with serving(tiny_gguf.read_bytes()) as server:
        held_download(workspace, tiny_gguf, server)
        first = subprocess.Popen(
            workspace.command(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while first.poll() is None and not server.requests:
                time.sleep(0.05)  # until the first workflow runs its download
            second = subprocess.Popen(
                workspace.command("--nolock"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            try:
                said = second.communicate(timeout=120)[0]
            except subprocess.TimeoutExpired:
                os.killpg(second.pid, signal.SIGKILL)
                pytest.fail("the second workflow ran a job (it waited in the held download)")
            assert first.poll() is None, "the first workflow ended before the second ran"
            assert second.returncode != 0, said[-2000:]
            assert "another snakemake is running this workflow in" in said, said[-2000:]
            assert "rule " not in said and "localrule" not in said
            assert len(server.requests) == 1  # the second fetched nothing
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()


def test_of_two_workflows_started_at_one_instant_one_runs(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    """Of two `snakemake`s started at one instant in one directory, one runs every job once and
    the other stops at a lock: Snakemake's, or qdiff's where both passed Snakemake's."""
    with serving(tiny_gguf.read_bytes()) as server:
        for _ in range(3):
            for leftover in ("results", "resources", ".snakemake"):
                subprocess.run(["rm", "-rf", str(workspace.root / leftover)], check=True)
            held_download(workspace, tiny_gguf, server)
            server.requests.clear()
            both = [
                subprocess.Popen(
                    workspace.command(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,  # so that a failure ends its jobs too
                )
                for _ in range(2)
            ]
            stopped = first_to_end(both, timeout_s=300)  # the other waits in its download
            assert server.hold
            server.hold.set()
            ran = next(p for p in both if p is not stopped)
            said = stopped.communicate()[0]
            assert stopped.returncode != 0, said
            locks = ("another snakemake is running this workflow in", "cannot be locked")
            assert any(lock in said for lock in locks), said
            ran_said = ran.communicate(timeout=600)[0]
            assert ran.returncode == 0, ran_said
            assert len(server.requests) == 1
            records = list((workspace.root / "results/runs").rglob("record.json"))
            assert len(records) == 4
            assert all(json.loads(r.read_text())["status"] == "ok" for r in records)


def first_to_end(procs: list[subprocess.Popen[str]], timeout_s: float) -> subprocess.Popen[str]:
    """The first of ``procs`` to end; fails the test if none has within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                return proc
        time.sleep(0.05)
    for proc in procs:
        os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"neither workflow ended in {timeout_s:g} s: both ran their jobs")
