"""Free-running greedy generations compared as the papers on nondeterministic inference
compare them (Yuan et al. 2025, "Give Me FP32 or Give Me Death?", arXiv 2506.09501; SGLang's
and vLLM's determinism tests):

- the **divergence index** of two generations: the first position where their tokens
  differ (one ending earlier counts as differing there); none when they are the same;
- per pair of combinations: the share of prompts whose generations diverge, and where;
- per prompt, over all combinations: the **unique texts**, the (population) standard deviation of the
  output length (Yuan's Std@Output_Length), and the standard deviation across combinations
  of the chosen token's probability at each position of the prefix all of them share,
  averaged over those positions (Std@top1_prob); each averaged over prompts (Avg_...).

Lengths and probabilities are of the tokens a run generated, up to its end of generation or
``generation.n_tokens``; a run made by an older qdiff has no probabilities, and then no
Std@top1_prob is reported."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qdiff.compare.stats import wilson


def divergence_index(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter one's length when one is
    the other's prefix), or None when they are the same."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Generated:
    """One combination's generation from one prompt."""

    tokens: list[int]
    top1_probs: list[float] | None  # None: a run made before qdiff recorded them


def common_prefix(generations: Sequence[Generated]) -> int:
    """How many leading positions every generation has and agrees on."""
    first = generations[0].tokens
    shared = min(len(g.tokens) for g in generations)
    for g in generations[1:]:
        index = divergence_index(first[:shared], g.tokens[:shared])
        shared = shared if index is None else index
    return shared


def prompt_stats(generations: Sequence[Generated]) -> dict[str, Any]:
    """One prompt's generations by every combination: unique texts, the length's standard
    deviation, and Std@top1_prob over the prefix they share (None without probabilities
    or without a shared position)."""
    lengths = np.array([len(g.tokens) for g in generations], dtype=np.float64)
    prefix = common_prefix(generations)
    probs = [g.top1_probs for g in generations]
    std_top1 = None
    if prefix and all(p is not None and len(p) >= prefix for p in probs):
        table = np.array([p[:prefix] for p in probs if p is not None], dtype=np.float64)
        std_top1 = float(table.std(axis=0).mean())
    return {
        "unique_texts": len({tuple(g.tokens) for g in generations}),
        "length_std": float(lengths.std()),
        "common_prefix": prefix,
        "std_top1_prob": std_top1,
    }


def pair_stats(a: dict[str, Generated], b: dict[str, Generated]) -> dict[str, Any]:
    """Two combinations over the prompts both generated from: how many diverge, with the
    share's Wilson interval, and the divergence indices of those that do."""
    shared = [pid for pid in a if pid in b]
    indices = [divergence_index(a[pid].tokens, b[pid].tokens) for pid in shared]
    diverged = [i for i in indices if i is not None]
    low, high = wilson(len(diverged), len(shared))
    return {
        "n_prompts": len(shared),
        "diverged": len(diverged),
        "share_low": low,
        "share_high": high,
        "indices": sorted(diverged),
        "median_index": float(np.median(diverged)) if diverged else None,
    }


def most_parted_first(
    pairs: dict[tuple[str, str], dict[str, Any]],
) -> list[tuple[tuple[str, str], dict[str, Any]]]:
    """A model's pairs (pair_stats), those whose texts part on the largest share of
    prompts first; ties in matrix order."""
    return sorted(pairs.items(), key=lambda kv: -kv[1]["diverged"] / max(kv[1]["n_prompts"], 1))


def model_stats(runs: dict[str, dict[str, Generated]]) -> dict[str, Any]:
    """Every combination of a model (label -> prompt id -> its generation): per prompt that
    all of them generated from, and their means over those prompts (Yuan's Avg_...)."""
    labels = list(runs)
    prompts = [pid for pid in next(iter(runs.values()), {}) if all(pid in runs[c] for c in labels)]
    per_prompt = {pid: prompt_stats([runs[c][pid] for c in labels]) for pid in prompts}
    # over the prompts whose generations share a prefix (a first token that differs leaves
    # none), and only where every run recorded its probabilities
    tops = [s["std_top1_prob"] for s in per_prompt.values() if s["std_top1_prob"] is not None]
    recorded = all(runs[c][pid].top1_probs is not None for c in labels for pid in prompts)
    return {
        "combinations": labels,
        "n_prompts": len(prompts),
        "per_prompt": per_prompt,
        "avg_std_output_length": _mean([s["length_std"] for s in per_prompt.values()]),
        "top1_recorded": recorded,
        "avg_std_top1_prob": _mean(tops) if recorded else None,
        "n_prompts_top1": len(tops) if recorded else 0,
        "prompts_with_one_text": sum(s["unique_texts"] == 1 for s in per_prompt.values()),
        "pairs": {
            (x, y): pair_stats(runs[x], runs[y])
            for i, x in enumerate(labels)
            for y in labels[i + 1 :]
        },
    }


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def generation_cap(records: Sequence[dict[str, Any]]) -> int | None:
    """The most tokens a run generated per prompt (``generation.n_tokens``; the largest of
    the runs'), or None when no run records it."""
    caps = [r.get("generation", {}).get("n_tokens") for r in records]
    return max((c for c in caps if c is not None), default=None)


def generations_of(record: dict[str, Any]) -> dict[str, Generated]:
    """A run record's generations, by prompt id."""
    return {
        p["id"]: Generated(list(p["tokens"]), p.get("top1_probs"))
        for p in record.get("prompts", [])
    }
