"""The exact engine along a finished run's text, as its exact_text job computes it
(qdiff.exact.reference, layer by layer), on 1 and on 2 threads (qdiff.core.threads) in turn,
3 rounds, for each model of the run; then whether the two give the same arrays bit for bit.
Run from the repository's root on a finished default experiment in DIR:
  PYTHONPATH=src python3 docs/results/bench-epyc/exact-text-threads.py DIR"""

import sys
import time
from pathlib import Path

import numpy as np

from qdiff.core import threads
from qdiff.core.io import load_arrays
from qdiff.core.text import as_run
from qdiff.exact.reference import reference

base = Path(sys.argv[1])
for text in sorted((base / "results/text").iterdir()):
    model = text.name
    teacher = load_arrays(text / "cpu/none/text.npz")
    run = as_run(teacher["window_tokens"].tolist(), 512)
    seconds: dict[int, list[float]] = {1: [], 2: []}
    arrays: dict[int, dict[str, np.ndarray]] = {}
    for _ in range(3):
        for n in (1, 2):
            threads.workers = lambda n=n: n
            start = time.perf_counter()
            _, arrays[n] = reference(
                base / f"resources/models/{model}.gguf",
                run,
                teacher["slice_ids"],
                1024,
                layer_by_layer=True,
                n_top=10,
                keep_first=False,
            )
            seconds[n].append(time.perf_counter() - start)
    same = all(
        np.array_equal(arrays[1][k], arrays[2][k], equal_nan=arrays[1][k].dtype.kind == "f")
        for k in arrays[1]
    )
    times = {n: ", ".join(f"{s:.2f}" for s in v) for n, v in seconds.items()}
    print(
        f"{model}: {len(teacher['window_tokens'])} windows; 1 thread {times[1]} s; 2 threads {times[2]} s; "
        f"least {min(seconds[1]) / min(seconds[2]):.2f}x; bit-identical: {same}",
        flush=True,
    )
