"""qdiff.jobs.spawn, which runs every llama.cpp child and every quantization: exit codes,
signals, the timeout and the log, with real child processes."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from qdiff.jobs import spawn


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_child_s_exit_code_and_output_come_back(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("before\n")
    code = spawn(
        python("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"), log, 60
    )
    assert code == 3
    assert log.read_text().splitlines() == ["before", "out", "err"]  # appended, both streams


def test_a_child_killed_by_a_signal_gives_the_negative_signal(tmp_path: Path) -> None:
    code = spawn(
        python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"), tmp_path / "l", 60
    )
    assert code == -signal.SIGSEGV


def test_a_child_that_overruns_is_killed_and_reported_as_none(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    code = spawn(
        python(
            f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        ),
        tmp_path / "l",
        timeout=2,
    )
    assert code is None
    assert time.monotonic() - start < 30  # killed at the timeout, not after its minute
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped


def test_a_child_that_finishes_in_time_is_not_reported_as_overrun(tmp_path: Path) -> None:
    for _ in range(3):
        assert spawn(python("pass"), tmp_path / "l", timeout=30) == 0
