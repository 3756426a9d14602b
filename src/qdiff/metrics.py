"""Distances between two runs' logits, declared once in ``PAIR_METRICS``.

Each metric is computed per prompt (vectorised over prompts and vocabulary), summarised over
prompts by the statistics it names, shown in the report's pairs table by the ones it marks,
and explained by its note; ``compare.py``, the report and the TSV tables all iterate the
table, so a new metric is one entry here.

Definitions follow the tools the field already uses:
- NMSE as llama.cpp's test-backend-ops: sum((b - a)^2) / sum(a^2), ``a`` the reference.
- KL divergence as llama-perplexity --kl-divergence: KL(P_a || P_b) of the softmaxes.
All arithmetic is float64, so the metric adds no rounding of its own. Each run's logits of
a prompt are prepared once (``prepare``: softmax weights, norm, top tokens) however many
pairs they are in, and a pair then costs a few passes over the exact differences of its
logits (``compare_sides``), so comparing every pair of many runs is cheap
(qdiff.compare.compare_model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

STATISTICS: dict[str, Callable[[np.ndarray], float]] = {
    "max": lambda x: float(np.max(x)),
    "mean": lambda x: float(np.mean(x)),
    "median": lambda x: float(np.median(x)),
    "p90": lambda x: float(np.percentile(x, 90)),
    "p99": lambda x: float(np.percentile(x, 99)),
    "rms": lambda x: float(np.sqrt(np.mean(np.square(x)))),
    "count": lambda x: int(np.sum(x)),  # flags: how many prompts
}


@dataclass(frozen=True)
class PairMetric:
    key: str  # per-prompt field of a comparison
    header: str  # its name in tables
    note: str  # one sentence for the report's legend
    summaries: tuple[str, ...] = ()  # STATISTICS over prompts, stored as "<key>_<stat>"
    shown: tuple[str, ...] = ()  # which of them the pairs table shows
    flag: bool = False  # a yes/no per prompt, summarised as a count

    def summary_key(self, stat: str) -> str:
        return f"{self.key}_{stat}"

    def column(self, stat: str) -> str:
        return self.header if len(self.shown) == 1 else f"{self.header} {stat}"


PAIR_METRICS: tuple[PairMetric, ...] = (
    PairMetric(
        "max_abs", "max \\|Δ\\|", "largest |b − a| of any logit", ("max", "median", "p90"), ("max",)
    ),
    PairMetric(
        "mean_abs", "mean \\|Δ\\|", "mean |b − a| over the tokens compared", ("mean",), ("mean",)
    ),
    PairMetric("rms", "RMS", "root mean square of b − a", ("rms",), ("rms",)),
    PairMetric(
        "nmse", "NMSE", "Σ(b−a)²/Σa², as llama.cpp's test-backend-ops", ("mean",), ("mean",)
    ),
    PairMetric(
        "kl",
        "KL",
        "KL(softmax a ‖ softmax b), as llama-perplexity",
        ("mean", "max", "median", "p99"),
        ("mean", "max"),
    ),
    PairMetric("kl_ba", "KL(b‖a)", "KL with b as the reference", ("mean",)),
    PairMetric("dp_top", "Δp", "change of the probability of a's top token", ("rms",)),
    PairMetric("dp_top_ba", "Δp(b)", "change of the probability of b's top token", ("rms",)),
    PairMetric("top1_margin_a", "margin", "a's top-1 minus top-2 logit"),
    PairMetric(
        "top1_agree",
        "top-1",
        "prompts whose first greedy token agrees",
        ("count",),
        ("count",),
        flag=True,
    ),
    PairMetric(
        "bit_identical",
        "bit-identical",
        "prompts whose logits are bit for bit equal",
        ("count",),
        ("count",),
        flag=True,
    ),
)
METRICS = {m.key: m for m in PAIR_METRICS}


@dataclass(frozen=True)
class Side:
    """One prompt's logits of one run, prepared once however many pairs it is in."""

    logits: np.ndarray  # as stored (float32 from llama.cpp, float64 for exact references)
    weights: np.ndarray  # exp(logits - top logit), float64: the softmax times `total`
    total: float  # sum of weights
    lse: float  # log-sum-exp: log p = logits - lse
    sq_norm: float  # sum of logits^2, NMSE's denominator
    top: int  # the greedy token (lowest id among ties, as argmax)
    margin: float  # top-1 minus top-2 logit

    def p(self, token: int) -> float:
        return float(self.weights[token]) / self.total


