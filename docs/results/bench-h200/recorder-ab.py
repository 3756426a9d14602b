"""The text stage's recording of one SmolLM2-sized window (255 rows of 49,152 logits at a
teacher's 1,024 ids, 10 leading ids kept, as the text stage keeps them): two versions of
``qdiff.core.forced`` (files given on the command line, e.g. one from ``git show``) in turn,
``ForcedRecorder.add_rows`` with 1 ... 16 workers (those this machine has), 3 rounds, the
least of 5 timings each; then how far the two versions' recorded log-sum-exps lie apart.
Run from the repository's root:
  git show b6c6ebf:src/qdiff/core/forced.py > /tmp/forced_a.py
  PYTHONPATH=src python3 docs/results/bench-h200/recorder-ab.py /tmp/forced_a.py src/qdiff/core/forced.py"""

import importlib.util
import os
import sys
import time
import types

import numpy as np

from qdiff.core.text import LEADING_KEPT


def load(path: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rng = np.random.default_rng(0)
rows = rng.standard_normal((255, 49152)).astype(np.float32) * 3
ids = np.stack([np.argsort(-r)[:1024].astype(np.int32) for r in rows])
versions = {path: load(path, f"forced_{i}") for i, path in enumerate(sys.argv[1:3])}
cpus = len(os.sched_getaffinity(0))
print(f"CPUs this process may run on: {cpus}")
recorded = {}
for round_ in range(3):
    for path, forced in versions.items():
        line = []
        for workers in [w for w in (1, 2, 4, 8, 16) if w <= cpus]:
            recorder = forced.ForcedRecorder(1, 255, 1024, n_top=LEADING_KEPT, workers=workers)
            recorder.begin_prompt(0, 256, list(range(255)))
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                recorder.add_rows(0, rows, ids)
                best = min(best, time.perf_counter() - start)
            line.append(f"{workers}: {best * 1e3:.1f}")
            recorded[path] = recorder.arrays
        print(f"round {round_ + 1}, {path}: ms a window by workers, {', '.join(line)}", flush=True)
a, b = (recorded[p] for p in versions)
print("largest |Δ| of the log-sum-exps:", float(np.abs(a["lse"] - b["lse"]).max()))
for name in ("top_ids", "slice_ids", "slice_logits", "digest"):
    print(f"{name} equal:", bool(np.array_equal(a[name], b[name])))
