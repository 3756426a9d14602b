"""A job's process, and Snakemake's, skip Python's last garbage collection at exit
(qdiff.jobs.skip_exit_collection) and still exit as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def exit_of(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh interpreter, which then exits normally."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_heap_is_frozen_at_exit_once_and_after_other_exit_handlers() -> None:
    proc = exit_of(
        "import atexit, gc\n"
        # registered first, so it runs last: what the interpreter's final collection sees
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
        "atexit.register(lambda: print('frozen before:', gc.get_freeze_count() > 0))\n"
        "from qdiff.jobs import skip_exit_collection\n"
        "before = atexit._ncallbacks()\n"
        "skip_exit_collection(); skip_exit_collection()\n"
        "print('handlers added:', atexit._ncallbacks() - before)\n"
    )
    assert proc.returncode == 0, proc.stderr
    # exit handlers run last-registered first: the freeze runs before both of these
    assert proc.stdout.splitlines() == [
        "handlers added: 1",
        "frozen before: True",
        "frozen at exit: True",
    ]


def test_open_files_and_logging_still_flush(tmp_path: Path) -> None:
    data, log = tmp_path / "data.txt", tmp_path / "log.txt"
    proc = exit_of(
        "import logging\n"
        "from qdiff.jobs import skip_exit_collection\n"
        "skip_exit_collection()\n"
        f"kept = open({str(data)!r}, 'w')  # never closed: its buffer is flushed at exit\n"
        "kept.write('written')\n"
        f"logging.basicConfig(filename={str(log)!r})\n"
        "logging.getLogger().warning('logged')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert data.read_text() == "written"
    assert log.read_text().strip() == "WARNING:root:logged"
