"""Distances between two runs' logits, declared once in ``PAIR_METRICS``.

Each metric is computed per prompt (vectorised over prompts and vocabulary), summarised over
prompts by the statistics it names, shown in the report's pairs table by the ones it marks,
and explained by its note; ``compare.py``, the report and the TSV tables all iterate the
table, so a new metric is one entry here.

Definitions follow the tools the field already uses:
- NMSE as llama.cpp's test-backend-ops: sum((b - a)^2) / sum(a^2), ``a`` the reference.
- KL divergence as llama-perplexity --kl-divergence: KL(P_a || P_b) of the softmaxes.
All arithmetic is float64, so the metric adds no rounding of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


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


def _kl(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    return np.maximum((np.exp(log_p) * (log_p - log_q)).sum(axis=-1), 0.0)


PAIR_METRICS: tuple[PairMetric, ...] = (
    PairMetric(
        "max_abs", "max \\|Δ\\|", "largest |b − a| of any logit", ("max", "median", "p90"), ("max",)
    ),
    PairMetric(
        "mean_abs", "mean \\|Δ\\|", "mean |b − a| over the vocabulary", ("mean",), ("mean",)
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


def logit_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row values of every PAIR_METRIC for two (prompts, vocab) logit arrays; ``a`` is
    the reference."""
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape}")
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"no logits to compare (shape {a.shape})")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    delta = b64 - a64
    abs_delta = np.abs(delta)
    log_pa, log_pb = log_softmax(a64), log_softmax(b64)
    rows = np.arange(len(a))
    top_a, top_b = a.argmax(axis=-1), b.argmax(axis=-1)
    top2_a = np.sort(a64, axis=-1)[:, -2:] if a.shape[-1] >= 2 else np.zeros((len(a), 2))
    values = {
        "max_abs": abs_delta.max(axis=-1),
        "mean_abs": abs_delta.mean(axis=-1),
        "rms": np.sqrt((delta**2).mean(axis=-1)),
        "nmse": (delta**2).sum(axis=-1) / np.maximum((a64**2).sum(axis=-1), np.finfo(float).tiny),
        "kl": _kl(log_pa, log_pb),
        "kl_ba": _kl(log_pb, log_pa),
        # Δp as llama-perplexity reports it, for the reference's own top token (no corpus here)
        "dp_top": np.exp(log_pb[rows, top_a]) - np.exp(log_pa[rows, top_a]),
        "dp_top_ba": np.exp(log_pa[rows, top_b]) - np.exp(log_pb[rows, top_b]),
        "top1_margin_a": top2_a[:, 1] - top2_a[:, 0],
        "top1_agree": top_a == top_b,
        "bit_identical": (a == b).all(axis=-1),
    }
    assert set(values) == set(METRICS), "every PAIR_METRIC must be computed"
    return values


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
