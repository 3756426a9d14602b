"""What the Snakefile runs in Snakemake's own process, beside the rules."""

from __future__ import annotations

import fcntl
import inspect
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

import snakemake.common

F = TypeVar("F", bound=Callable[..., object])
WORKFLOW_LOCK = Path(".snakemake/qdiff/workflow.lock")
_held: IO[str] | None = None  # open for as long as this process runs the workflow


class WorkflowRunningError(RuntimeError):
    """Another Snakemake runs this workflow in this directory."""


def hold_workflow_lock(path: Path = WORKFLOW_LOCK) -> None:
    """Run jobs in this directory only while holding its lock: an exclusive ``flock`` held
    until this process ends (the kernel releases it however the process ends, a kill
    included). Snakemake's own lock checks, then writes, so two workflows started at the
    same instant can both pass it and run every job twice. Called by the workflow's onstart
    handler, which runs only when jobs are about to run (not for a dry run, --report,
    --unlock, ...), in Snakemake's main process."""
    global _held  # noqa: PLW0603 - one lock per process, held until it exits
    if _held is not None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - held open until the process exits
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise WorkflowRunningError(
            f"another snakemake is running this workflow in {Path.cwd()} ({holder}): "
            "wait for it to end, or stop it; two at once would run every job twice"
        ) from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held = handle


def end_scheduler_timers() -> None:
    """Cancel the timers Snakemake's scheduler has left (its job rate limit,
    ``--max-jobs-per-timespan``, re-arms a 1 s ``threading.Timer`` on every pass). Python
    waits for them at exit, so without this every run that ran jobs ended about a second
    after its last job. Called by the workflow's onsuccess and onerror handlers."""
    for thread in threading.enumerate():
        if isinstance(thread, threading.Timer) and getattr(
            thread.function, "__module__", ""
        ).startswith("snakemake."):
            thread.cancel()


def signature_once(func: F) -> F:
    """``func``, a rule's per-job function, with its signature worked out now, once.

    Snakemake asks for a job function's parameters (``inspect.signature``) two or three
    times every time it calls it: about 11,000 times for qdiff's functions in planning a
    matrix of 10 models x 10 devices x 3 dequant modes x 30 prompts. Asking once saved 4%
    of that planning's time on a 2-core AMD EPYC (Python 3.11) and nothing measurable on
    the H200 host (Python 3.12; README "Large matrices"). Its own wrappers hand it their
    signature once through ``snakemake.common.overwrite_function_params``; so does this. A
    Snakemake without that hook asks as before."""
    overwrite = getattr(snakemake.common, "overwrite_function_params", None)
    if overwrite is not None:
        overwrite(func, inspect.signature(func).parameters)
    return func
