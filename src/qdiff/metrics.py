"""Distances between two runs' logits, vectorised over prompts (rows) and vocabulary.

Definitions follow the tools the field already uses:
- NMSE as llama.cpp's test-backend-ops: sum((b - a)^2) / sum(a^2), ``a`` the reference.
- KL divergence as llama-perplexity --kl-divergence: KL(P_a || P_b) of the softmaxes.
All arithmetic is float64, so the metric adds no rounding of its own.
"""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def logit_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row metrics of two (prompts, vocab) logit arrays; ``a`` is the reference."""
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape}")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    delta = b64 - a64
    abs_delta = np.abs(delta)
    squared = delta**2
    log_pa, log_pb = log_softmax(a64), log_softmax(b64)
    rows = np.arange(len(a))
    top_a, top_b = a.argmax(axis=-1), b.argmax(axis=-1)
    top2_a = np.sort(a64, axis=-1)[:, -2:] if a.shape[-1] >= 2 else np.zeros((len(a), 2))
    return {
        "max_abs": abs_delta.max(axis=-1),
        "mean_abs": abs_delta.mean(axis=-1),
        "rms": np.sqrt(squared.mean(axis=-1)),
        "nmse": squared.sum(axis=-1) / np.maximum((a64**2).sum(axis=-1), np.finfo(float).tiny),
        "kl": np.maximum((np.exp(log_pa) * (log_pa - log_pb)).sum(axis=-1), 0.0),
        "kl_ba": np.maximum((np.exp(log_pb) * (log_pb - log_pa)).sum(axis=-1), 0.0),
        "top1_a": top_a,
        # Δp as llama-perplexity reports it, for the reference's own top token (no corpus here)
        "dp_top": np.exp(log_pb[rows, top_a]) - np.exp(log_pa[rows, top_a]),
        "dp_top_ba": np.exp(log_pa[rows, top_b]) - np.exp(log_pb[rows, top_b]),
        "top1_b": top_b,
        "margin_a": top2_a[:, 1] - top2_a[:, 0],  # reference's top-1 minus top-2 logit
        "bit_identical": (a == b).all(axis=-1),
    }


def fork_step(tokens_a: list[int], tokens_b: list[int]) -> int | None:
    """The first generated step (0-based) where two greedy outputs differ, or None."""
    for step, (x, y) in enumerate(zip(tokens_a, tokens_b)):
        if x != y:
            return step
    if len(tokens_a) != len(tokens_b):
        return min(len(tokens_a), len(tokens_b))
    return None
