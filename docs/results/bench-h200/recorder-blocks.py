"""Why the text stage's recording on threads grows slower beyond 4 workers on the lent
machine's 16 CPUs (recorder-scaling.py at 4b28393, on an H100's 16 CPUs: add_rows 16.2 ms
a window at 4 workers, 20.8 at 8, 37.5 at 16; slice_pass on forked processes 3.6 ms at
16): whether the handing over of the GIL between a block's numpy calls costs it. Fewer,
larger blocks hand it over less often; a shorter switch interval hands it over sooner. One
SmolLM2-sized window (255 rows of 49,152 float32 logits, a teacher's 1,024 ids a row) as
recorder-scaling.py makes it; ``ForcedRecorder.add_rows`` with n workers and
``qdiff.core.forced.BLOCK_BYTES`` of 1 to 16 MiB, under CPython's default switch interval
(5 ms) and 0.1 ms; the least of 7 timings each. Since the commit after 4b28393 a block is
BLOCK_BYTES for each worker, so the script sets it to the block's size over n; its logs
(recorder-blocks-4b28393-h100.log, ../bench-epyc/recorder-blocks-4b28393.log) were made at
4b28393, where BLOCK_BYTES was the block's size and the script set it so. Run from a checkout:
  PYTHONPATH=src python3 docs/results/bench-h200/recorder-blocks.py"""

import os
import sys
import time

import numpy as np

from qdiff.core import forced
from qdiff.core.forced import ForcedRecorder
from qdiff.core.text import LEADING_KEPT

rng = np.random.default_rng(0)
rows = rng.standard_normal((255, 49152)).astype(np.float32) * 3
ids = np.stack([np.argsort(-r)[:1024].astype(np.int32) for r in rows])


def least(recorder: ForcedRecorder, n: int = 7) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        recorder.add_rows(0, rows, ids)
        best = min(best, time.perf_counter() - start)
    return best


cpus = len(os.sched_getaffinity(0))
print(f"CPUs this process may run on: {cpus}; Python {sys.version.split()[0]}", flush=True)
counts = [n for n in (1, 2, 4, 6, 8, 12, 16) if n <= cpus]
reference = None
for interval in (sys.getswitchinterval(), 1e-4):
    sys.setswitchinterval(interval)
    for mib in (1, 2, 4, 8, 16):
        line = []
        for n in counts:
            forced.BLOCK_BYTES = (mib << 20) // n  # add_rows makes blocks of n times it
            recorder = ForcedRecorder(1, 255, 1024, n_top=LEADING_KEPT, workers=n)
            recorder.begin_prompt(0, 256, list(range(255)))
            line.append(f"{n}: {least(recorder) * 1e3:5.1f}")
            arrays = recorder.arrays
            if reference is None:
                reference = {k: v.copy() for k, v in arrays.items()}
            same = all(
                np.array_equal(reference[k], arrays[k], equal_nan=arrays[k].dtype.kind == "f")
                for k in reference
            )
            if not same:
                line[-1] += " (arrays differ)"
        print(
            f"switch interval {interval * 1e3:.1f} ms, blocks of {mib:2d} MiB, add_rows ms a"
            f" window by workers: " + ", ".join(line),
            flush=True,
        )
