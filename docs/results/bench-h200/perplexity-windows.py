"""llama-perplexity's own time a window, timed as benchmarks/bench.py times it (its log's
stamps around the scoring; a run over 1 + n windows less one over the first alone; the
fastest of 3 runs each), on the file, text, window and threads that
docs/results/bench-xeon/text-in-place.py scores: SmolLM2-135M-Instruct Q4_1 along the
default text in 512-token windows, every CPU's thread, qdiff's default device settings.
Run from the repository's root, with a llama-perplexity built from the llama.cpp that
llama-cpp-python vendors (device.sh `build cuda perplexity`):
  PYTHONPATH=src python3 docs/results/bench-h200/perplexity-windows.py BINARY GGUF [BACKEND [N]]
BACKEND: cuda (default), vulkan or cpu; N: windows timed (default 8, text-in-place.py's)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path("benchmarks").resolve()))
from bench import TEXT_REPEATS, perplexity_arguments, perplexity_window_seconds

from qdiff.core.settings import DeviceSettings

binary, model = sys.argv[1], sys.argv[2]
backend = sys.argv[3] if len(sys.argv) > 3 else "cuda"
n = int(sys.argv[4]) if len(sys.argv) > 4 else 8
settings = DeviceSettings(backend=backend, threads=len(os.sched_getaffinity(0)))
device = {"cuda": "CUDA0", "vulkan": "Vulkan0"}.get(backend, "none")
args = perplexity_arguments(settings, 512, device)
text = "resources/texts/macbeth.txt"
window, first, whole = perplexity_window_seconds(binary, model, text, args, 1 + n)
print(f"llama-perplexity {' '.join(args)}")
print(
    f"  {n} windows of 512 tokens, {backend}, {settings.threads} threads, the fastest of {TEXT_REPEATS}"
)
print(f"  first window alone {first:.4f} s; 1 + {n} windows {whole:.4f} s")
print(f"  {window * 1000:7.1f} ms a window")
