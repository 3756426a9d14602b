"""qdiff.jobs.spawn and qdiff.jobs.fork, which run every llama.cpp child and every
quantization: exit codes, signals, the timeout and the log, with real child processes. Each
test runs once through a new interpreter (spawn) and once through a forked one (fork)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from qdiff import jobs

# a child's code, as Python source for spawn and run by exec in a forked child
Child = Callable[[str, Path, float], int | None]


def by_spawn(code: str, log: Path, timeout: float) -> int | None:
    return jobs.spawn([sys.executable, "-c", code], log, timeout)


def by_fork(code: str, log: Path, timeout: float) -> int | None:
    def main() -> int:
        exec(code, {})
        return 0

    assert jobs.can_fork()
    return jobs.fork(main, log, timeout, dict(os.environ))


children = pytest.mark.parametrize("child", [by_spawn, by_fork], ids=["spawn", "fork"])


@children
def test_the_child_s_exit_code_and_output_come_back(child: Child, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("before\n")
    code = child("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)", log, 60)
    assert code == 3
    assert log.read_text().splitlines() == ["before", "out", "err"]  # appended, both streams


@children
def test_a_child_that_raises_exits_with_1_and_its_traceback(child: Child, tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    assert child("raise ValueError('no model here')", log, 60) == 1
    assert "ValueError: no model here" in log.read_text()


@children
def test_a_child_killed_by_a_signal_gives_the_negative_signal(child: Child, tmp_path: Path) -> None:
    code = child("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", tmp_path / "l", 60)
    assert code == -signal.SIGSEGV


@children
def test_a_child_that_overruns_is_killed_and_reported_as_none(child: Child, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    code = child(
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
        tmp_path / "l",
        2,
    )
    assert code is None
    assert time.monotonic() - start < 30  # killed at the timeout, not after its minute
    pid = int(pid_file.read_text())
    assert pid != os.getpid()
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped


@children
def test_a_child_that_finishes_in_time_is_not_reported_as_overrun(
    child: Child, tmp_path: Path
) -> None:
    for _ in range(3):
        assert child("pass", tmp_path / "l", 30) == 0
    assert jobs.can_fork()  # the timers are gone: the next child may be forked


def test_a_forked_child_gets_the_environment_it_is_given(tmp_path: Path) -> None:
    env = {**os.environ, "QDIFF_TEST_VALUE": "given"}
    code = jobs.fork(
        lambda: 0 if os.environ.get("QDIFF_TEST_VALUE") == "given" else 5, tmp_path / "l", 30, env
    )
    assert code == 0
    assert "QDIFF_TEST_VALUE" not in os.environ  # the parent's own is untouched


def test_no_fork_while_another_thread_runs() -> None:
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not jobs.can_fork()
    finally:
        stop.set()
        thread.join()
    assert jobs.can_fork()
