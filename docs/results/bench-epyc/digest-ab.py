"""The text stage's recording of one SmolLM2-sized synthetic window (255 rows of 49,152
logits, at a teacher's 1,024 ids, 10 leading ids kept) with each row's digest by SHA-256's
first 8 bytes (qdiff before d6c3ae5) and by XXH3 (after), in turn, 3 rounds: the least of 5
timings of ``add_rows`` each, with the CPUs this process may run on (at most 8), and the
digests alone on one thread. Run it with PYTHONPATH pointing at the qdiff to time:
  PYTHONPATH=src python3 docs/results/bench-epyc/digest-ab.py"""

import hashlib
import time
from collections.abc import Callable

import numpy as np
import xxhash

from qdiff.core import forced
from qdiff.core.text import LEADING_KEPT

rng = np.random.default_rng(0)
rows = rng.standard_normal((255, 49152)).astype(np.float32) * 3
ids = np.stack([np.argsort(-r)[:1024].astype(np.int32) for r in rows])
xxh3 = forced.digest


def sha256(logits: np.ndarray) -> int:
    raw = np.ascontiguousarray(logits, dtype=np.float32).view(np.uint8)
    return int.from_bytes(hashlib.sha256(raw.data).digest()[:8], "little")


def least(f: Callable[[], object], n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


recorder = forced.ForcedRecorder(1, 255, 1024, n_top=LEADING_KEPT)
recorder.begin_prompt(0, 256, list(range(255)))
print(f"add_rows with {recorder.workers} workers; xxhash {xxhash.VERSION}")
for round_ in range(3):
    for name, digest in (("sha256/8", sha256), ("xxh3_64", xxh3)):
        forced.digest = digest  # what add_rows calls
        took = least(lambda: recorder.add_rows(0, rows, ids))
        alone = least(lambda d=digest: [d(row) for row in rows])
        print(f"round {round_ + 1}, {name}: add_rows {took:.4f} s, the digests alone {alone:.4f} s")
