"""Where the text stage's recording of one SmolLM2-sized window (255 rows of 49,152 logits,
at a teacher's 1,024 ids, 10 leading ids kept as the text stage keeps them) spends its time
on this machine: ``ForcedRecorder.add_rows`` with 1 … 16 workers, each part of it on one
thread and shared among workers alone, and the copies of a window's logits; the least of 5
timings each. Run it with PYTHONPATH pointing at the qdiff to time (src of a checkout):
  PYTHONPATH=src python3 docs/results/bench-h200/recorder-profile.py"""

import itertools
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from qdiff.core.forced import (
    ForcedRecorder,
    digest,
    gather,
    leading_ids,
    log_sum_exp_rows,
)
from qdiff.core.text import LEADING_KEPT

rng = np.random.default_rng(0)
rows = rng.standard_normal((255, 49152)).astype(np.float32) * 3
ids = np.stack([np.argsort(-r)[:1024].astype(np.int32) for r in rows])
used = np.empty_like(rows)


def least(f: Callable[[], object], n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


def shared(part: Callable[[slice], object], workers: int) -> float:
    """``part`` over the rows, each of ``workers`` threads taking a share as add_rows does."""
    cuts = [slice(lo, hi) for lo, hi in itertools.pairwise(np.linspace(0, 255, workers + 1))]
    cuts = [slice(int(c.start), int(c.stop)) for c in cuts]
    with ThreadPoolExecutor(workers) as pool:
        return least(lambda: list(pool.map(part, cuts)))


print(f"CPUs this process may run on: {len(os.sched_getaffinity(0))}")
for workers in (1, 2, 4, 8, 16):
    recorder = ForcedRecorder(1, 255, 1024, n_top=LEADING_KEPT, workers=workers)
    recorder.begin_prompt(0, 256, list(range(255)))
    took = least(lambda r=recorder: r.add_rows(0, rows, ids))
    print(f"add_rows, {workers:2d} workers: {took:.4f} s")
parts: dict[str, Callable[[slice], object]] = {
    "log_sum_exp_rows": lambda s: log_sum_exp_rows(rows[s]),
    "digest of each row": lambda s: [digest(row) for row in rows[s]],
    "leading_ids": lambda s: leading_ids(rows[s], ids[s], LEADING_KEPT),
    "the slice's logits gathered": lambda s: gather(rows[s], ids[s]),
}
for name, part in parts.items():
    print(f"one thread, {name}: {least(lambda p=part: p(slice(None))):.4f} s")
for workers, (name, part) in itertools.product((4, 8), parts.items()):
    print(f"{workers} workers, {name} alone: {shared(part, workers):.4f} s")
copies: dict[str, Callable[[], object]] = {
    "a fresh copy of the window": rows.copy,
    "a copy into a buffer used before": lambda: np.copyto(used, rows),
    "a fresh copy, then concatenate": lambda: np.concatenate([rows.copy()]),
}
for name, copy in copies.items():
    print(f"one thread, {name}: {least(copy):.4f} s")
