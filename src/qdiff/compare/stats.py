"""Comparisons between setups decided over all prompts, with their uncertainty: never by
one prompt's maximum."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

BOOTSTRAP_DRAWS = 4000
LEVEL = 0.95  # the intervals' coverage
TINY = 1e-300  # a distance of 0 (bit-identical): its logarithm stays finite


def paired_ratio(near: Sequence[float], far: Sequence[float], seed: int = 0) -> dict[str, Any]:
    """How many times ``far`` is ``near``, prompt by prompt (the two paired by prompt): the
    geometric mean over prompts of far/near, with a bootstrap percentile interval (LEVEL)
    from resampling the prompts. ``verdict``: "farther" when the interval is above 1,
    "nearer" when below, "indistinguishable" when it holds 1."""
    a = np.log(np.maximum(np.asarray(near, dtype=np.float64), TINY))
    b = np.log(np.maximum(np.asarray(far, dtype=np.float64), TINY))
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"unpaired or empty: {a.shape} vs {b.shape}")
    diff = b - a
    draws = np.random.default_rng(seed).integers(0, diff.size, (BOOTSTRAP_DRAWS, diff.size))
    means = diff[draws].mean(axis=1)
    low, high = np.exp(np.quantile(means, [(1 - LEVEL) / 2, (1 + LEVEL) / 2]))
    ratio = float(np.exp(diff.mean()))
    verdict = "farther" if low > 1 else "nearer" if high < 1 else "indistinguishable"
    return {
        "ratio": ratio,
        "low": float(low),
        "high": float(high),
        "n": int(diff.size),
        "farther_on": int((diff > 0).sum()),  # prompts where ``far`` is the farther
        "verdict": verdict,
    }


def wilson(k: int, n: int) -> tuple[float, float]:
    """The Wilson score interval (LEVEL) of a proportion k/n: a coverage measured on n
    held-out cases, with its uncertainty."""
    if n == 0:
        return 0.0, 1.0
    z = 1.959963984540054  # the normal quantile of (1 + LEVEL) / 2
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def geometric_mean(values: Sequence[float]) -> float:
    """The mean that ``paired_ratio`` compares: rankings by it agree with its verdicts."""
    return float(np.exp(np.mean(np.log(np.maximum(np.asarray(values, dtype=np.float64), TINY)))))
