"""The text stage's recorder alone (docs/performance.md): `ForcedRecorder.add_rows` on one
Gemma-sized window, 255 rows of 262,144 random logits, at a teacher's 1,024 ids (the top
1,024 of the rows plus noise), 7 times; the median and the fastest. With `old`, the
recorder of commit 0a16a85 from /tmp/forced_old.py (`git show
0a16a85:src/qdiff/core/forced.py > /tmp/forced_old.py`). Also the hashes' speeds here.

    .venv/bin/python docs/results/bench-epyc/recorder-alone.py new|old|hashes
"""

import hashlib
import importlib.util
import sys
import time
import zlib

import numpy as np


def recorder(which: str) -> None:
    if which == "old":
        spec = importlib.util.spec_from_file_location("qdiff.core.forced", "/tmp/forced_old.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["qdiff.core.forced"] = module
        spec.loader.exec_module(module)
    from qdiff.core.forced import ForcedRecorder, top_ids

    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((255, 262144)) * 3).astype(np.float32)
    noisy = rows + rng.standard_normal(rows.shape).astype(np.float32)
    ids = np.stack([top_ids(r, 1024) for r in noisy])
    rec = ForcedRecorder(1, 255, 1024, n_top=10)
    rec.begin_prompt(0, 257, list(range(255)))
    took = []
    for _ in range(7):
        start = time.perf_counter()
        rec.add_rows(0, rows, ids)
        took.append(time.perf_counter() - start)
    print(
        f"{which} add_rows, 255 rows of 262,144 logits at a teacher's 1,024 ids: median "
        f"{np.median(took):.3f} s, fastest {min(took):.3f} s"
    )


def hashes() -> None:
    rows = np.random.default_rng(0).standard_normal((255, 262144)).astype(np.float32)
    ways = {
        "blake2b": lambda b: hashlib.blake2b(b, digest_size=8).digest(),
        "sha1": lambda b: hashlib.sha1(b).digest(),
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "md5": lambda b: hashlib.md5(b).digest(),
        "crc32": zlib.crc32,
        "adler32": zlib.adler32,
    }
    for name, way in ways.items():
        best = min(_timed(way, rows) for _ in range(3))
        print(f"{name:10s} {best:.3f} s  {rows.nbytes / best / 1e9:.2f} GB/s")


def _timed(way, rows: np.ndarray) -> float:
    start = time.perf_counter()
    for row in rows:
        way(row.view(np.uint8).data)
    return time.perf_counter() - start


if __name__ == "__main__":
    hashes() if sys.argv[1] == "hashes" else recorder(sys.argv[1])
