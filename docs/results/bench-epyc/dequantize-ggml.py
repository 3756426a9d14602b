"""Every tensor of the default experiment's model files dequantized to float32 by gguf-py's
numpy dequantizers (what qdiff.exact.model.Weights used before e4361e1) and by ggml's own
to_float (qdiff.exact.dequantize, what it uses since): seconds for the whole file each way,
and how many tensors differ in any bit. Each file is read once before the timings, so both
read it from the page cache. Run from the repository's root after the default experiment
(its resources/models/):
    .venv/bin/python docs/results/bench-epyc/dequantize-ggml.py
"""

import time
from pathlib import Path

import gguf
import numpy as np

from qdiff.exact import dequantize

MODELS = Path("resources/models")
FILES = [
    "gemma-3-270m-q4_k_m.gguf",
    "smollm2-135m-instruct.requant-q4_k_m.gguf",
    "smollm2-135m-instruct.requant-q8_0.gguf",
]

for name in FILES:
    tensors = gguf.GGUFReader(MODELS / name).tensors
    for t in tensors:  # the file's pages in memory before either is timed
        np.asarray(t.data).sum()
    numpy_s = ggml_s = 0.0
    differing = 0
    for t in tensors:
        start = time.perf_counter()
        a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        middle = time.perf_counter()
        b = dequantize.float32(t.data, int(t.tensor_type), int(t.shape[0]))
        numpy_s += middle - start
        ggml_s += time.perf_counter() - middle
        differing += a.shape != b.shape or a.tobytes() != b.tobytes()
    types = sorted({t.tensor_type.name for t in tensors})
    print(
        f"{name}: gguf-py {numpy_s:.2f} s, ggml {ggml_s:.2f} s ({numpy_s / ggml_s:.1f}x); "
        f"{differing} of {len(tensors)} tensors differ; types {', '.join(types)}"
    )
