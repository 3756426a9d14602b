"""What a teacher-forced pass keeps of each position (the engine's worker and the exact
engine both record it; qdiff.compare.forced compares two).

Storing the full vocabulary per position would cost 1 MiB per position for Gemma (262,144
logits), 640 MiB per combination for the default experiment. Each position is kept as:

- ``slice_logits``: the logits of a fixed set of token ids, the teacher's ``top_k`` most
  likely tokens at that position (the same ids for every combination, so two slices can be
  subtracted);
- ``lse``: log-sum-exp over the full vocabulary, so slice probabilities are exact;
- ``top_ids``/``top_logits``: each combination's own ``n_top`` leading tokens over the full
  vocabulary (two by default), so top-1 agreement and fork margins are exact;
- ``digest``: a 64-bit hash of the full float32 logits, so "bit-identical" is exact but for
  a chance of about 2**-64 per pair of differing rows (no one chooses these logits to
  collide); the arrays name its algorithm (``digest_algorithm``), and digests of two
  algorithms are never compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import xxhash

from qdiff.core import threads

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


def forced_text(run: Mapping[str, Any], n_tokens: int | None) -> dict[str, Any]:
    """The teacher's run record as teacher forcing reads it: each prompt's greedy tokens cut
    to their first ``n_tokens`` (``teacher_forcing.n_tokens``; None keeps them all), so that
    long free-running generations need not be forced, nor followed exactly, to their end."""
    return {**run, "prompts": [{**p, "tokens": p["tokens"][:n_tokens]} for p in run["prompts"]]}


DIGEST_ALGORITHM = "xxh3_64"  # what ``digest`` computes: XXH3, 64 bits
# data without a name (qdiff before 0e63b0a): blake2b/8 before 4db477c, sha256/8 after, which
# the data cannot tell apart; it is compared only with other data without a name. sha256/8
# (SHA-256's first 8 bytes) was the named algorithm before XXH3.
UNNAMED_DIGEST = "an unnamed algorithm"


def digest(logits: np.ndarray) -> int:
    """64-bit hash of the exact float32 bytes: equal digests mean bit-identical logits but
    for a chance of about 2**-64 per pair of differing rows, as SHA-256's first 8 bytes gave.
    XXH3 (xxhash): every position is hashed, no adversary picks the logits, and it takes a
    twelfth to a fourteenth of SHA-256's time (2.1-2.4 against 28-30 ms for 255 rows of
    SmolLM2's 49,152 logits on a 2-core AMD EPYC: docs/results/bench-epyc/digest-ab.log),
    which had been the largest share of the text stage's recording."""
    raw = np.ascontiguousarray(logits, dtype=np.float32).view(np.uint8)  # no copy
    return xxhash.xxh3_64_intdigest(raw.data)


def digest_algorithm(named: Mapping[str, Any]) -> str:
    """The algorithm of the digests in a pass's arrays, or in a run's record."""
    name = named.get("digest_algorithm")
    return UNNAMED_DIGEST if name is None else str(name)


