"""The processes a job runs in and starts: its log and console, dying with the workflow,
children supervised (spawned or forked, with a timeout) and what their end means, and an exit
without Python's last garbage collection."""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import gc
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from qdiff.core import secrets

if TYPE_CHECKING:
    from qdiff.core.records import ErrorInfo

_PR_SET_PDEATHSIG = 1
_console_fd: int | None = None  # the terminal's stderr, before log_to redirected it
_exit_collection_skipped = False


def skip_exit_collection() -> None:
    """At exit, leave this process's objects to the operating system instead of garbage
    collecting them: Python's last collection walks the whole heap. On a 2-core AMD EPYC
    that took 0.3 s of every Snakemake run (its heap holds sqlalchemy and pandas), 0.25 s
    of the report's job (pandas, matplotlib) and 0.02 s of a run's supervising process.
    ``gc.freeze()`` as an exit handler takes every object out of that collection. Exit handlers, open files and logging flush as before; only
    unreachable reference cycles go unfreed, and nothing in qdiff writes through one."""
    global _exit_collection_skipped  # noqa: PLW0603 - once per process
    if not _exit_collection_skipped:
        atexit.register(gc.freeze)
        _exit_collection_skipped = True


def log_to(path: str | Path) -> TextIO:
    """Send this job's stderr to its Snakemake log, in append mode so that a child
    process writing to the same file is never overwritten."""
    global _console_fd  # noqa: PLW0603 - one terminal per process
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("")
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the job
    if _console_fd is None:
        _console_fd = os.dup(2)
    os.dup2(stream.fileno(), 2)  # native code (llama.cpp) writes to fd 2 directly
    sys.stderr = secrets.ScrubbedStream(stream)  # no hidden value reaches the log
    return stream


def console(message: str) -> None:
    """A progress line for the job's log and the terminal Snakemake runs in."""
    message = secrets.scrub_message(message)
    print(message, file=sys.stderr, flush=True)
    if _console_fd is not None:
        os.write(_console_fd, (message + "\n").encode())


# ---- dying with the workflow ----


def _parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def child_preexec() -> None:
    """``preexec_fn`` of every process a job starts: killed when the job dies."""
    _parent_death_signal(signal.SIGKILL)


def _proc_parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def _proc_is_snakemake(pid: int) -> bool:
    try:
        return b"snakemake" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _snakemake_ancestor() -> int | None:
    """The nearest ancestor process that is Snakemake (Linux), or None."""
    pid: int | None = os.getppid()
    for _ in range(8):
        if pid is None or pid <= 1:
            return None
        if _proc_is_snakemake(pid):
            return pid
        pid = _proc_parent(pid)
    return None


def _watch(ancestor: int, interval: float = 0.5) -> None:
    """End this process (and, through their parent-death signal, its children) as soon as
    ``ancestor`` is gone."""

    def loop() -> None:
        while _proc_is_snakemake(ancestor):
            time.sleep(interval)
        print("[qdiff] the workflow that started this job is gone: stopping", file=sys.stderr)
        os._exit(3)

    threading.Thread(target=loop, name="qdiff-watchdog", daemon=True).start()


def die_with_workflow() -> None:
    """Make this job end when the Snakemake process that started it ends."""
    ancestor = _snakemake_ancestor()
    if ancestor is None:
        return  # not started by Snakemake here (a test, or a cluster's job step)
    if ancestor == os.getppid() and _parent_death_signal(signal.SIGKILL):
        if os.getppid() != ancestor:  # it died before the signal was armed
            os._exit(3)
        return
    _watch(ancestor)


# ---- staged outputs under a claim ----


def _supervise(wait: Callable[[], int], kill: Callable[[], None], timeout: float) -> int | None:
    """``wait()`` for a child, ``kill()`` it when it runs past ``timeout``: its exit code, or
    None when it overran. A blocking wait returns as the child exits, and a timer kills it;
    Popen.wait(timeout) would poll, every 50 ms once the child has run a while."""
    overran = threading.Event()

    def on_timeout() -> None:
        overran.set()
        kill()

    timer = threading.Timer(timeout, on_timeout)
    timer.daemon = True
    timer.start()
    try:
        code = wait()
    finally:
        timer.cancel()
        timer.join()  # no thread left behind when the next child is forked
    return None if overran.is_set() else code


def spawn(
    argv: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None
) -> int | None:
    """Run a child process whose output is appended to ``log_path``; it dies with this job.
    Its exit code (negative: killed by that signal), or None when it ran past ``timeout``."""
    import subprocess

    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=child_preexec,  # noqa: PLW1509 - only prctl, no locks
        )
    return _supervise(proc.wait, proc.kill, timeout)


def can_fork() -> bool:
    """Whether ``fork`` may run a child here: on Linux, from a process with one thread (a job's
    supervisor, which loads no native library beyond Python's own). macOS's system frameworks
    are not safe across a fork without exec, and a thread could hold a lock the child would
    wait on."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


def fork(
    main: Callable[[], int], log_path: Path, timeout: float, env: dict[str, str]
) -> int | None:
    """``spawn`` for a Python function, where ``can_fork()``: ``main()`` runs in a forked
    child whose output is appended to ``log_path``, with ``env`` as its environment; it dies
    with this job. The child is a fresh process that starts with every module this one has
    imported, so it saves an interpreter's start and those imports (about 65 ms on the 2-core
    AMD EPYC). Its results are spawn's: the exit code ``main`` returns or exits with (1 if it
    raises; negative: killed by that signal), or None when it ran past ``timeout``."""
    sys.stdout.flush()
    sys.stderr.flush()
    with log_path.open("ab") as log, open(os.devnull, "rb") as devnull:
        pid = os.fork()
        if pid == 0:  # the child: it never returns from here
            code = 1
            try:
                child_preexec()
                os.dup2(devnull.fileno(), 0)
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout = secrets.ScrubbedStream(os.fdopen(1, "w", buffering=1, closefd=False))
                sys.stderr = secrets.ScrubbedStream(os.fdopen(2, "w", buffering=1, closefd=False))
                if faulthandler.is_enabled():  # it wrote to this process's stderr: now the log
                    faulthandler.enable(sys.stderr)
                os.environ.clear()
                os.environ.update(env)
                code = main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except BaseException:
                traceback.print_exc()
            finally:
                with suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)

    reaped = threading.Event()

    def wait() -> int:
        status = os.waitpid(pid, 0)[1]
        reaped.set()
        return os.waitstatus_to_exitcode(status)

    def kill() -> None:
        if not reaped.is_set():  # its pid is not another process's yet (as Popen.kill)
            os.kill(pid, signal.SIGKILL)

    return _supervise(wait, kill, timeout)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def child_outcome(
    returncode: int | None, handled: ErrorInfo | None, what: str, timeout_s: float
) -> ErrorInfo:
    """What a supervised child's end says (``spawn``, ``fork``): ``None`` a timeout, a
    negative code the signal that killed it (SIGKILL, most often the kernel's out-of-memory
    killer), else the error it wrote itself (``handled``) or its exit code. ``what``
    names the child in the message."""
    if returncode is None:
        return {
            "kind": "timeout",
            "message": f"{what} stopped after {timeout_s:g} s (run_timeout_s)",
        }
    if returncode < 0:
        name = _signal_name(-returncode)
        oom = " (most often the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return {"kind": "crash", "signal": name, "message": f"{what} was killed by {name}{oom}"}
    if handled is not None:
        return {**handled, "exit_code": returncode}
    return {"kind": "error", "exit_code": returncode, "message": f"{what} exited with {returncode}"}
