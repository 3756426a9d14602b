"""Distances between two runs' logits, declared once in ``PAIR_METRICS``.

Each metric is computed per prompt (vectorised over prompts and vocabulary), summarised over
prompts by the statistics it names, shown in the report's pairs table by the ones it marks,
and explained by its note; ``compare.py``, the report and the TSV tables all iterate the
table, so a new metric is one entry here.

Definitions follow the tools the field already uses:
- NMSE as llama.cpp's test-backend-ops: sum((b - a)^2) / sum(a^2), ``a`` the reference.
- KL divergence as llama-perplexity --kl-divergence: KL(P_a || P_b) of the softmaxes.
All arithmetic is float64, so the metric adds no rounding of its own. ``compare_rows``
computes one prompt's metrics for every pair of many runs in one blocked sweep over the
vocabulary, each run's softmax weights computed once however many pairs it is in, so
comparing every pair of many runs is cheap (qdiff.compare.pairs.compare_model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def _sorted(values: np.ndarray | Sequence[float]) -> np.ndarray | None:
    """The values in order, or None if there are none or any is NaN (sorted last)."""
    ordered = np.sort(np.asarray(values).ravel())
    return None if ordered.size == 0 or np.isnan(ordered[-1]) else ordered


def median(values: np.ndarray | Sequence[float]) -> float:
    """``np.median``'s value, bit for bit: the middle value, or the mean of the two middle
    ones; NaN if any value is NaN or there is none. Without its cost: its first call imports
    numpy.ma (10-20 ms), and each call costs about 0.1 ms, which comparing a model's pairs
    pays hundreds of times (a median per position of every forced pair)."""
    ordered = _sorted(values)
    if ordered is None:
        return float("nan")
    middle = ordered.size // 2
    if ordered.size % 2:
        return float(ordered[middle])
    return float((ordered[middle - 1] + ordered[middle]) / 2)


def percentile(values: np.ndarray | Sequence[float], q: float) -> float:
    """``np.percentile(values, q)``'s value, bit for bit (its default "linear" method, and
    its arithmetic), without its cost: as ``median``."""
    ordered = _sorted(values)
    if ordered is None:
        return float("nan")
    position = (ordered.size - 1) * (q / 100)
    below = math.floor(position)
    if below >= ordered.size - 1:
        return float(ordered[-1])
    a, b = ordered[below], ordered[below + 1]
    weight, step = position - below, b - a
    # numpy interpolates from the nearer end
    return float(b - step * (1 - weight) if weight >= 0.5 else a + step * weight)


STATISTICS: dict[str, Callable[[np.ndarray], float]] = {
    "max": lambda x: float(np.max(x)),
    "mean": lambda x: float(np.mean(x)),
    "median": median,
    "p90": lambda x: percentile(x, 90),
    "p99": lambda x: percentile(x, 99),
    "rms": lambda x: float(np.sqrt(np.mean(np.square(x)))),
    "count": lambda x: int(np.sum(x)),  # flags: how many prompts
}


@dataclass(frozen=True)
class PairStats:
    """What one comparison of two logit vectors gathers (a the reference), from which every
    PAIR_METRIC is computed: over the full vocabulary (``compare_rows``) or over a teacher-
    forced slice (qdiff.compare.forced.first_step_metrics)."""

    n: int  # logits compared
    squares: float  # Σ(b − a)²
    abs_sum: float  # Σ|b − a|
    max_abs: float
    sq_norm_a: float  # Σa²
    kl: float  # KL(a‖b) of the softmaxes
    kl_ba: float
    dp_top: float  # p_b − p_a of a's top token
    dp_top_ba: float  # p_a − p_b of b's top token
    margin_a: float  # a's top-1 minus top-2 logit
    top1_agree: bool
    identical: bool  # bit for bit


@dataclass(frozen=True)
class PairMetric:
    key: str  # per-prompt field of a comparison
    header: str  # its name in tables
    note: str  # one sentence for the report's legend
    value: Callable[[PairStats], float | bool]  # from a comparison's stats
    summaries: tuple[str, ...] = ()  # STATISTICS over prompts, stored as "<key>_<stat>"
    shown: tuple[str, ...] = ()  # which of them the pairs table shows
    flag: bool = False  # a yes/no per prompt, summarised as a count

    def summary_key(self, stat: str) -> str:
        return f"{self.key}_{stat}"

    def column(self, stat: str) -> str:
        return self.header if len(self.shown) == 1 else f"{self.header} {stat}"


PAIR_METRICS: tuple[PairMetric, ...] = (
    PairMetric(
        "max_abs",
        "max \\|Δ\\|",
        "largest |b − a| of any logit",
        lambda s: s.max_abs,
        ("max", "median", "p90"),
        ("max",),
    ),
    PairMetric(
        "mean_abs",
        "mean \\|Δ\\|",
        "mean |b − a| over the tokens compared",
        lambda s: s.abs_sum / max(s.n, 1),
        ("mean",),
        ("mean",),
    ),
    PairMetric(
        "rms",
        "RMS",
        "root mean square of b − a",
        lambda s: math.sqrt(s.squares / max(s.n, 1)),
        ("rms",),
        ("rms",),
    ),
    PairMetric(
        "nmse",
        "NMSE",
        "Σ(b−a)²/Σa², as llama.cpp's test-backend-ops",
        lambda s: s.squares / max(s.sq_norm_a, float(np.finfo(float).tiny)),
        ("mean",),
        ("mean",),
    ),
    PairMetric(
        "kl",
        "KL",
        "KL(softmax a ‖ softmax b), as llama-perplexity",
        # identical inputs are 0 exactly, whatever the rounding of the sums
        lambda s: 0.0 if s.identical else max(s.kl, 0.0),
        ("mean", "max", "median", "p99"),
        ("mean", "max"),
    ),
    PairMetric(
        "kl_ba",
        "KL(b‖a)",
        "KL with b as the reference",
        lambda s: 0.0 if s.identical else max(s.kl_ba, 0.0),
        ("mean",),
    ),
    PairMetric(
        "dp_top", "Δp", "change of the probability of a's top token", lambda s: s.dp_top, ("rms",)
    ),
    PairMetric(
        "dp_top_ba",
        "Δp(b)",
        "change of the probability of b's top token",
        lambda s: s.dp_top_ba,
        ("rms",),
    ),
    PairMetric("top1_margin_a", "margin", "a's top-1 minus top-2 logit", lambda s: s.margin_a),
    PairMetric(
        "top1_agree",
        "top-1",
        "prompts whose first greedy token agrees",
        lambda s: s.top1_agree,
        ("count",),
        ("count",),
        flag=True,
    ),
    PairMetric(
        "bit_identical",
        "bit-identical",
        "prompts whose logits are bit for bit equal",
        lambda s: s.identical,
        ("count",),
        ("count",),
        flag=True,
    ),
)
METRICS = {m.key: m for m in PAIR_METRICS}


def metric_values(stats: PairStats) -> dict[str, Any]:
    """Every PAIR_METRIC of one comparison."""
    return {m.key: m.value(stats) for m in PAIR_METRICS}


BLOCK = 16_384  # tokens per block of the sweep: the rows' blocks and weights stay in cache


def check_comparable(a: np.ndarray, b: np.ndarray) -> None:
    """Raises ValueError, saying why, unless two logit rows can be compared."""
    for row in (a, b):
        if row.ndim != 1 or row.shape[0] == 0:
            raise ValueError(f"no logits to compare (shape {row.shape})")
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape}")


def compare_rows(
    rows: Sequence[np.ndarray], pairs: Sequence[tuple[int, int]]
) -> list[dict[str, Any]]:
    """Every PAIR_METRIC of one prompt for each pair ``(i, j)`` of ``rows`` (its logits in
    several runs, as stored: float32 from llama.cpp, float64 for exact references), with
    ``rows[i]`` the reference; the rows have one shape (``check_comparable``)."""
    sweep = _Sweep(rows, pairs)
    return [metric_values(sweep.stats(m, i, j)) for m, (i, j) in enumerate(pairs)]


class _Sweep:
    """One sweep over the vocabulary in blocks: each row's block is read, converted to
    float64 and turned into softmax weights once for all the pairs it is in, while it is in
    the CPU's cache (whole-vocabulary passes were bound by memory bandwidth). Every metric
    reads delta = b - a, exact in float64 for float32 logits: |delta| for max, mean, RMS
    and NMSE, and the weighted sums of delta for both KL divergences, since
    log p_a - log p_b = (lse_b - lse_a) - delta."""

    def __init__(self, rows: Sequence[np.ndarray], pairs: Sequence[tuple[int, int]]) -> None:
        self.rows, self.size = rows, rows[0].shape[0]
        self.tops = [int(row.argmax()) for row in rows]  # greedy: the lowest id among ties
        self.peaks = np.array([float(row[t]) for row, t in zip(rows, self.tops, strict=True)])
        self.seconds = [
            max((float(part.max()) for part in (row[:t], row[t + 1 :]) if part.size), default=peak)
            for row, t, peak in zip(rows, self.tops, self.peaks, strict=True)
        ]
        self.totals, self.sq_norms = np.zeros(len(rows)), np.zeros(len(rows))
        # per pair: Σ delta², the a- and b-weighted Σ delta, Σ|delta| (Python floats: cheaper
        # to add to than an array's items); and max |delta| of each block
        self.sums = [[0.0] * 4 for _ in pairs]
        self.maxima: list[list[float]] = [[] for _ in pairs]
        width = min(BLOCK, self.size)
        blocks, weights, delta = (
            np.empty((len(rows), width)),
            np.empty((len(rows), width)),
            np.empty(width),
        )
        for start in range(0, self.size, width):
            stop = min(start + width, self.size)
            x, w, d = blocks[:, : stop - start], weights[:, : stop - start], delta[: stop - start]
            self._block(start, stop, x, w)
            for m, (i, j) in enumerate(pairs):
                self._pair_block(m, x[i], x[j], w[i], w[j], d)
        self.lse = self.peaks + np.log(self.totals)  # log p = logits - lse

    def _block(self, start: int, stop: int, x: np.ndarray, w: np.ndarray) -> None:
        """Every row's block in float64 (x), and its weights exp(logits - peak) (w)."""
        for i, row in enumerate(self.rows):
            np.copyto(x[i], row[start:stop])
            self.sq_norms[i] += np.dot(x[i], x[i])
            np.subtract(x[i], self.peaks[i], out=w[i])
            np.exp(w[i], out=w[i])
            self.totals[i] += w[i].sum()

    def _pair_block(
        self, m: int, xa: np.ndarray, xb: np.ndarray, wa: np.ndarray, wb: np.ndarray, d: np.ndarray
    ) -> None:
        np.subtract(xb, xa, out=d)
        total = self.sums[m]
        total[0] += np.dot(d, d)
        total[1] += np.dot(wa, d)
        total[2] += np.dot(wb, d)
        np.abs(d, out=d)
        self.maxima[m].append(float(d.max()))
        total[3] += d.sum()

    def p(self, k: int, token: int) -> float:
        """Row k's probability of a token."""
        return float(np.exp(np.float64(self.rows[k][token]) - self.peaks[k])) / float(
            self.totals[k]
        )

    def stats(self, m: int, i: int, j: int) -> PairStats:
        squares, weighted_a, weighted_b, abs_sum = (float(x) for x in self.sums[m])
        max_abs = float(np.max(self.maxima[m]))  # NaN if any logit is
        shift = float(self.lse[j] - self.lse[i])
        return PairStats(
            n=self.size,
            squares=squares,
            abs_sum=abs_sum,
            max_abs=max_abs,
            sq_norm_a=float(self.sq_norms[i]),
            kl=shift - weighted_a / float(self.totals[i]),  # Σ p_a (log p_a - log p_b)
            kl_ba=weighted_b / float(self.totals[j]) - shift,  # Σ p_b (log p_b - log p_a)
            # Δp as llama-perplexity reports it, for the reference's own top token (no corpus)
            dp_top=self.p(j, self.tops[i]) - self.p(i, self.tops[i]),
            dp_top_ba=self.p(i, self.tops[j]) - self.p(j, self.tops[j]),
            margin_a=float(self.peaks[i]) - self.seconds[i],
            top1_agree=self.tops[i] == self.tops[j],
            identical=max_abs == 0.0
            or (not np.isfinite(max_abs) and np.array_equal(self.rows[i], self.rows[j])),
        )


def logit_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row values of every PAIR_METRIC for two (prompts, vocab) logit arrays; ``a`` is
    the reference."""
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {a.shape} vs {b.shape}")
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"no logits to compare (shape {a.shape})")
    rows = [compare_rows([x, y], [(0, 1)])[0] for x, y in zip(a, b, strict=True)]
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