def same_digest_algorithm(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Raise ValueError where ``a``'s digests and ``b``'s were made by different algorithms:
    equal logits would read as different."""
    x, y = digest_algorithm(a), digest_algorithm(b)
    if x != y:
        raise ValueError(
            f"logit digests made by {x} and by {y} cannot be compared (results of an older "
            "qdiff beside newer ones, e.g. unpacked from an archive, or jobs that imported "
            "another checkout's qdiff): delete the older combination's results and run the "
            "workflow again"
        )


def equal_digests(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> np.ndarray:
    """Where two passes' logits are bit-identical (their digests, position by position)."""
    same_digest_algorithm(a, b)
    return np.asarray(a["digest"] == b["digest"])


def top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest logits, largest first (lowest id first on ties; NaN
    last)."""
    k = min(k, logits.shape[-1])
    part = np.argpartition(-logits, k - 1)[:k]
    kth = logits[part].min()
    if not np.isnan(kth):  # argpartition keeps any of the ids tied at the k-th value
        part = np.flatnonzero(logits >= kth)
    return part[np.lexsort((part, -logits[part]))][:k].astype(np.int32)


def gather(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``rows[t][ids[t]]`` of every row t (a negative id counts from the row's end, as
    indexing counts it), by one take over the flat rows."""
    return np.take(rows.reshape(-1), flat_places(np.asarray(ids), rows.shape[-1]))


def flat_places(ids: np.ndarray, width: int) -> np.ndarray:
    """Where ``ids`` (a row each) lie in rows of ``width`` laid end to end (a negative id
    counts from its row's end)."""
    if ids.size and (ids.min() < -width or ids.max() >= width):
        raise IndexError(f"token ids outside a vocabulary of {width}")
    return ids % width + (np.arange(len(ids)) * width)[:, None]


class SlicePass(NamedTuple):
    """What one pass over rows finds of each beside its slice of ids (``slice_pass``)."""

    lse: np.ndarray  # the log-sum-exp over the whole row, float64
    kept: np.ndarray  # the logits at the slice's ids (where an id is -1: the row's last)
    outside: np.ndarray  # the largest logit outside the slice (-inf: none; NaN: a NaN there)


# slice_pass's buffer, a block of rows: BLOCK_BYTES for each worker that records at once.
# Small blocks stay in a core's cache; many workers gained from large ones, which make
# fewer numpy calls between which the GIL changes hands (the cause was not measured): on
# the lent H100's 16 CPUs at 8 workers add_rows took 13.7-14.2 ms a window with 8 MiB blocks
# against 17.2-18.5 with 1 MiB, and on one and two workers 1 MiB was as fast or faster
# (docs/results/bench-h200/recorder-blocks-4b28393-h100.log, CPython's 5 ms switch interval)
BLOCK_BYTES = 2**20


def slice_pass(rows: np.ndarray, ids: np.ndarray, block_bytes: int = BLOCK_BYTES) -> SlicePass:
    """Each row's log-sum-exp, its logits at its slice ``ids`` (a row each, distinct ids;
    -1 pads) and its largest logit outside them, from one read of the rows, a block of
    about ``block_bytes`` at a time in a buffer that stays in cache. The slice's terms
    exp(x - max) are taken in float64 and the others' in the rows' own type: for float32
    rows (llama.cpp's) float32 exponentials of the float32 difference, as
    llama-perplexity's ``log_softmax`` takes them, summed in float64: 1.45 times faster than float64 throughout on one core of a
    2-core AMD EPYC (docs/results/bench-h200/recorder-ab.py). Since the slice holds the
    teacher's leading tokens, the tail (1 - the slice's probabilities) is then the rest's
    own sum, to well within 1e-7 of itself, not a total's rounding: the log-sum-exp is
    float64's but for that share of the tail's mass (``tests/test_text.py``; 2.2e-9 at most
    on a window of SmolLM2's width whose tails are about 0.2). Float64 rows (the exact
    engine's) in float64 throughout."""
    n_rows, width = rows.shape
    peak, outside, rest = np.empty(n_rows, rows.dtype), np.empty(n_rows), np.empty(n_rows)
    kept = np.empty(ids.shape, rows.dtype)
    block = max(1, block_bytes // (width * rows.itemsize))
    # Between its numpy calls a block holds the GIL, which the workers share: what concerns
    # the slice alone is worked out once for all rows, not block by block. ``at``: each
    # id's place in its block's flat buffer; the slice's places (its ids but the -1 pads)
    # come row by row, so a block's are one run of them
    inside = ids >= 0
    at = flat_places(ids, width) - (np.arange(n_rows) // block * block * width)[:, None]
    whole = bool(inside.all())  # no pads (the usual case): a view, not a boolean index's copy
    places = at.reshape(-1) if whole else at[inside]
    starts = np.arange(0, n_rows, block)
    runs = np.append(0, np.cumsum(inside.sum(axis=1)))[np.append(starts, n_rows)]
    buffer = np.empty((min(block, n_rows), width), rows.dtype)
    for b, start in enumerate(starts.tolist()):
        stop = min(start + block, n_rows)
        terms = buffer[: stop - start]
        np.copyto(terms, rows[start:stop])
        # the places lie in the buffer: "clip" spares the copy a checked take makes of out
        np.take(terms.reshape(-1), at[start:stop], out=kept[start:stop], mode="clip")
        np.max(terms, axis=1, out=peak[start:stop])
        terms.reshape(-1)[places[runs[b] : runs[b + 1]]] = -np.inf
        outside[start:stop] = terms.max(axis=1)
        terms -= peak[start:stop, None]
        np.exp(terms, out=terms)
        terms.sum(axis=1, dtype=np.float64, out=rest[start:stop])
    own = np.exp(kept.astype(np.float64) - peak.astype(np.float64)[:, None])
    own = (own if whole else np.where(inside, own, 0.0)).sum(axis=1)
    lse = peak + np.log(own + rest)
    return SlicePass(lse, kept, outside)


def leading_ids(
    rows: np.ndarray, ids: np.ndarray, n: int, seen: SlicePass | None = None
) -> np.ndarray:
    """``top_ids(row, n)`` of every row (shape (len(rows), n)), read from the row's logits at
    ``ids`` (the teacher's slice of it, a row each, distinct ids; -1 pads) where the largest
    logit outside the slice is below the slice's n-th largest (both from ``seen``, the
    rows' ``slice_pass``, made here if not given); the other rows are partitioned whole. A
    partition of each whole row costs about as much as the row's log-sum-exp."""
    n = min(n, rows.shape[-1])
    ids = ids[: len(rows)]
    if n > ids.shape[-1]:
        return np.array([top_ids(row, n) for row in rows], np.int32).reshape(len(rows), n)
    seen = slice_pass(rows, ids) if seen is None else seen
    kept = seen.kept
    part = np.argpartition(-kept, n - 1, axis=1)[:, :n]  # NaN last
    threshold = np.take_along_axis(kept, part[:, n - 1 : n], axis=1)  # the n-th largest
    inside = np.count_nonzero(kept >= threshold, axis=1)
    # nothing outside the slice ranks (a NaN there fails this too: that row is taken
    # whole), and the slice is whole
    fast = (inside >= n) & (seen.outside < threshold[:, 0]) & (ids >= 0).all(axis=1)
    # where exactly n logits rank, they are the partition's first n: ranked all rows at once
    # (an order within numpy, not a loop of Python, so that workers share the rows)
    top, values = np.take_along_axis(ids, part, axis=1), np.take_along_axis(kept, part, axis=1)
    out = np.take_along_axis(top, np.lexsort((top, -values), axis=-1), axis=1).astype(np.int32)
    for t in np.flatnonzero(~fast | (inside > n)):
        if fast[t]:  # ties at the n-th place: every id at or above it, ranked
            ranked = np.flatnonzero(kept[t] >= threshold[t])
            order = np.lexsort((ids[t, ranked], -kept[t, ranked]))[:n]
            out[t] = ids[t, ranked[order]]
        else:
            out[t] = top_ids(rows[t], n)
    return out


def log_sum_exp(logits: np.ndarray) -> float:
    """Log-sum-exp of one row in float64 throughout (the reference definition)."""
    x = logits.astype(np.float64)
    peak = x.max()
    return float(peak + np.log(np.exp(x - peak).sum()))


def log_sum_exp_rows(rows: np.ndarray, block: int = 16) -> np.ndarray:
    """``log_sum_exp`` of every row, the same float64 arithmetic (bit for bit), a block of
    rows at a time: four times faster than row by row on a 262,144-token vocabulary."""
    out = np.empty(len(rows))
    for start in range(0, len(rows), block):
        x = rows[start : start + block].astype(np.float64)
        peak = x.max(axis=1, keepdims=True)
        x -= peak
        np.exp(x, out=x)
        out[start : start + block] = peak[:, 0] + np.log(x.sum(axis=1))
    return out


class ForcedRecorder:
    """Collects the compact per-position summaries of one combination's forced pass."""

    def __init__(
        self,
        n_prompts: int,
        max_len: int,
        top_k: int,
        dtype: type = np.float32,
        n_top: int = 2,
        workers: int | None = None,
    ) -> None:
        """``dtype`` of the kept logits: float32 as llama.cpp computes them, float64 for the
        exact reference (qdiff.exact); ``n_top``: own leading tokens kept (at least 2);
        ``workers``: threads ``add_rows`` shares its rows among (default: the CPUs this
        process may run on, at most ``threads.MAX_WORKERS``: a stage records its rows after
        llama.cpp has computed them, so the job's cores are free then)."""
        self.top_k, self.n_top = top_k, n_top
        self.workers = max(1, workers if workers is not None else threads.workers())
        shape = (n_prompts, max_len)
        self.arrays: dict[str, np.ndarray] = {
            "n_prompt_tokens": np.zeros(n_prompts, np.int32),
            "lengths": np.zeros(n_prompts, np.int32),
            "tokens": np.full(shape, -1, np.int32),
            "slice_ids": np.full((*shape, top_k), -1, np.int32),
            "slice_logits": np.full((*shape, top_k), np.nan, dtype),
            "lse": np.full(shape, np.nan),
            "top_ids": np.full((*shape, n_top), -1, np.int32),
            "top_logits": np.full((*shape, n_top), np.nan, dtype),
            "digest": np.zeros(shape, np.uint64),
            "forced_logprob": np.full(shape, np.nan),
            "digest_algorithm": np.array(DIGEST_ALGORITHM),
        }

    def begin_prompt(self, p: int, n_prompt_tokens: int, forced: list[int]) -> None:
        self.arrays["n_prompt_tokens"][p] = n_prompt_tokens
        self.arrays["lengths"][p] = len(forced)
        self.arrays["tokens"][p, : len(forced)] = forced

    def add(
        self,
        p: int,
        t: int,
        logits: np.ndarray,
        ids: np.ndarray | None,
        known: tuple[float, int, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Record position ``t`` of prompt ``p``; ``ids`` are the teacher's slice ids, or
        None on the teacher itself (then its own top-k become the slice); ``known``: the
        logits' log_sum_exp, digest and own leading ids where they are known (``add_rows``).
        Returns the ids."""
        own = known[2] if known is not None else top_ids(logits, self._own_ranked(ids))
        ids = own[: self.top_k] if ids is None else ids
        a = self.arrays
        a["slice_ids"][p, t, : len(ids)] = ids
        a["slice_logits"][p, t, : len(ids)] = logits[ids]
        if known is not None:
            lse, hashed = known[:2]
        else:
            lse, hashed = float(slice_pass(logits[None], ids[None]).lse[0]), digest(logits)
        a["lse"][p, t] = lse
        lead = own[: self.n_top]
        a["top_ids"][p, t, : len(lead)] = lead
        a["top_logits"][p, t, : len(lead)] = logits[lead]
        a["digest"][p, t] = hashed
        a["forced_logprob"][p, t] = float(logits[a["tokens"][p, t]]) - lse
        return ids

    def _own_ranked(self, ids: np.ndarray | None) -> int:
        """How many of a row's own leading ids to rank: on the teacher itself (``ids`` None)
        its top_k, which become the slice."""
        return max(self.n_top, self.top_k if ids is None else 0)

    def add_rows(self, p: int, rows: np.ndarray, ids: np.ndarray | None) -> None:
        """Record positions 0 .. len(rows) - 1 of prompt ``p`` at once (``ids``: the
        teacher's slice ids of each, or None), as ``add`` records each."""

        # a row's log-sum-exp, digest and own leading ids are all of its work over the whole
        # vocabulary: each worker records a share of the rows (numpy's loops and hashing
        # release the GIL), as llama-perplexity shares its positions among threads
        shares = np.linspace(0, len(rows), min(self.workers, len(rows)) + 1).astype(int)
        n_workers = max(1, len(shares) - 1)
        block_bytes = BLOCK_BYTES * n_workers

        def record(lo: int, hi: int) -> None:
            part, a = rows[lo:hi], self.arrays
            if ids is None:
                ranked = [top_ids(row, self._own_ranked(None)) for row in part]
                own = np.array(ranked, np.int32).reshape(len(part), -1)
                kept = own[:, : self.top_k]
                seen = slice_pass(part, kept, block_bytes)
            else:
                kept = ids[lo:hi]
                seen = slice_pass(part, kept, block_bytes)
                own = leading_ids(part, kept, self.n_top, seen)
            lead, lse = own[:, : self.n_top], seen.lse
            a["slice_ids"][p, lo:hi, : kept.shape[1]] = kept
            a["slice_logits"][p, lo:hi, : kept.shape[1]] = seen.kept
            a["lse"][p, lo:hi] = lse
            a["top_ids"][p, lo:hi, : lead.shape[1]] = lead
            a["top_logits"][p, lo:hi, : lead.shape[1]] = gather(part, lead)
            a["digest"][p, lo:hi] = [digest(row) for row in part]
            forced = gather(part, a["tokens"][p, lo:hi, None])[:, 0]
            a["forced_logprob"][p, lo:hi] = forced.astype(np.float64) - lse

        with ThreadPoolExecutor(n_workers) as pool:
            # list(): a worker's exception is raised here
            list(pool.map(record, shares[:-1], shares[1:]))
