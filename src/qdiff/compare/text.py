"""Every combination along a real text (qdiff.core.text), with the statistics of
``llama-perplexity --kl-divergence`` (tools/perplexity/perplexity.cpp, ``kl_divergence``):
each combination against the exact answer, and every pair of combinations.

Computed as llama-perplexity computes them: a mean's uncertainty is
sqrt((mean(x²) - mean(x)²) / (n - 1)) over the scored positions (it treats positions as
independent; neighbouring positions are not, so it is optimistic), ln(PPL(Q)/PPL(base))'s
takes the covariance of the two into account, percentiles interpolate linearly, "same top"
has a binomial uncertainty. Two things differ by design:

- KL divergence is over the teacher's ``top_k`` token ids and one bucket for the rest of the
  vocabulary (qdiff.compare.forced): a lower bound of the full KL, equal to it when the rest
  carries no mass. llama-perplexity sums over the tokens whose base log-probability is above
  -16 and stores the base's log-probabilities as uint16 (a rounding of about 2.4e-4 nat a
  step for a 16-nat range); qdiff keeps the logits in float32 (float64 for the exact answer).
- which combination is nearest the exact answer is decided by a paired ratio over blocks
  of ``BLOCK`` consecutive scored positions (within a window) with a bootstrap interval
  (qdiff.compare.stats), ranked by the same geometric mean: positions next to each other
  are not independent, blocks nearly are, and the default's 4 windows are too few to
  resample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from qdiff.compare.forced import kl_with_tail, with_probabilities
from qdiff.compare.stats import geometric_mean, paired_ratio
from qdiff.core.forced import equal_digests

# llama-perplexity's percentiles of KLD and of Δp (its "99.9%" is the 0.999 quantile)
KLD_PERCENTILES = (100, 99.9, 99, 95, 90, 50, 10, 5, 1, 0.1, 0)
P_DIFF_PERCENTILES = (100, 99.9, 99, 95, 90, 75, 50, 25, 10, 5, 1, 0.1, 0)
TOP_N = (5, 10)  # the base's top-1 within the other's top 5, top 10
BLOCK = 32  # scored positions a resampled block holds (about: a window's are split evenly)


def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """llama-perplexity's mean and its uncertainty (0 for 10 values or fewer)."""
    n = values.size
    if n < 1:
        return 0.0, 0.0
    mean = float(values.mean())
    var = float((values * values).mean()) - mean * mean
    return mean, (float(np.sqrt(var / (n - 1))) if var > 0 and n > 10 else 0.0)


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    n = a.size
    if n < 10:
        return 0.0
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (n - 1)


def _percentiles(values: np.ndarray, levels: Sequence[float]) -> dict[str, float]:
    return {f"{q:g}": float(np.quantile(values, q / 100)) for q in levels}


