"""Why the text stage's recording stops gaining beyond 4 workers on the lent machine's 16
CPUs (recorder-profile.log: add_rows 19.7 ms at 4 workers, 17.7 ms at 8, 28.9 ms at 16):
the GIL, or the machine. One SmolLM2-sized window (255 rows of 49,152 float32 logits, a
teacher's 1,024 ids a row), the least of 7 timings each:
  - ``ForcedRecorder.add_rows`` with n workers (threads, as the stage runs it);
  - its largest part, ``slice_pass``, shared among n threads and among n forked processes
    (which share no GIL; the rows are inherited, each returns its share's log-sum-exps);
  - numpy's float32 ``exp`` alone over the window in 1 MiB blocks, threads and processes.
Where processes gain and threads do not, the GIL (or numpy's own locks) limits the
threads; where neither gains, the machine's cores or memory do. Run from a checkout:
  PYTHONPATH=src python3 docs/results/bench-h200/recorder-scaling.py"""

import itertools
import multiprocessing
import os
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from qdiff.core.forced import ForcedRecorder, slice_pass
from qdiff.core.text import LEADING_KEPT

rng = np.random.default_rng(0)
rows = rng.standard_normal((255, 49152)).astype(np.float32) * 3
ids = np.stack([np.argsort(-r)[:1024].astype(np.int32) for r in rows])
BLOCK = (1 << 20) // (49152 * 4)


def least(f: Callable[[], object], n: int = 7) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


def shares(n: int) -> list[tuple[int, int]]:
    cuts = np.linspace(0, len(rows), n + 1).astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(cuts)]


def lse_share(share: tuple[int, int]) -> np.ndarray:
    lo, hi = share
    return slice_pass(rows[lo:hi], ids[lo:hi]).lse


def exp_share(share: tuple[int, int]) -> float:
    lo, hi = share
    buffer = np.empty((BLOCK, rows.shape[1]), np.float32)
    total = 0.0
    for start in range(lo, hi, BLOCK):
        x = rows[start : min(hi, start + BLOCK)]
        np.exp(x, out=buffer[: len(x)])
        total += float(buffer[: len(x)].sum(dtype=np.float64))
    return total


about = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
keys = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA")
print("\n".join(line for line in about if line.startswith(keys) or " cache" in line))
cpus = len(os.sched_getaffinity(0))
print(f"CPUs this process may run on: {cpus}", flush=True)
counts = [n for n in (1, 2, 4, 6, 8, 12, 16) if n <= cpus]
fork = multiprocessing.get_context("fork")
for n in counts:
    recorder = ForcedRecorder(1, 255, 1024, n_top=LEADING_KEPT, workers=n)
    recorder.begin_prompt(0, 256, list(range(255)))
    line = [f"add_rows {least(lambda r=recorder: r.add_rows(0, rows, ids)) * 1e3:6.1f}"]
    with ThreadPoolExecutor(n) as threads, fork.Pool(n) as procs:
        for name, task in (("slice_pass", lse_share), ("exp", exp_share)):
            cut = shares(n)
            list(procs.map(task, cut))  # every process started and warm
            on_threads = least(lambda t=task, c=cut: list(threads.map(t, c)))
            on_procs = least(lambda t=task, c=cut: procs.map(t, c, chunksize=1))
            line.append(f"{name}: threads {on_threads * 1e3:6.1f}, processes {on_procs * 1e3:6.1f}")
    print(f"{n:2d} workers, ms a window: " + "; ".join(line), flush=True)
