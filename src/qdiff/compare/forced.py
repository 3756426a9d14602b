"""Teacher-forced comparison: every combination of a model evaluated on one token sequence.

Free greedy runs stop being comparable after their first fork: from then on each device
reads its own text. Here every combination is fed the *teacher's* greedy output (the
reference combination's, see ``Experiment.teacher``) token by token, so the logits of two
combinations can be compared at every generated position.

Each position keeps a slice of the logits and exact summaries (qdiff.core.forced).
Per pair this gives, per position: max |Δ| over the slice, KL(a‖b) over the slice plus one
bucket for the rest of the vocabulary (by the data-processing inequality a lower bound of the
full KL, and equal to it when the tail carries no mass), top-1 agreement, and at each fork
the margin between the two leading tokens.

Each fork is classified against the pair's *typical difference*, the median per-position
max |Δ| over the positions where the two are not bit-identical. At a fork, a prefers its token
by m_a and b prefers the other by m_b, and m_a + m_b ≤ 2·max|Δ| at that position; so a fork
whose margin max(m_a, m_b) is at most ``TIE_FACTOR`` times the typical difference is one that
an ordinary difference of this pair can flip:

- **near tie**: the margin is exact (both tokens inside the kept slice), the typical
  difference rests on at least ``MIN_SCALE_POSITIONS`` differing positions, and the margin
  is at most ``TIE_FACTOR`` times it;
- **red flag**: the margin (or its lower bound) exceeds that, on such a scale: the fork
  needed an unusually large difference at that very position, worth a look (a kernel bug, a
  wrong op, a broken weight);
- **undetermined**: otherwise (a margin only bounded from below that stays under the
  threshold, or too few differing positions to know what is typical). Never counted as a tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qdiff.compare.metrics import PairStats, median, metric_values, percentile
from qdiff.core.forced import equal_digests, same_digest_algorithm

TIE_FACTOR = 2.0
MIN_SCALE_POSITIONS = 10


@dataclass(frozen=True)
class Fork:
    prompt: str
    position: int
    token_a: int
    token_b: int
    margin: float  # the larger of the two sides' preference for their own token
    margin_exact: bool  # False: a token fell outside the slice; the margin is a lower bound
    kind: str  # "near tie" | "red flag" | "undetermined"


def with_probabilities(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A forced pass's arrays plus the probabilities of its slice tokens, of everything else
    (the tail) and their logs: computed once per combination however many pairs it is in."""
    if "probs" in data:
        return data
    floor = np.log(np.finfo(np.float64).tiny)  # a finite log for probabilities of 0
    log_probs = data["slice_logits"].astype(np.float64)  # NaN: a slot the slice left empty
    log_probs -= data["lse"][..., None]  # log p = logit - lse, exactly
    probs = np.exp(log_probs)
    np.fmax(probs, 0.0, out=probs)  # an empty slot's NaN becomes 0
    np.fmax(log_probs, floor, out=log_probs)  # and its log (and a -inf's) the floor
    tail = np.clip(1.0 - probs.sum(axis=-1), 0.0, 1.0)
    return {
        **data,
        "probs": probs,
        "log_probs": log_probs,
        "tail": tail,
        "log_tail": np.log(np.maximum(tail, np.finfo(np.float64).tiny)),
    }


