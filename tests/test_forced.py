"""Teacher-forced comparison on constructed logits (pure logic; the workflow tests run it for real)."""

from __future__ import annotations

import numpy as np
import pytest

from qdiff.compare.forced import (
    TIE_FACTOR,
    compare_forced,
    first_step_metrics,
    with_probabilities,
)
from qdiff.compare.metrics import logit_metrics
from qdiff.core.forced import ForcedRecorder, digest, top_ids

VOCAB = 64


def record(positions: list[np.ndarray], top_k: int, teacher_ids=None) -> tuple[dict, list]:
    """One prompt forced along tokens 0..n-1; returns the arrays and the slice ids used."""
    rec = ForcedRecorder(1, len(positions), top_k)
    rec.begin_prompt(0, 5, list(range(len(positions))))
    used = [
        rec.add(0, t, x, None if teacher_ids is None else teacher_ids[t])
        for t, x in enumerate(positions)
    ]
    return rec.arrays, used


def pair(a_positions, b_positions, top_k=VOCAB) -> dict:
    a, ids = record(a_positions, top_k)
    b, _ = record(b_positions, top_k, ids)
    return compare_forced(a, b, ["p"])


def noisy(rng: np.random.Generator, n: int, scale: float = 0.01) -> tuple[list, list]:
    """n positions of random logits and a copy perturbed by about ``scale``."""
    a = [rng.normal(0, 3, VOCAB).astype(np.float32) for _ in range(n)]
    b = [(x + rng.normal(0, scale, VOCAB)).astype(np.float32) for x in a]
    return a, b


def test_top_ids_are_largest_first_and_lowest_id_on_ties() -> None:
    logits = np.array([1, 5, 5, 0, 7], dtype=np.float32)
    assert top_ids(logits, 3).tolist() == [4, 1, 2]
    assert top_ids(logits, 10).tolist() == [4, 1, 2, 0, 3]


def test_digest_tells_bit_identical_from_different() -> None:
    x = np.arange(10, dtype=np.float32)
    assert digest(x) == digest(x.copy())
    y = x.copy()
    y[3] = np.nextafter(y[3], np.float32(100))
    assert digest(x) != digest(y)
    # XXH3's 64 bits of these bytes (its output is fixed by its specification): another
    # algorithm would need a new DIGEST_ALGORITHM name, or old and new data would mix
    assert digest(np.arange(8, dtype=np.float32)) == 9101205324467971890


def test_digests_of_two_named_algorithms_are_never_compared() -> None:
    from qdiff.core.forced import DIGEST_ALGORITHM, same_digest_algorithm

    with pytest.raises(ValueError, match=f"made by sha256/8 and by {DIGEST_ALGORITHM} cannot"):
        same_digest_algorithm({"digest_algorithm": "sha256/8"}, {"digest_algorithm": "xxh3_64"})
    same_digest_algorithm({"digest_algorithm": DIGEST_ALGORITHM}, {"digest_algorithm": "xxh3_64"})


def test_digests_of_two_algorithms_are_never_compared(tmp_path) -> None:
    """Data from before digests were named (blake2b before 4db477c, SHA-256 after, which the
    data cannot tell apart) beside newer data, e.g. an unpacked archive extended by a newer
    run: equal logits could read as different, so the comparison refuses, saying what to do;
    the name survives a save and load."""
    from qdiff.core.forced import DIGEST_ALGORITHM
    from qdiff.core.io import load_arrays, save_arrays

    a, _ = noisy(np.random.default_rng(0), 3)
    new, ids = record(a, VOCAB)
    save_arrays(tmp_path / "new.npz", new)
    assert str(load_arrays(tmp_path / "new.npz")["digest_algorithm"]) == DIGEST_ALGORITHM
    old, _ = record(a, VOCAB, ids)
    del old["digest_algorithm"]  # as qdiff wrote it before 0e63b0a
    with pytest.raises(ValueError, match="made by xxh3_64 and by an unnamed algorithm cannot"):
        compare_forced(new, old, ["p"])
    with pytest.raises(ValueError, match="delete the older combination's results"):
        first_step_metrics(with_probabilities(new), with_probabilities(old), 0, 0)


