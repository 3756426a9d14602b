"""Why the float64 engine along the text gains little from 16 CPUs (exact / f32 3.86x on the
lent H100's 16 CPUs, about 2x on the 2-core EPYC; bench-text-6f4adad-h100.log): whether
numpy's BLAS products scale there. The products of one SmolLM2-135M window (512 tokens;
hidden 576, 3 of 9 heads for K and V, feed-forward 1,536; the output head on the 256
scored rows, 49,152 ids), in float64 and float32, with numpy's BLAS limited to n threads
(threadpoolctl), the least of 5 timings; GFLOP/s of all the window's products together.
Run: python3 docs/results/bench-h200/exact-blas-scaling.py"""

import os
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

LAYERS = 30
# (rows, inner, columns, how many a window has)
PRODUCTS = [
    (512, 576, 576, 2 * LAYERS),  # Q and the attention output
    (512, 576, 192, 2 * LAYERS),  # K and V
    (512, 576, 1536, 2 * LAYERS),  # gate and up
    (512, 1536, 576, LAYERS),  # down
    (512, 64, 512, 9 * LAYERS),  # each head's scores
    (512, 512, 64, 9 * LAYERS),  # each head's weighted values
    (256, 576, 49152, 1),  # the output head
]
rng = np.random.default_rng(0)
wanted = ("internal_api", "version", "architecture", "num_threads")
print({k: v for k, v in threadpool_info()[0].items() if k in wanted})
cpus = len(os.sched_getaffinity(0))
print(f"CPUs this process may run on: {cpus}", flush=True)
for dtype in (np.float64, np.float32):
    operands = [
        (
            rng.standard_normal((m, k)).astype(dtype),
            rng.standard_normal((k, n)).astype(dtype),
            count,
        )
        for m, k, n, count in PRODUCTS
    ]
    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] * c for a, b, c in operands)
    for threads in [t for t in (1, 2, 4, 8, 16) if t <= cpus]:  # more would oversubscribe
        with threadpool_limits(threads, user_api="blas"):
            parts = []
            for a, b, count in operands:
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    a @ b
                    best = min(best, time.perf_counter() - start)
                parts.append(best * count)
        total = sum(parts)
        print(
            f"{np.dtype(dtype).name}, {threads:2d} BLAS threads: {total * 1e3:7.1f} ms a window, "
            f"{flops / total / 1e9:6.1f} GFLOP/s; by product (ms): "
            + ", ".join(f"{p * 1e3:.1f}" for p in parts),
            flush=True,
        )