def prepare(logits: np.ndarray) -> Side:
    """A ``Side`` of one prompt's logits (1-D)."""
    if logits.ndim != 1 or logits.shape[0] == 0:
        raise ValueError(f"no logits to compare (shape {logits.shape})")
    top = int(logits.argmax())
    peak = float(logits[top])
    second = max(
        (float(part.max()) for part in (logits[:top], logits[top + 1 :]) if part.size),
        default=peak,
    )
    weights = logits.astype(np.float64)  # a copy, turned into exp(logits - peak) in place
    sq_norm = float(np.dot(weights, weights))
    weights -= peak
    np.exp(weights, out=weights)
    total = float(weights.sum())
    return Side(logits, weights, total, peak + float(np.log(total)), sq_norm, top, peak - second)


def compare_sides(a: Side, b: Side, scratch: np.ndarray | None = None) -> dict[str, Any]:
    """Every PAIR_METRIC of one prompt, ``a`` the reference (``scratch``: a float64 buffer
    of the vocabulary's size, reused across pairs).

    Every pass over the vocabulary reads delta = b - a, exact in float64 for float32 logits:
    |delta| for max, mean, RMS and NMSE, and the softmax-weighted sums of delta for both KL
    divergences, since log p_a - log p_b = (lse_b - lse_a) - delta."""
    if a.logits.shape != b.logits.shape:
        raise ValueError(f"logit shapes differ: {a.logits.shape} vs {b.logits.shape}")
    delta = np.subtract(b.logits, a.logits, out=scratch, dtype=np.float64)
    squares = float(np.dot(delta, delta))
    shift = b.lse - a.lse
    kl = shift - float(np.dot(a.weights, delta)) / a.total  # sum p_a (log p_a - log p_b)
    kl_ba = float(np.dot(b.weights, delta)) / b.total - shift  # sum p_b (log p_b - log p_a)
    np.abs(delta, out=delta)
    max_abs = float(delta.max())
    size = delta.shape[0]
    identical = max_abs == 0.0 or (not np.isfinite(max_abs) and np.array_equal(a.logits, b.logits))
    values = {
        "max_abs": max_abs,
        "mean_abs": float(delta.sum()) / size,
        "rms": float(np.sqrt(squares / size)),
        "nmse": squares / max(a.sq_norm, float(np.finfo(float).tiny)),
        # identical inputs are 0 exactly, whatever the rounding of the sums above
        "kl": 0.0 if identical else max(kl, 0.0),
        "kl_ba": 0.0 if identical else max(kl_ba, 0.0),
        # Δp as llama-perplexity reports it, for the reference's own top token (no corpus here)
        "dp_top": b.p(a.top) - a.p(a.top),
        "dp_top_ba": a.p(b.top) - b.p(b.top),
        "top1_margin_a": a.margin,
        "top1_agree": a.top == b.top,
        "bit_identical": bool(identical),
    }
    assert values.keys() == METRICS.keys(), "every PAIR_METRIC must be computed"
    return values


def logit_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row values of every PAIR_METRIC for two (prompts, vocab) logit arrays; ``a`` is
    the reference."""
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape}")
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"no logits to compare (shape {a.shape})")
    scratch = np.empty(a.shape[1])
    rows = [compare_sides(prepare(x), prepare(y), scratch) for x, y in zip(a, b, strict=True)]
    return {key: np.array([row[key] for row in rows]) for key in METRICS}


def summarise(per_prompt: dict[str, np.ndarray]) -> dict[str, float]:
    """Every metric's summaries over prompts, keyed "<metric>_<statistic>"."""
    return {
        m.summary_key(stat): STATISTICS[stat](np.asarray(per_prompt[m.key]))
        for m in PAIR_METRICS
        for stat in m.summaries
    }


def fork_step(tokens_a: list[int], tokens_b: list[int]) -> int | None:
    """The first generated step (0-based) where two greedy outputs differ, or None."""
    for step, (x, y) in enumerate(zip(tokens_a, tokens_b, strict=False)):
        if x != y:
            return step
    if len(tokens_a) != len(tokens_b):
        return min(len(tokens_a), len(tokens_b))
    return None
