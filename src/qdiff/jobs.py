"""The harness every workflow script runs in (``qdiff.jobs.run``).

It gives each job the same guarantees, whatever the stage:

- **its own log**: stderr, native code's included, goes to the rule's log file;
- **one failure path**: an exception in the job's body is logged with its traceback and
  turned into the stage's failure outputs (a record that says what failed and what to do),
  so the job succeeds and everything downstream, the report included, still runs and names
  the failure;
- **no stray writers**: the job dies with the Snakemake process that started it (Linux's
  parent-death signal, or a watchdog where a shell stands in between), and so do the
  processes it starts (``child_preexec``), so a killed workflow leaves nothing running;
- **no half results, no late overwrites**: outputs are written under staging names and
  renamed into place together at the end, under a claim that the newest job of an output
  holds; a job that has been superseded (a rerun started after it) discards its outputs;
- **no work done twice** (``reuse``): a job whose rule, params and input files' content are
  those its existing outputs were made from keeps them (``inputs_key``). Snakemake plans
  every job downstream of one that runs before it can know that job's result will be the
  same, e.g. a model file made again, byte for byte, after ``rm -rf resources/``; such jobs
  then cost a process start, not their inference. Their rules mark the outputs
  ``update()``, so that Snakemake leaves them in place for the job to keep.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import faulthandler
import fcntl
import gc
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from qdiff import secrets

if TYPE_CHECKING:
    from qdiff.records import ErrorInfo

CLAIMS_DIR = Path(".snakemake/qdiff/claims")
_STAGING = ".staging"
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


class Claim:
    """Who may write an output: the newest job that started for it.

    A job takes the claim when it starts and renames its staged files into place only while
    it still holds it, under a lock, so a job that outlived its workflow can never overwrite
    what a later run wrote."""

    def __init__(self, output: Path, token: str) -> None:
        name = hashlib.sha1(str(output).encode()).hexdigest()
        self.path = CLAIMS_DIR / f"{name}.claim"
        self.token = token

    @contextmanager
    def _locked(self) -> Iterator[Any]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as f:
            fcntl.lockf(f, fcntl.LOCK_EX)
            try:
                yield f
            finally:
                fcntl.lockf(f, fcntl.LOCK_UN)

    def take(self) -> None:
        with self._locked() as f:
            f.seek(0)
            f.truncate()
            f.write(self.token)
            f.flush()

    @contextmanager
    def held(self) -> Iterator[bool]:
        """While the lock is held: whether this job still holds the claim."""
        with self._locked() as f:
            f.seek(0)
            yield f.read() == self.token


def staging_path(output: Path, token: str) -> Path:
    return output.with_name(f".{output.name}.{token[:12]}{_STAGING}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            _remove(child)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


class Job:
    """One running job: its outputs, staged until ``commit``."""

    def __init__(self, outputs: list[str], log: str | None, token: str | None = None) -> None:
        self.token = token or uuid.uuid4().hex
        self.outputs = [Path(p) for p in outputs]
        self.log_path = Path(log) if log else None
        self.claim = Claim(self.outputs[0], self.token)
        self.claim.take()
        for output in self.outputs:  # staging left behind by killed jobs of this output
            for stale in output.parent.glob(f".{output.name}.*{_STAGING}"):
                _remove(stale)
            output.parent.mkdir(parents=True, exist_ok=True)

    def out(self, output: str | Path) -> Path:
        """Where to write ``output`` (one of the job's outputs) until the job commits."""
        return staging_path(Path(output), self.token)

    def discard(self) -> None:
        for output in self.outputs:
            _remove(self.out(output))

    def commit(self, placeholder: Callable[[Path, Path], None]) -> bool:
        """Rename every staged output into place if this job still holds the claim (an
        output the job did not write gets ``placeholder(output, staged)``); otherwise
        discard them."""
        for output in self.outputs:
            staged = self.out(output)
            if not staged.exists() and not staged.is_symlink():
                placeholder(output, staged)
        with self.claim.held() as mine:
            if not mine:
                self.discard()
                print(
                    "[qdiff] a newer job for these outputs started after this one: "
                    "its outputs are kept and this job's are discarded",
                    file=sys.stderr,
                )
                return False
            for output in self.outputs:
                if output.is_dir() and not output.is_symlink():
                    _remove(output)  # os.replace cannot replace a non-empty directory
                os.replace(self.out(output), output)
        return True


class StageError(RuntimeError):
    """A failure whose message already says what went wrong and what to do: shown as is."""


class StopWorkflow(Exception):
    """A failure that must stop the workflow (e.g. strict_devices): the job fails."""


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


def empty_placeholder(output: Path, staged: Path) -> None:
    """An empty ``output`` (written at ``staged``) for a job that failed before writing it:
    its record (or sidecar) says why. Arrays are empty arrays, anything else an empty file."""
    if output.suffix in (".npy", ".npz"):
        import numpy as np  # only here: most jobs never need it

        with open(staged, "wb") as f:
            if output.suffix == ".npy":
                np.save(f, np.zeros((0, 0), dtype=np.float32), allow_pickle=False)
            else:
                np.savez(f)
    else:
        staged.write_bytes(b"")


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


def available_memory() -> tuple[int, str]:
    """Bytes this process may still take, and what limits it: the least of the memory
    Linux reports available, the cgroup's limit less its use (v1 and v2), and the address
    space ulimit. Elsewhere (macOS) the physical memory."""
    import resource

    limits = []
    meminfo = _read_ints(Path("/proc/meminfo"), "MemAvailable:")
    if meminfo is not None:
        limits.append((meminfo * 1024, "available memory"))
    for folder in _cgroup_memory_folders():
        for limit_file, use_file in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            limit, use = _read_ints(folder / limit_file), _read_ints(folder / use_file)
            if limit is not None and use is not None and limit < 2**60:
                limits.append((limit - use, f"the cgroup's memory limit ({folder})"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, "the address-space ulimit (ulimit -v)"))
    if not limits:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        limits.append((pages * size, "physical memory"))
    return min(limits)


def _read_ints(path: Path, key: str | None = None) -> int | None:
    """The number in a /proc or /sys file (on the line that starts with ``key``)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    if key is not None:
        text = next(
            (line.removeprefix(key) for line in text.splitlines() if line.startswith(key)), ""
        )
    words = text.split()
    return int(words[0]) if words and words[0].isdigit() else None


def _cgroup_memory_folders() -> list[Path]:
    """The memory cgroup folders of this process (cgroup v2's, or v1's memory controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "":
            folders.append(Path("/sys/fs/cgroup") / where.lstrip("/"))
            folders.append(Path("/sys/fs/cgroup/unified") / where.lstrip("/"))
        elif "memory" in controllers.split(","):
            folders.append(Path("/sys/fs/cgroup/memory") / where.lstrip("/"))
    return folders


def disk_full(folder: Path) -> str:
    """What to say when a disk is full: which one, and how much is free now."""
    import shutil

    free = shutil.disk_usage(folder).free / 2**20
    return (
        f"no space left on the disk that holds {folder} ({free:.0f} MiB free now that this "
        "job's partial files are removed): free some space, then rerun"
    )


def error_info(exc: BaseException, stage: str, folder: Path = Path()) -> dict[str, Any]:
    """What a failure record says about an exception: what failed and where, without a
    hidden value or a URL's query (qdiff.secrets.scrub_message); a full disk in plain words
    (``folder``: where the job writes)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        message = disk_full(folder)
    elif isinstance(exc, StageError):
        message = str(exc)
    else:
        message = f"{type(exc).__name__}: {exc}"
    return {"kind": "error", "stage": stage, "message": secrets.scrub_message(message)}


INPUTS_KEY = "inputs_key"  # in an ok record: what its job's outputs were made of


def inputs_key(smk: Any) -> str:
    """What a job's outputs are made of, as one digest: its rule and outputs, its params but
    the retry token, and its input files' content. A JSON file counts by its fields but its
    run token; a GGUF model by its sidecar, also an input, whose sha256 planning checks
    against the file's bytes (qdiff.sources.made_file_problem); any other file by its bytes
    (qdiff.hashcache: hashed again only when its identity on disk changed)."""
    from qdiff.hashcache import HashCache

    hashes = HashCache()
    digest = hashlib.sha256(f"{smk.rule}\n{list(smk.output)}".encode())
    for name, value in smk.params.items():
        if name != "retry_token":
            digest.update(f"\n{name}={value!r}".encode())
    for name in smk.input:
        path = Path(name)
        if path.suffix == ".gguf":
            content = "its sidecar"
        elif path.suffix == ".json":
            fields = json.loads(path.read_text())
            if isinstance(fields, dict):
                fields.pop("run_token", None)
            content = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        else:
            content = hashes.sha256(path)
        digest.update(f"\n{path}\t{content}".encode())
    hashes.save()
    return digest.hexdigest()


def _kept(job: Job, key: str) -> bool:
    """Whether the job's existing outputs were made of ``key`` by a job that ended ok."""
    try:
        record = json.loads(job.outputs[0].read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("status") == "ok"
        and record.get(INPUTS_KEY) == key
        and all(o.exists() for o in job.outputs)
    )


def _with_key(staged: Path, key: str) -> None:
    """Write ``key`` into a staged ok record (a failure is never kept: it is retried)."""
    from qdiff.io import read_json, write_json

    record = read_json(staged)
    if record.get("status") == "ok":
        write_json(staged, {**record, INPUTS_KEY: key})


def run(
    smk: Any,
    body: Callable[[Job], None],
    on_failure: Callable[[Job, dict[str, Any]], None],
    directories: tuple[str, ...] = (),
    reuse: bool = False,
    committed: Callable[[], None] | None = None,
) -> None:
    """Run a workflow script's ``body`` in the harness (see the module's docstring).

    ``smk`` is the script's ``snakemake`` object; ``on_failure(job, error)`` writes the
    stage's failure outputs with ``job.out``; outputs it leaves unwritten get empty
    placeholders (``directories`` names the outputs that are directories). With ``reuse``
    the first output is the job's JSON record, and outputs made of the same inputs are kept;
    ``committed()`` runs once the outputs are in place."""
    skip_exit_collection()
    log_to(smk.log[0])
    die_with_workflow()
    job = Job(list(smk.output), smk.log[0] if smk.log else None)
    key = inputs_key(smk) if reuse else None
    if key is not None and _kept(job, key):
        for output in job.outputs:
            os.utime(output)  # newer than the inputs that were made again
        console(
            f"[qdiff] {smk.rule} {dict(smk.wildcards.items())}: kept its outputs, made of "
            "these very inputs and params"
        )
        return
    try:
        body(job)
    except StopWorkflow:
        job.discard()
        raise
    except Exception as exc:  # the one failure path: record it, never lose the report
        print(secrets.scrub_message(traceback.format_exc()), file=sys.stderr)
        job.discard()
        error = error_info(exc, smk.rule, job.outputs[0].parent)
        if job.log_path:
            error["log"] = str(job.log_path)
        on_failure(job, error)
    if key is not None and job.out(job.outputs[0]).exists():
        _with_key(job.out(job.outputs[0]), key)

    def placeholder(output: Path, staged: Path) -> None:
        if str(output) in directories:
            staged.mkdir()
        else:
            empty_placeholder(output, staged)

    if job.commit(placeholder) and committed is not None:
        committed()