def kl_with_tail(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> np.ndarray:
    """KL(a || b) over the slice tokens and the tail: a lower bound of the full KL. Every log
    is finite (``with_probabilities``), so a probability of 0 adds exactly 0."""
    inner = np.einsum("...k,...k->...", a["probs"], a["log_probs"] - b["log_probs"])
    tail = a["tail"] * (a["log_tail"] - b["log_tail"])
    return np.maximum(inner + tail, 0.0)


def _logit_of(side: dict[str, np.ndarray], p: int, t: int, token: int) -> float:
    """One side's exact logit of ``token`` at (p, t) where it kept it (its two leading tokens
    and the slice), else NaN: not known."""
    for ids, logits in (
        (side["top_ids"], side["top_logits"]),
        (side["slice_ids"], side["slice_logits"]),
    ):
        hit = np.nonzero(ids[p, t] == token)[0]
        if hit.size:
            return float(logits[p, t, hit[0]])
    return float("nan")


def first_step_metrics(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], pa: int, pb: int
) -> dict[str, Any]:
    """Every PAIR_METRIC (qdiff.compare.metrics) of one prompt's first step, from two forced passes'
    position 0 (rows ``pa`` of a, ``pb`` of b; both ``with_probabilities``): how first steps
    compare when runs keep no full logits (``first_step_logits: top_k``).

    Exact as over the full vocabulary: top-1 agreement, a's margin and bit-identity (the
    digest). Over the teacher's slice: max |Δ| (a lower bound of the full one), mean |Δ|,
    RMS and NMSE; KL both ways over the slice plus the tail (lower bounds); Δp where the
    token's logit was kept (NaN where it was not)."""
    ids_a, ids_b = a["slice_ids"][pa, 0], b["slice_ids"][pb, 0]
    if not np.array_equal(ids_a, ids_b):
        raise ValueError("the two forced passes kept different token ids at the first step")
    kept = ids_a >= 0
    xa = a["slice_logits"][pa, 0][kept].astype(np.float64)
    delta = b["slice_logits"][pb, 0][kept].astype(np.float64) - xa
    squares = float(np.dot(delta, delta))
    same_digest_algorithm(a, b)
    identical = bool(a["digest"][pa, 0] == b["digest"][pb, 0])
    at_a = {k: v[pa, 0] for k, v in a.items() if k in ("probs", "log_probs", "tail", "log_tail")}
    at_b = {k: v[pb, 0] for k, v in b.items() if k in ("probs", "log_probs", "tail", "log_tail")}
    top_a, top_b = int(a["top_ids"][pa, 0, 0]), int(b["top_ids"][pb, 0, 0])

    def prob(side: dict[str, np.ndarray], p: int, token: int) -> float:
        return float(np.exp(_logit_of(side, p, 0, token) - side["lse"][p, 0]))

    return metric_values(
        PairStats(
            n=int(delta.size),
            squares=squares,
            abs_sum=float(np.abs(delta).sum()),
            max_abs=float(np.abs(delta).max(initial=0.0)),
            sq_norm_a=float(np.dot(xa, xa)),
            kl=float(kl_with_tail(at_a, at_b)),
            kl_ba=float(kl_with_tail(at_b, at_a)),
            dp_top=prob(b, pb, top_a) - prob(a, pa, top_a),
            dp_top_ba=prob(a, pa, top_b) - prob(b, pb, top_b),
            margin_a=float(a["top_logits"][pa, 0, 0] - a["top_logits"][pa, 0, 1]),
            top1_agree=top_a == top_b,
            identical=identical,
        )
    )


def _preference(side: dict[str, np.ndarray], p: int, t: int, other: int) -> tuple[float, bool]:
    """How much one side prefers its own top token (exact logit) over the other side's
    token (from the slice; when that token is outside the slice, a lower bound)."""
    own = float(side["top_logits"][p, t, 0])
    ids, logits = side["slice_ids"][p, t], side["slice_logits"][p, t]
    hit = np.nonzero(ids == other)[0]
    if hit.size:
        return own - float(logits[hit[0]]), True
    return own - float(np.nanmin(logits)), False  # the other token ranks below the slice


