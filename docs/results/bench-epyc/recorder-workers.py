"""The text stage's recording of one SmolLM2-sized window (255 rows of 49,152 logits), by
``ForcedRecorder.add_rows`` on another combination (at the teacher's ids) and on the teacher
itself (its own top 1,024 ranked), the least of 5 (2 for the teacher) timings. Run it with
PYTHONPATH pointing at the qdiff to time (src of a checkout):
  PYTHONPATH=src python3 docs/results/bench-epyc/recorder-workers.py"""

import os
import time

import numpy as np

from qdiff.core.forced import ForcedRecorder

rng = np.random.default_rng(0)
rows = rng.standard_normal((255, 49152)).astype(np.float32) * 3
ids = np.stack([np.argsort(-r)[:1024].astype(np.int32) for r in rows])


def least(f, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


rec = ForcedRecorder(1, 255, 1024, n_top=2)
rec.begin_prompt(0, 256, list(range(255)))
print(f"CPUs this process may run on: {len(os.sched_getaffinity(0))}")
print(f"workers: {getattr(rec, 'workers', 'none (before ea1d5bf: two threads)')}")
print(f"add_rows, at the teacher's ids: {least(lambda: rec.add_rows(0, rows, ids), 5):.4f} s")
print(f"add_rows, the teacher itself:   {least(lambda: rec.add_rows(0, rows, None), 2):.4f} s")