def test_identical_passes_compare_as_identical() -> None:
    a, _ = noisy(np.random.default_rng(0), 5)
    result = pair(a, [x.copy() for x in a])
    assert result["bit_identical"] == result["n_positions"] == 5
    assert result["max_abs"] == 0 and result["kl_max"] == 0 and result["forks"] == []


def test_full_slice_kl_equals_full_vocabulary_kl_and_a_smaller_slice_bounds_it() -> None:
    a, b = noisy(np.random.default_rng(1), 4, scale=0.3)
    full = logit_metrics(np.stack(a), np.stack(b))
    exact = pair(a, b, top_k=VOCAB)
    per_position = [q["kl_mean"] for q in exact["per_position"]]
    np.testing.assert_allclose(per_position, full["kl"], rtol=1e-6)
    np.testing.assert_allclose(exact["max_abs"], full["max_abs"].max(), rtol=1e-6)
    coarse = pair(a, b, top_k=8)
    assert all(
        c["kl_mean"] <= e["kl_mean"] + 1e-12
        for c, e in zip(coarse["per_position"], exact["per_position"], strict=True)
    )


def tie_position(lead_a: float, lead_b: float) -> tuple[np.ndarray, np.ndarray]:
    """A position where a prefers token 3 over 7 by lead_a and b prefers 7 over 3 by lead_b."""
    a = np.full(VOCAB, -5.0, dtype=np.float32)
    b = a.copy()
    a[3], a[7] = 5.0, 5.0 - lead_a
    b[7], b[3] = 5.0, 5.0 - lead_b
    return a, b


def test_a_nearly_tied_fork_is_a_near_tie() -> None:
    rng = np.random.default_rng(2)
    a, b = noisy(rng, 9, scale=0.02)
    ta, tb = tie_position(0.01, 0.01)
    result = pair(a + [ta], b + [tb])
    (fork,) = [f for f in result["forks"] if f["position"] == 9]
    assert (fork["token_a"], fork["token_b"]) == (3, 7)
    assert fork["margin"] == pytest.approx(0.01, abs=1e-5) and fork["margin_exact"]
    assert fork["kind"] == "near tie"
    assert result["red_flags"] == 0


def test_a_large_margin_fork_is_a_red_flag() -> None:
    rng = np.random.default_rng(3)
    a, b = noisy(rng, 9, scale=0.02)
    ta, tb = tie_position(3.0, 0.5)  # a was confident; b chose otherwise
    result = pair(a + [ta], b + [tb])
    (fork,) = [f for f in result["forks"] if f["position"] == 9]
    assert fork["margin"] == pytest.approx(3.0)
    assert (
        fork["margin"]
        > result["tie_threshold"]
        == pytest.approx(TIE_FACTOR * result["max_abs_median_differing"])
    )
    assert fork["kind"] == "red flag" and result["red_flags"] == 1


def test_a_fork_to_a_token_outside_the_slice_gives_a_lower_bound() -> None:
    rng = np.random.default_rng(5)
    a_pos, b_pos = noisy(rng, 10, scale=0.02)
    a = np.linspace(10, 0, VOCAB).astype(np.float32)  # teacher: token 0 first, 63 last
    b = a.copy()
    b[VOCAB - 1] = 20.0  # b's top token is outside the teacher's top 4
    result = pair(a_pos + [a], b_pos + [b], top_k=4)
    (fork,) = [f for f in result["forks"] if f["position"] == 10]
    assert fork["token_b"] == VOCAB - 1 and not fork["margin_exact"]
    assert fork["margin"] == pytest.approx(10.0)  # b: 20 for its token, 10 for a's
    assert fork["kind"] == "red flag"  # even its lower bound is far above the threshold


