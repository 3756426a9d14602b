"""The exact engine's attention, the whole (heads, n, n) matrix at once (as before c1f9dcc)
against blocks of 128 queries over the keys they see (qdiff.exact.model, since c1f9dcc):
one layer of SmolLM2-135M's shape (9 heads of 64), causal, float64, random inputs; the
fastest of 7 each, and the largest difference. Run from the repository's root:
    PYTHONPATH=src .venv/bin/python docs/results/bench-epyc/attention-blocks.py
"""

import time

import numpy as np

from qdiff.exact.model import _softmax_attention
from qdiff.exact.roundings import Scores


def whole(q, k, v, masked, how):
    scores = how(q.transpose(1, 0, 2) @ k.transpose(1, 2, 0))
    scores[:, masked] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return (probs @ v.transpose(1, 0, 2)).transpose(1, 0, 2)


def fastest(f, repeats=7):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


rng = np.random.default_rng(0)
how = Scores(0.125)
for n in (256, 512, 1024, 2048):
    q, k, v = (rng.normal(size=(n, 9, 64)) for _ in range(3))
    positions = np.arange(n)
    masked = positions[None, :] > positions[:, None]
    a = fastest(lambda q=q, k=k, v=v, masked=masked: whole(q, k, v, masked, how))
    b = fastest(lambda q=q, k=k, v=v, masked=masked: _softmax_attention(q, k, v, masked, how))
    diff = np.abs(whole(q, k, v, masked, how) - _softmax_attention(q, k, v, masked, how))
    print(
        f"n={n}: whole {1000 * a:.1f} ms, blocks {1000 * b:.1f} ms ({a / b:.2f}x), "
        f"largest difference {diff.max():.1e}"
    )