def perplexity_stats(base: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> dict[str, Any]:
    """llama-perplexity's statistics of ``other`` (its Q) against ``base``: two text passes
    (with_probabilities) at the same token ids."""
    scored = base["tokens"] >= 0
    nll, nll_base = -other["forced_logprob"][scored], -base["forced_logprob"][scored]
    kld_grid = kl_with_tail(base, other)
    kld = kld_grid[scored]
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    log_ppl, log_ppl_base = mean_and_uncertainty(nll), mean_and_uncertainty(nll_base)
    cov = _covariance(nll, nll_base)
    ppl, ppl_base = _exp_of(log_ppl), _exp_of(log_ppl_base)
    diff_var = ppl[1] ** 2 + ppl_base[1] ** 2 - 2 * ppl[0] * ppl_base[0] * cov
    ratio = log_ppl[0] - log_ppl_base[0]
    ratio_unc = float(np.sqrt(max(log_ppl[1] ** 2 + log_ppl_base[1] ** 2 - 2 * cov, 0.0)))
    mse = mean_and_uncertainty(p_diff * p_diff)
    rms = float(np.sqrt(mse[0]))
    same = float(np.mean(base["top_ids"][..., 0][scored] == other["top_ids"][..., 0][scored]))
    n = int(kld.size)
    leading = base["top_ids"][..., :1]
    return {
        "n": n,
        "ppl": ppl,
        "ppl_base": ppl_base,
        "ppl_diff": [ppl[0] - ppl_base[0], float(np.sqrt(max(diff_var, 0.0)))],
        "cor_ln_ppl": cov / (log_ppl[1] * log_ppl_base[1])
        if log_ppl[1] * log_ppl_base[1]
        else None,
        "ln_ppl_ratio": [ratio, ratio_unc],
        "ppl_ratio": [float(np.exp(ratio)), float(np.exp(ratio)) * ratio_unc],
        "kld": list(mean_and_uncertainty(kld)),
        "kld_percentiles": _percentiles(kld, KLD_PERCENTILES),
        "p_diff": list(mean_and_uncertainty(p_diff)),
        "p_diff_percentiles": _percentiles(p_diff, P_DIFF_PERCENTILES),
        "p_diff_rms": [rms, 0.5 / rms * mse[1] if rms > 0 else 0.0],
        "same_top": [same, float(np.sqrt(same * (1 - same) / (n - 1))) if n > 1 else 0.0],
        **{
            f"top1_in_top{k}": float(
                np.mean((other["top_ids"][..., :k] == leading).any(-1)[scored])
            )
            for k in TOP_N
        },
        "identical_positions": int(equal_digests(base, other)[scored].sum()),
        "kld_by_window": [float(kld_grid[w][scored[w]].mean()) for w in range(scored.shape[0])],
        # what "nearer the exact answer" is decided on, paired block by block
        "kld_by_block": _block_means(kld_grid, scored),
    }


def _block_means(values: np.ndarray, scored: np.ndarray) -> list[float]:
    """Means of ``values`` over blocks of about BLOCK consecutive scored positions, each
    window's split evenly (a block never spans two windows)."""
    means = []
    for w in range(values.shape[0]):
        row = values[w][scored[w]]
        for block in np.array_split(row, max(1, round(row.size / BLOCK))):
            means.append(float(block.mean()))
    return means


def _exp_of(log_value: tuple[float, float]) -> list[float]:
    """exp of a mean with its uncertainty (d exp(x) = exp(x) dx), as llama-perplexity does."""
    value = float(np.exp(log_value[0]))
    return [value, value * log_value[1]]


def on_shared_ids(
    base: dict[str, np.ndarray], other: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Two text passes that kept different token ids (two models, each at its own teacher's
    top tokens) cut down to the ids both kept, position by position, in ``base``'s order:
    the KL over them and one bucket for the rest is again a lower bound of the full KL."""
    ids_a, ids_b = base["slice_ids"], other["slice_ids"]
    shared = np.full(ids_a.shape, -1, np.int32)
    logits_a = np.full(ids_a.shape, np.nan)
    logits_b = np.full(ids_a.shape, np.nan)
    for w, t in zip(*np.nonzero(base["tokens"] >= 0), strict=True):
        common, at_a, at_b = np.intersect1d(ids_a[w, t], ids_b[w, t], return_indices=True)
        keep = common >= 0
        order = np.argsort(at_a[keep])  # base's order: its most likely first
        n = int(keep.sum())
        shared[w, t, :n] = common[keep][order]
        logits_a[w, t, :n] = base["slice_logits"][w, t, at_a[keep][order]]
        logits_b[w, t, :n] = other["slice_logits"][w, t, at_b[keep][order]]
    return (
        {**base, "slice_ids": shared, "slice_logits": logits_a},
        {**other, "slice_ids": shared, "slice_logits": logits_b},
    )


def check_same_windows(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    """Two text passes score the same tokens at the same token ids, or ValueError."""
    if not np.array_equal(a["tokens"], b["tokens"]):
        raise ValueError(f"{what}: the two scored different tokens")
    if not np.array_equal(a["slice_ids"], b["slice_ids"]):
        raise ValueError(f"{what}: the two kept different token ids")


def against_reference_model(
    passes: dict[str, dict[str, np.ndarray]], reference: dict[str, np.ndarray]
) -> dict[str, dict[str, Any]]:
    """Every combination's text pass against the reference model's reference pass (its
    base), over the token ids both kept; a combination whose windows are not the
    reference's (another tokenizer) gets ``{"comparable": False, "reason": ...}``."""
    result: dict[str, dict[str, Any]] = {}
    for label, arrays in passes.items():
        if not np.array_equal(arrays["window_tokens"], reference["window_tokens"]):
            result[label] = {
                "comparable": False,
                "reason": "its tokenizer cuts the text into other tokens than the reference model's",
            }
            continue
        base, other = on_shared_ids(reference, arrays)
        stats = perplexity_stats(with_probabilities(base), with_probabilities(other))
        result[label] = {"comparable": True, **stats}
    return result


def compare_text(
    passes: dict[str, dict[str, np.ndarray]],
    exact: dict[str, np.ndarray] | None,
    teacher: str | None = None,
) -> dict[str, Any]:
    """Every combination's text pass (label -> arrays, in matrix order) against ``exact``
    (the float64 engine's, or None) and every pair of them against each other (the
    ``teacher`` as the base where it is in the pair, as llama-perplexity's base is the
    reference; else the first in matrix order); and the nearest and farthest from exact,
    decided by a paired ratio over windows."""
    ready = {label: with_probabilities(arrays) for label, arrays in passes.items()}
    labels = list(ready)
    result: dict[str, Any] = {"vs_exact": {}, "pairs": {}, "extremes": None}
    if exact is not None:
        base = with_probabilities(exact)
        for label in labels:
            check_same_windows(base, ready[label], f"exact vs {label}")
            result["vs_exact"][label] = perplexity_stats(base, ready[label])
        result["extremes"] = _extremes(result["vs_exact"])
    for i, first in enumerate(labels):
        for second in labels[i + 1 :]:
            a, b = (second, first) if second == teacher else (first, second)
            check_same_windows(ready[a], ready[b], f"{a} vs {b}")
            result["pairs"][f"{a} vs {b}"] = {
                "a": a,
                "b": b,
                **perplexity_stats(ready[a], ready[b]),
            }
    return result


def _extremes(vs_exact: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The combinations nearest the exact answer, next nearest and farthest, ranked by the
    geometric mean of their KLD over blocks of positions, and how many times the next's and
    the farthest's KLD are the nearest's, block by block (qdiff.compare.stats.paired_ratio:
    ranked by the statistic it tests, the two never disagree)."""
    if len(vs_exact) < 2:
        return None
    by_block = {label: s["kld_by_block"] for label, s in vs_exact.items()}
    ranked = sorted(by_block, key=lambda label: geometric_mean(by_block[label]))
    near, runner_up, far = ranked[0], ranked[1], ranked[-1]
    return {
        "nearest": near,
        "runner_up": runner_up,
        "farthest": far,
        "lead": paired_ratio(by_block[near], by_block[runner_up]),
        "spread": paired_ratio(by_block[near], by_block[far]),
    }