def test_a_fork_is_a_near_tie_only_where_that_is_defensible() -> None:
    """An inexact margin under the threshold, or a pair that differs at too few positions to
    know its typical difference, is undetermined: never counted as a tie."""
    a = np.full(VOCAB, -5.0, dtype=np.float32)
    a[0], a[1] = 5.0, 4.99  # a: token 0 by 0.01
    b = a.copy()
    b[VOCAB - 1] = 5.005  # b's top token lies outside a top-2 slice, just above a's token 0
    few = pair([a], [b], top_k=2)  # one differing position: no scale
    (fork,) = few["forks"]
    assert fork["kind"] == "undetermined" and few["undetermined"] == 1 and few["near_ties"] == 0
    rng = np.random.default_rng(6)
    a_pos, b_pos = noisy(rng, 12, scale=1.0)
    many = pair(a_pos + [a], b_pos + [b], top_k=2)
    (fork,) = [f for f in many["forks"] if f["position"] == 12]
    assert not fork["margin_exact"] and fork["margin"] <= many["tie_threshold"]
    assert fork["kind"] == "undetermined"  # a lower bound under the threshold proves nothing


def test_sequences_that_differ_are_not_compared() -> None:
    a, ids = record([np.zeros(VOCAB, np.float32)], 4)
    b, _ = record([np.zeros(VOCAB, np.float32)], 4, ids)
    b["tokens"][0, 0] = 5
    assert compare_forced(a, b, ["p"])["status"] == "n/a"


def test_the_tie_threshold_ignores_bit_identical_positions() -> None:
    """A pair identical at most positions (TF32 on/off) judges its forks by the positions
    where it differs, not by a median of zero."""
    rng = np.random.default_rng(4)
    a = [rng.normal(0, 3, VOCAB).astype(np.float32) for _ in range(30)]
    b = [x.copy() for x in a[:18]] + [
        (x + rng.normal(0, 0.3, VOCAB)).astype(np.float32) for x in a[18:]
    ]
    ta, tb = tie_position(0.2, 0.1)
    result = pair(a + [ta], b + [tb])
    assert result["max_abs_median"] == 0 < result["max_abs_median_differing"]
    (fork,) = result["forks"]
    assert fork["kind"] == "near tie"


def test_first_steps_from_the_forced_slice_equal_the_full_comparison_when_it_covers_all() -> None:
    a, b = noisy(np.random.default_rng(5), 1, scale=0.2)
    full = logit_metrics(np.stack(a), np.stack(b))
    ra, ids = record(a, VOCAB)
    rb, _ = record(b, VOCAB, ids)
    sliced = first_step_metrics(with_probabilities(ra), with_probabilities(rb), 0, 0)
    for key, value in sliced.items():
        assert value == pytest.approx(full[key][0], rel=1e-6, abs=1e-12), key


def test_first_steps_over_a_smaller_slice_are_bounds_with_exact_top1_and_identity() -> None:
    a, b = noisy(np.random.default_rng(6), 1, scale=0.5)
    full = logit_metrics(np.stack(a), np.stack(b))
    ra, ids = record(a, 4)
    rb, _ = record(b, 4, ids)
    sliced = first_step_metrics(with_probabilities(ra), with_probabilities(rb), 0, 0)
    assert sliced["max_abs"] <= full["max_abs"][0]
    assert sliced["kl"] <= full["kl"][0] + 1e-12 and sliced["kl_ba"] <= full["kl_ba"][0] + 1e-12
    assert sliced["top1_agree"] == full["top1_agree"][0]
    assert sliced["top1_margin_a"] == pytest.approx(full["top1_margin_a"][0])
    assert not sliced["bit_identical"]
    same, _ = record([a[0].copy()], 4, ids)
    assert first_step_metrics(with_probabilities(ra), with_probabilities(same), 0, 0)[
        "bit_identical"
    ]
