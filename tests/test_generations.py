"""Free-running generations compared as Yuan et al. 2025 compare them
(qdiff.compare.generations; the report's "Free-running generations"): pure logic on
hand-made generations whose answers are known."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from qdiff.compare.generations import (
    Generated,
    common_prefix,
    divergence_index,
    generation_cap,
    generations_of,
    model_stats,
    most_parted_first,
    prompt_stats,
)
from qdiff.report.figures import divergence_strips
from qdiff.report.sections.generations import generations
from qdiff.report.view import ModelView


@pytest.mark.parametrize(
    ("a", "b", "index"),
    [
        ([1, 2, 3], [1, 2, 3], None),  # the same text
        ([1, 2, 3], [1, 5, 3], 1),  # parts at the second token, whatever follows
        ([1, 2, 3], [1, 2], 2),  # one ends (end of generation) where the other goes on
        ([], [4], 0),
        ([7], [8], 0),
    ],
)
def test_the_divergence_index_is_the_first_position_that_differs(
    a: list[int], b: list[int], index: int | None
) -> None:
    assert divergence_index(a, b) == divergence_index(b, a) == index


def gen(tokens: list[int], probs: list[float] | None = None) -> Generated:
    return Generated(tokens, probs if probs is not None else [0.5] * len(tokens))


def test_a_prompts_statistics_over_its_combinations() -> None:
    """Three combinations: two agree on 4 tokens, the third parts at position 2 and ends
    sooner. The shared prefix is 2 positions; the chosen tokens' probabilities there
    differ by 0.3 at position 0 (std of 0.5, 0.5, 0.8: 0.1414) and not at position 1."""
    gens = [
        gen([1, 2, 3, 4], [0.5, 0.9, 0.4, 0.4]),
        gen([1, 2, 3, 4], [0.5, 0.9, 0.1, 0.2]),
        gen([1, 2, 9], [0.8, 0.9, 0.3]),
    ]
    assert common_prefix(gens) == 2
    s = prompt_stats(gens)
    assert s["unique_texts"] == 2 and s["common_prefix"] == 2
    assert s["length_std"] == pytest.approx(0.4714, abs=1e-4)  # lengths 4, 4, 3
    assert s["std_top1_prob"] == pytest.approx(0.1414 / 2, abs=1e-4)  # averaged over 2


def test_a_prompt_whose_first_tokens_differ_leaves_the_average_to_the_others() -> None:
    """Std@top1_prob needs a shared prefix: a prompt whose first token differs has none, and
    the mean is over the prompts that have one (the default experiment's case)."""
    runs = {
        "cpu": {"a": gen([1, 2], [0.5, 0.5]), "b": gen([3], [0.9])},
        "cpu-fa": {"a": gen([1, 2], [0.7, 0.5]), "b": gen([4], [0.8])},
    }
    s = model_stats(runs)
    assert s["per_prompt"]["b"]["std_top1_prob"] is None
    assert s["avg_std_top1_prob"] == pytest.approx(0.05) and s["n_prompts_top1"] == 1
    view = ModelView(
        "m",
        {"run": [run("cpu", {"a": [1, 2], "b": [3]}), run("cpu-fa", {"a": [1, 2], "b": [4]})]},
        [],
    )
    line = "Avg_Std@top1_prob 0 (over 1 of 2 prompts: those whose texts share a prefix)"
    assert line in generations(view)  # both runs' probabilities are 0.5: std 0


def test_runs_without_probabilities_report_none_rather_than_zero() -> None:
    s = prompt_stats([Generated([1, 2], None), Generated([1, 2], None)])
    assert s["std_top1_prob"] is None and s["unique_texts"] == 1 and s["length_std"] == 0


def test_pairs_count_prompts_that_diverge_with_an_interval() -> None:
    """Over 10 prompts, `cpu` and `cuda` diverge on 3 (at 5, 2 and 9); `cpu` and `cpu-fa`
    on none: its interval still allows up to about 28% (Wilson, 0 of 10)."""
    same = {f"p{i}": gen([i, i + 1, i + 2] * 4) for i in range(10)}
    other = dict(same)
    for pid, at in (("p1", 5), ("p4", 2), ("p7", 9)):
        tokens = list(same[pid].tokens)
        tokens[at] = 999
        other[pid] = gen(tokens)
    s = model_stats({"cpu": same, "cpu-fa": dict(same), "cuda": other})
    by_pair = s["pairs"]
    assert by_pair[("cpu", "cuda")]["diverged"] == 3
    assert by_pair[("cpu", "cuda")]["indices"] == [2, 5, 9]
    assert by_pair[("cpu", "cuda")]["median_index"] == 5
    none = by_pair[("cpu", "cpu-fa")]
    assert none["diverged"] == 0 and none["median_index"] is None
    assert none["share_low"] == 0 and 0.25 < none["share_high"] < 0.3
    assert s["prompts_with_one_text"] == 7 and s["n_prompts"] == 10


def run(device: str, outputs: dict[str, list[int]], eog: bool = False) -> dict[str, Any]:
    return {
        "model": "m",
        "device": device,
        "dequant": "none",
        "status": "ok",
        "settings": {"backend": "cpu"},
        "generation": {"n_tokens": 4},
        "prompts": [
            {"id": pid, "tokens": t, "top1_probs": [0.5] * len(t), "stopped_at_eog": eog}
            for pid, t in outputs.items()
        ],
    }


def test_the_report_section_names_the_pairs_that_diverge_first() -> None:
    view = ModelView(
        "m",
        {
            "run": [
                run("cpu", {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}),
                run("cpu-fa", {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}),
                run("cuda", {"a": [1, 9, 3, 4], "b": [5, 6, 2]}, eog=True),
            ]
        },
        [],
    )
    text = generations(view)
    assert "Over 2 prompts and 3 combinations: 0 of 2 prompts gave one text everywhere" in text
    assert "at most 4 tokens each, 2 of 6 generations ended before" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert re.match(r"\| `cpu.none` vs `cuda.none`\s*\| 2/2", rows[0])  # diverged most: first
    assert "| 1, 2 " in rows[0]  # at 1 on prompt a, at 2 on b (cuda's ends)
    assert re.search(r"\| `cpu.none` vs `cpu-fa.none`\s*\| 0/2 .*\| none", text)


def test_fewer_than_two_combinations_compare_nothing() -> None:
    view = ModelView("m", {"run": [run("cpu", {"a": [1]})]}, [])
    assert generations(view) == "_Fewer than two combinations generated: nothing to compare._"


def test_the_section_draws_where_each_pairs_texts_part(tmp_path: Path) -> None:
    """With plots on, the section links a divergence plot of every pair, written as a PNG;
    the pairs that part most often come first (most_parted_first, the table's order)."""
    runs = [
        run("cpu", {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}),
        run("cpu-fa", {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}),
        run("cuda", {"a": [1, 9, 3, 4], "b": [5, 6, 2]}),
    ]
    view = ModelView("m", {"run": runs}, [], plot_dir=tmp_path)
    text = generations(view)
    assert "![divergence indices per pair](plots/m.divergence.png)" in text
    assert "for each pair (in the table's order)" in text
    png = tmp_path / "m.divergence.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    s = model_stats({label: generations_of(r) for label, r in zip("xyz", runs, strict=True)})
    assert [pair for pair, _ in most_parted_first(s["pairs"])] == [
        ("x", "z"),
        ("y", "z"),
        ("x", "y"),
    ]
    assert generation_cap(runs) == 4 and generation_cap([{}]) is None


def test_a_pair_that_never_parts_is_drawn_as_such(tmp_path: Path) -> None:
    """No pair parts: the figure still draws, every prompt counted as not parted."""
    path = tmp_path / "never.png"
    divergence_strips({"a vs b": ([], 3), "a vs c": ([0, 0, 2], 4)}, None, path, "t")
    assert path.stat().st_size > 5000
