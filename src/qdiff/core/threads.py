"""Threads for the numpy work that does not share itself among the CPUs: numpy's
element-wise loops and reductions run on one thread (its BLAS products on all), but release
the GIL, as ctypes does for ggml's conversions, so shares of rows on threads run at once.
Every share computes what the whole would, row for row: the answers do not depend on the
number of threads. The threads live only inside ``sharing()``: a process that keeps idle
threads may not fork a worker (qdiff.jobs.can_fork)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np

# Each worker of a recording holds a block of rows (qdiff.core.forced): the cap bounds that
# memory on many-core machines, and more threads gained nothing on the lent H200's 16 CPUs
# (docs/results/bench-h200/recorder-profile.log: 16 workers slower than 8)
MAX_WORKERS = 8
# values below which a share is not worth a thread's hand-over (tens of microseconds)
LEAST_VALUES = 2**16


def workers() -> int:
    """The CPUs this process may run on (a SLURM job's share, or the machine's), at most
    ``MAX_WORKERS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        cpus = os.cpu_count() or 1
    return min(MAX_WORKERS, cpus)


# sharing()'s threads while its block runs, seen by the thread that opened it: a task on one
# of them that shares again runs on its own thread, and never waits for a busy pool
_open: ContextVar[ThreadPoolExecutor | None] = ContextVar("qdiff_sharing", default=None)


@contextmanager
def sharing() -> Iterator[None]:
    """``workers()`` threads for ``in_shares`` while the block runs, all of them ended when
    it ends; a block inside another's uses the outer one's threads."""
    if _open.get() is not None:
        yield
        return
    with ThreadPoolExecutor(workers(), thread_name_prefix="qdiff") as pool:
        token = _open.set(pool)
        try:
            yield
        finally:
            _open.reset(token)


def in_shares(task: Callable[[slice], object], n: int, row_values: int = 1) -> None:
    """``task(rows)`` for consecutive shares of ``range(n)`` that together cover it, on
    ``sharing()``'s threads (on this one outside ``sharing()``, where there is one CPU, or
    where the ``n`` rows of ``row_values`` values each are too few to share); a task's
    exception is raised here."""
    count = min(workers(), n, max(1, n * row_values // LEAST_VALUES))
    pool = _open.get()
    if count <= 1 or pool is None:
        task(slice(0, n))
        return
    cuts = np.linspace(0, n, count + 1).astype(int)
    list(pool.map(task, [slice(a, b) for a, b in itertools.pairwise(cuts)]))


def shared_rows(f: Callable[..., np.ndarray], x: np.ndarray, *along: np.ndarray) -> np.ndarray:
    """``f(x, *along)`` computed by shares of ``x``'s rows (first axis; ``along``: arrays
    with a row for each of x's, shared with them), for an ``f`` that computes each row
    alone (element-wise, or reducing within a row) and keeps x's shape and type."""
    out = np.empty_like(x)

    def share(rows: slice) -> None:
        out[rows] = f(x[rows], *(a[rows] for a in along))

    in_shares(share, len(x), x[0].size if len(x) else 1)
    return out
