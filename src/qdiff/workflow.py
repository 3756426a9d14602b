"""What the Snakefile runs in Snakemake's own process, beside the rules."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import TypeVar

import snakemake.common

F = TypeVar("F", bound=Callable[..., object])


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
