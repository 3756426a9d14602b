"""The float64 engine's process before any weight (qdiff.exact.reference.BASE_MEMORY): its
resident memory after the imports the child makes, and after a first large product (which
starts OpenBLAS's threads and buffers). Run: .venv/bin/python docs/results/bench-epyc/base-memory.py"""

from pathlib import Path

import numpy as np

# the child's imports
import qdiff.core.forced
import qdiff.core.io
import qdiff.exact.reference  # noqa: F401


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


print(f"after the imports: {rss_mib():.1f} MiB")
a, b = np.random.rand(512, 2048), np.random.rand(2048, 2048)
before = rss_mib()
c = a @ b
print(
    f"after a first 512x2048 @ 2048x2048 product: {rss_mib():.1f} MiB "
    f"({rss_mib() - before - c.nbytes / 2**20:.1f} MiB beside its result)"
)
