"""Dequantize every tensor of SmolLM2's Q8_0 file as qdiff.exact.model.Weights does (gguf-py,
then float64), through gguf-py's memmap views and through plain arrays: seconds for the
whole file, and whether both give the same values. Run from the repository's root:
    .venv/bin/python docs/results/bench-epyc/dequantize-float64.py
"""

import time

import gguf
import numpy as np

reader = gguf.GGUFReader("resources/models/smollm2-135m-instruct.requant-q8_0.gguf")
results = {}
for mode in ("memmap", "ndarray", "memmap"):
    start = time.perf_counter()
    out = []
    for t in reader.tensors:
        data = t.data if mode == "memmap" else np.asarray(t.data)
        values = gguf.quants.dequantize(data, t.tensor_type)
        out.append(np.asarray(values, dtype=np.float32).astype(np.float64))
    print(mode, time.perf_counter() - start)
    results[mode] = out
print(all(np.array_equal(a, b) for a, b in zip(results["memmap"], results["ndarray"], strict=True)))
