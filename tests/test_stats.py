"""Paired comparisons over prompts (qdiff.compare.stats)."""

from __future__ import annotations

import numpy as np
import pytest

from qdiff.compare.stats import paired_ratio


def test_a_constant_ratio_is_found_with_a_tight_interval() -> None:
    near = np.linspace(1.0, 2.0, 12)
    r = paired_ratio(near, 3 * near)
    assert r["ratio"] == pytest.approx(3) and r["verdict"] == "farther"
    assert r["low"] == pytest.approx(3) and r["high"] == pytest.approx(3)


def test_noise_around_one_is_indistinguishable_and_the_sides_swap_symmetrically() -> None:
    rng = np.random.default_rng(1)
    a = rng.uniform(1, 2, 12)
    b = a * np.exp(rng.normal(0, 0.2, 12))
    r, swapped = paired_ratio(a, b), paired_ratio(b, a)
    assert r["verdict"] == swapped["verdict"] == "indistinguishable"
    assert r["low"] < 1 < r["high"]
    assert r["ratio"] * swapped["ratio"] == pytest.approx(1)


def test_one_prompt_does_not_decide() -> None:
    """`a` is 1.5x nearer on 11 prompts and 6.7x farther on one: by the maximum `b` would be
    nearer; over the prompts the two are indistinguishable. With that prompt only a little
    farther, `a` is nearer."""
    b = [1.5] * 12
    r = paired_ratio([1.0] * 11 + [10.0], b)
    assert r["verdict"] == "indistinguishable" and r["low"] < 1 < r["high"]
    assert paired_ratio([1.0] * 11 + [2.0], b)["verdict"] == "farther"


def test_unpaired_input_is_refused() -> None:
    with pytest.raises(ValueError, match="unpaired"):
        paired_ratio([1.0, 2.0], [1.0])
