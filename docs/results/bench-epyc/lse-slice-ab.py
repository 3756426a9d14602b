"""The log-sum-exps of one SmolLM2-sized window (255 rows of 49,152 random float32 logits,
each row's own top 1,024 ids as its kept slice), timed with the qdiff found first on
PYTHONPATH: ``log_sum_exp_rows`` as its code takes them (with the slice where it takes one,
trial-lse-slice.patch), the least of 7 timings. Run from the repository's root, the code of
HEAD and the same with the patch applied in turn (a worktree at /tmp/trial):
    for r in 1 2 3; do for s in src /tmp/trial/src; do PYTHONPATH=$s .venv/bin/python \
        docs/results/bench-epyc/lse-slice-ab.py; done; done"""

import inspect
import time

import numpy as np

from qdiff.core import forced

rng = np.random.default_rng(0)
rows = rng.normal(0, 3, (255, 49152)).astype(np.float32)
kept = np.argsort(-rows, axis=1)[:, :1024].astype(np.int32)
takes_slice = "kept" in inspect.signature(forced.log_sum_exp_rows).parameters


def window() -> None:
    if takes_slice:
        forced.log_sum_exp_rows(rows, kept)
    else:
        forced.log_sum_exp_rows(rows)


least = float("inf")
for _ in range(7):
    start = time.perf_counter()
    window()
    least = min(least, time.perf_counter() - start)
way = "float32 terms, the slice's in float64" if takes_slice else "float64 throughout"
print(f"{way}: {least * 1e3:.1f} ms a window, one thread")
