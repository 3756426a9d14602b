"""qdiff.judge.serving on hand-written records (pure logic): what the determinism map and
the per-backend lines say of identical, differing, forked, n/a and crashed cases."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from qdiff.engine.serving import Decoded, compare_steps
from qdiff.judge.serving import case_table, deterministic, stable_cases, summarise


def row(first: int | None = None, fork: int | None = None, steps: int = 4) -> dict[str, Any]:
    return {
        "status": "ok",
        "n_steps": steps,
        "first_differing_step": first,
        "fork_step": fork,
        "max_abs": 0.0 if first is None else 0.5,
        "max_abs_median_step": 0.0 if first is None else 0.25,
    }


def record(device: str, backend: str, cases: dict[str, list[dict]]) -> dict[str, Any]:
    return {
        "status": "ok",
        "model": "m",
        "device": device,
        "dequant": "none",
        "settings": {"backend": backend},
        "cases": [
            {"id": cid, "kind": cid.split("-")[0], "prompts": rows} for cid, rows in cases.items()
        ],
    }


def test_a_case_summarises_its_needles() -> None:
    same = summarise({"prompts": [row(), row(steps=1)]})
    assert same.bit_identical and same.n_steps == 5 and same.identical == 2
    moved = summarise({"prompts": [row(2), row(1, fork=3), row()]})
    assert not moved.bit_identical
    assert (moved.first_differing_step, moved.fork_step, moved.forked) == (1, 3, 1)
    assert moved.identical == 1 and moved.max_abs == 0.5 and moved.median_step == 0.25
    failed = summarise({"prompts": [row(), {"status": "failed", "reason": "boom"}]})
    assert failed.status == "failed" and failed.reason == "boom"
    assert summarise({"prompts": [{"status": "n/a", "reason": "one thread"}]}).status == "n/a"


def test_a_crashed_record_keeps_its_done_cases_and_names_the_crash() -> None:
    crashed = {
        "status": "failed",
        "model": "m",
        "device": "cpu",
        "dequant": "none",
        "settings": {"backend": "cpu"},
        "error": {
            "message": "killed by SIGKILL, in case batch-3, prompt a",
            "progress": {
                "current": "case batch-3, prompt a",
                "done": {"repeat": [row()], "batch-3": []},
            },
        },
    }
    table = case_table([crashed])
    assert table["cpu.none"]["repeat"].bit_identical
    assert table["cpu.none"]["batch-3"].status == "crashed"
    assert deterministic([crashed], table) == {"cpu": []}  # a crash is no evidence


def test_the_settings_and_cases_that_stay_bit_identical() -> None:
    records = [
        record("cpu", "cpu", {"repeat": [row()], "batch-3": [row(0)], "threads-1": [row()]}),
        record("cpu-fa", "cpu", {"repeat": [row()], "batch-3": [row()], "threads-1": [row(1)]}),
        record("cuda", "cuda", {"repeat": [row()], "threads-1": [{"status": "n/a", "reason": ""}]}),
    ]
    table = case_table(records)
    assert deterministic(records, table) == {"cpu": [], "cuda": ["cuda.none"]}
    assert stable_cases(records, table) == {"cpu": ["repeat"], "cuda": ["repeat"]}


def test_steps_compare_bit_for_bit_up_to_the_fork() -> None:
    """compare_steps on hand-made logits: bit-identity by bytes (-0.0 is not 0.0), max |Δ|
    and KL(reference ‖ served) in float64, and nothing compared after the fork."""
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=50).astype(np.float32) for _ in range(4)]
    for s in steps:
        s[3], s[10] = 10.0, 0.0  # token 3 wins every step
    moved = [s.copy() for s in steps]
    moved[0][10] = -0.0  # equal as numbers, other bits
    moved[1][7] += 1e-3
    moved[2][5] = 20.0  # the served text forks here
    reference = Decoded([3, 3, 3, 3], steps)
    served = Decoded([3, 3, 5, 3], moved)
    result = compare_steps(reference, served)
    assert result["first_differing_step"] == 0 and result["fork_step"] == 2
    assert result["n_steps"] == 3 and result["identical_steps"] == 0  # step 3 not compared
    assert result["step_max_abs"][0] == 0.0 and result["step_kl"][0] == 0.0
    assert result["step_max_abs"][1] == pytest.approx(1e-3, rel=1e-3)
    p, q = (
        np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum()
        for x in (steps[1], moved[1])
    )
    assert result["step_kl"][1] == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-9)
    assert result["step_kl"][2] > 0.1  # the fork step is compared, and it moved a lot


def test_the_report_names_every_closest_combination_and_the_split_kv_path_where_it_holds() -> None:
    """The report section's per-backend lines on hand-written records: a tie for the
    closest names both; the split-KV sentence needs flash attention and prompts over 256
    tokens."""
    from qdiff.report.sections import serving as section

    records = [
        record("cpu", "cpu", {"repeat": [row()], "threads-1": [row(1)]}),
        record("cpu-fa", "cpu", {"repeat": [row()], "threads-1": [row(1)]}),
    ]
    for r, tokens, flash in zip(records, (400, 400), (False, True), strict=True):
        r["settings"] |= {"flash_attn": flash, "kv_cache_type": "f16"}
        r["cases"][1]["prompts"][0]["prompt_tokens"] = tokens
    table = case_table(records)
    closest = section._closest(records, table, "cpu")
    assert "`cpu.none` kept 1 of 2" in closest and "`cpu-fa.none` kept 1 of 2" in closest
    said = section._sources(records, table)
    assert "`cpu-fa.none`" in said and "`cpu.none`" not in said and "use_split_kv_path" in said
    records[1]["cases"][1]["prompts"][0]["prompt_tokens"] = 200  # a 256-cell view: not split
    assert "use_split_kv_path" not in section._sources(records, case_table(records))
