"""What a teacher-forced pass keeps of each position (the engine's worker and the exact
engine both record it; qdiff.compare.forced compares two).

Storing the full vocabulary per position would cost 1 MiB per position for Gemma (262,144
logits), 640 MiB per combination for the default experiment. Each position is kept as:

- ``slice_logits``: the logits of a fixed set of token ids, the teacher's ``top_k`` most
  likely tokens at that position (the same ids for every combination, so two slices can be
  subtracted);
- ``lse``: log-sum-exp over the full vocabulary, so slice probabilities are exact;
- ``top_ids``/``top_logits``: each combination's own two leading tokens over the full
  vocabulary, so top-1 agreement and fork margins are exact;
- ``digest``: a hash of the full float32 logits, so "bit-identical" is exact.
"""

from __future__ import annotations

import hashlib

import numpy as np

ARRAY_NAMES = (
    "n_prompt_tokens",
    "lengths",
    "tokens",
    "slice_ids",
    "slice_logits",
    "lse",
    "top_ids",
    "top_logits",
    "digest",
    "forced_logprob",
)


def digest(logits: np.ndarray) -> int:
    """64-bit hash of the exact float32 bytes: equal digests mean bit-identical logits."""
    raw = np.ascontiguousarray(logits, dtype=np.float32).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest logits, largest first (lowest id first on ties)."""
    k = min(k, logits.shape[-1])
    part = np.argpartition(-logits, k - 1)[:k]
    return part[np.lexsort((part, -logits[part]))].astype(np.int32)


def log_sum_exp(logits: np.ndarray) -> float:
    x = logits.astype(np.float64)
    peak = x.max()
    return float(peak + np.log(np.exp(x - peak).sum()))


class ForcedRecorder:
    """Collects the compact per-position summaries of one combination's forced pass."""

    def __init__(self, n_prompts: int, max_len: int, top_k: int, dtype: type = np.float32) -> None:
        """``dtype`` of the kept logits: float32 as llama.cpp computes them, float64 for the
        exact reference (qdiff.exact)."""
        self.top_k = top_k
        shape = (n_prompts, max_len)
        self.arrays: dict[str, np.ndarray] = {
            "n_prompt_tokens": np.zeros(n_prompts, np.int32),
            "lengths": np.zeros(n_prompts, np.int32),
            "tokens": np.full(shape, -1, np.int32),
            "slice_ids": np.full((*shape, top_k), -1, np.int32),
            "slice_logits": np.full((*shape, top_k), np.nan, dtype),
            "lse": np.full(shape, np.nan),
            "top_ids": np.full((*shape, 2), -1, np.int32),
            "top_logits": np.full((*shape, 2), np.nan, dtype),
            "digest": np.zeros(shape, np.uint64),
            "forced_logprob": np.full(shape, np.nan),
        }

    def begin_prompt(self, p: int, n_prompt_tokens: int, forced: list[int]) -> None:
        self.arrays["n_prompt_tokens"][p] = n_prompt_tokens
        self.arrays["lengths"][p] = len(forced)
        self.arrays["tokens"][p, : len(forced)] = forced

    def add(self, p: int, t: int, logits: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
        """Record position ``t`` of prompt ``p``; ``ids`` are the teacher's slice ids, or
        None on the teacher itself (then its own top-k become the slice). Returns the ids."""
        if ids is None:
            ids = top_ids(logits, self.top_k)
        a = self.arrays
        a["slice_ids"][p, t, : len(ids)] = ids
        a["slice_logits"][p, t, : len(ids)] = logits[ids]
        lse = log_sum_exp(logits)
        a["lse"][p, t] = lse
        lead = top_ids(logits, 2)
        a["top_ids"][p, t, : len(lead)] = lead
        a["top_logits"][p, t, : len(lead)] = logits[lead]
        a["digest"][p, t] = digest(logits)
        a["forced_logprob"][p, t] = float(logits[a["tokens"][p, t]]) - lse
        return ids
