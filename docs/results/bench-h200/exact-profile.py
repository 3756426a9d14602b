"""Where a float64 window of the exact engine along the text goes: exact / f32 3.41-3.57x
on the lent H100's 16 CPUs (bench-text-4b28393-h100.log, bench-text-blocks8-h100.log),
against a window's BLAS products of 303 ms on 16 threads (exact-blas-scaling-4b28393-h100.log)
out of about 1.4 s. One process, one GGUF, windows of 512 random token ids scored as the
text stage's exact job scores them (qdiff.exact.reference: every position through the
layers, the last 256 positions' full-vocabulary logits, recorded in float64 at 1,024 slice
ids a position). The first window dequantizes the weights; the faster of the next two is
shown, split by where its wall time went (each part without the parts it calls): the
projections (``ExactModel.linear``: BLAS), attention's core (``_softmax_attention``: its
products and softmax), the rest of attention (Q/K/V's shapes, RoPE, masks), the norms,
the activation, the recording (``ForcedRecorder.add_rows``), and what is left. Per
setting: numpy's BLAS threads (threadpoolctl) and qdiff's workers (qdiff.core.threads).
Run from the repository's root:
  PYTHONPATH=src python3 docs/results/bench-h200/exact-profile.py GGUF"""

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from qdiff.core import forced, threads
from qdiff.exact import model

spent: dict[str, float] = {}
stack: list[float] = []  # the time the parts called by each open part took


def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """``f``, its wall time without its timed callees' added to ``spent[name]`` (called on
    the main thread only)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        stack.append(0.0)
        try:
            return f(*args, **kwargs)
        finally:
            inner, took = stack.pop(), time.perf_counter() - start
            spent[name] = spent.get(name, 0.0) + took - inner
            if stack:
                stack[-1] += took

    return run


model.ExactModel.linear = timed("projections", model.ExactModel.linear)
model._softmax_attention = timed("attention core", model._softmax_attention)
model.ExactModel._attention = timed("attention rest", model.ExactModel._attention)
model.rms_norm = timed("norms", model.rms_norm)
model.silu = timed("activation", model.silu)
model.ExactModel.gelu = timed("activation", model.ExactModel.gelu)
model.Weights.float64 = timed("dequantize", model.Weights.float64)
forced.ForcedRecorder.add_rows = timed("record", forced.ForcedRecorder.add_rows)

path = Path(sys.argv[1])
cpus = len(os.sched_getaffinity(0))
rng = np.random.default_rng(0)
print(f"{path.name}, {cpus} CPUs; ms a window (the faster of windows 2 and 3)", flush=True)
# more threads than CPUs only oversubscribes them (BLAS's 8 threads on 2 CPUs: 98 s a window)
settings = dict.fromkeys(
    (min(b, cpus), min(w, cpus)) for b, w in [(16, 8), (8, 8), (16, 16), (16, 4)]
)
for blas, workers in settings:
    threads.MAX_WORKERS = workers
    with threadpool_limits(blas, user_api="blas"):
        exact = model.ExactModel(path, n_ctx=512)
        vocab = exact.hp.n_vocab
        best: tuple[float, dict[str, float]] = (float("inf"), {})
        for w in range(3):
            tokens = rng.integers(0, vocab, 512).tolist()
            ids = np.array([rng.permutation(vocab)[:1024] for _ in range(256)], np.int32)
            spent.clear()
            start = time.perf_counter()
            hidden = exact.hidden([tokens[:-1]])[0]
            logits = exact.logits(hidden[255:])
            recorder = forced.ForcedRecorder(1, 256, 1024, dtype=np.float64, n_top=2)
            recorder.begin_prompt(0, 256, tokens[256:])
            recorder.add_rows(0, logits, ids)
            took = time.perf_counter() - start
            if w == 0:
                print(
                    f"  first window {took * 1e3:.0f} (dequantize {spent['dequantize'] * 1e3:.0f})"
                )
            else:
                best = min(best, (took, dict(spent)), key=lambda b: b[0])
        took, parts = best
        parts["rest"] = took - sum(parts.values())
        print(
            f"BLAS threads {blas:2d}, workers {workers:2d}: {took * 1e3:6.0f}: "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in parts.items() if k != "dequantize"),
            flush=True,
        )
        del exact, hidden, logits, recorder