def compare_forced(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], prompt_ids: list[str]
) -> dict[str, Any]:
    """Per-position comparison of two combinations forced along the same sequence."""
    if not np.array_equal(a["tokens"], b["tokens"]) or not np.array_equal(
        a["slice_ids"], b["slice_ids"]
    ):
        return {"status": "n/a", "reason": "the two were forced along different sequences"}
    if not np.array_equal(a["n_prompt_tokens"], b["n_prompt_tokens"]):
        return {"status": "n/a", "reason": "the prompts tokenize differently"}
    lengths = a["lengths"]
    valid = np.arange(a["tokens"].shape[1])[None, :] < lengths[:, None]
    max_abs = np.subtract(b["slice_logits"], a["slice_logits"], dtype=np.float64)
    np.abs(max_abs, out=max_abs)
    # fmax skips the NaN of a slot the slice left empty; 4x faster than nanmax's copy
    max_abs = np.fmax.reduce(max_abs, axis=-1, initial=0.0)
    kl = kl_with_tail(with_probabilities(a), with_probabilities(b))
    identical = equal_digests(a, b)
    agree = a["top_ids"][..., 0] == b["top_ids"][..., 0]
    # the pair's typical difference where it differs at all: a pair that is bit-identical
    # at most positions (e.g. TF32 on or off, which only long sequences reach) still has a
    # meaningful scale for its forks
    differing = valid & ~identical
    typical = median(max_abs[differing]) if differing.any() else 0.0
    scale_known = int(differing.sum()) >= MIN_SCALE_POSITIONS
    forks = _forks(a, b, prompt_ids, valid & ~agree, TIE_FACTOR * typical, scale_known)
    return {
        "status": "ok",
        "top_k": int(a["slice_ids"].shape[-1]),
        **_summary(max_abs[valid], kl[valid], identical[valid], agree[valid]),
        "max_abs_median_differing": typical,
        "n_differing": int(differing.sum()),
        "tie_threshold": TIE_FACTOR * typical,
        "near_ties": sum(f.kind == "near tie" for f in forks),
        "red_flags": sum(f.kind == "red flag" for f in forks),
        "undetermined": sum(f.kind == "undetermined" for f in forks),
        "forks": [f.__dict__ for f in forks],
        "per_position": _per_position(valid, max_abs, kl, agree),
        "per_prompt_max_abs": {
            prompt_ids[p]: [float(x) for x in max_abs[p, : lengths[p]]]
            for p in range(len(prompt_ids))
        },
    }


def _summary(
    max_abs: np.ndarray, kl: np.ndarray, identical: np.ndarray, agree: np.ndarray
) -> dict[str, Any]:
    """The pair's figures over every compared position."""
    n = int(max_abs.size)
    return {
        "n_positions": n,
        "bit_identical": int(identical.sum()),
        "top1_agree": int(agree.sum()),
        "max_abs": float(max_abs.max(initial=0.0)),
        "max_abs_median": median(max_abs) if n else 0.0,
        "max_abs_p90": percentile(max_abs, 90) if n else 0.0,
        "kl_mean": float(kl.mean()) if n else 0.0,
        "kl_median": median(kl) if n else 0.0,
        "kl_p99": percentile(kl, 99) if n else 0.0,
        "kl_max": float(kl.max(initial=0.0)),
    }


def _forks(
    a: dict[str, np.ndarray],
    b: dict[str, np.ndarray],
    prompt_ids: list[str],
    forked: np.ndarray,
    threshold: float,
    scale_known: bool,
) -> list[Fork]:
    """Every position where the top-1 tokens differ, with its margin and its kind."""
    forks = []
    for p, t in zip(*np.nonzero(forked), strict=True):
        ta_id, tb_id = int(a["top_ids"][p, t, 0]), int(b["top_ids"][p, t, 0])
        ma, exact_a = _preference(a, p, t, tb_id)
        mb, exact_b = _preference(b, p, t, ta_id)
        margin, exact = max(ma, mb), exact_a and exact_b
        if scale_known and margin > threshold:
            kind = "red flag"
        elif scale_known and exact:
            kind = "near tie"
        else:
            kind = "undetermined"
        forks.append(Fork(prompt_ids[p], int(t), ta_id, tb_id, margin, exact, kind))
    return forks


def _per_position(
    valid: np.ndarray, max_abs: np.ndarray, kl: np.ndarray, agree: np.ndarray
) -> list[dict[str, Any]]:
    """Each generated position's figures over the prompts that reach it."""
    rows = []
    for t in range(valid.shape[1]):
        at = valid[:, t]
        if at.any():
            rows.append(
                {
                    "position": t,
                    "prompts": int(at.sum()),
                    "max_abs_median": median(max_abs[at, t]),
                    "max_abs_max": float(max_abs[at, t].max()),
                    "kl_mean": float(kl[at, t].mean()),
                    "top1_agree": int(agree[at, t].sum()),
                }
            )
    return rows
