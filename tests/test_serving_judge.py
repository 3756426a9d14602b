"""qdiff.judge.serving on hand-written records (pure logic): what the determinism map and
the per-backend lines say of identical, differing, forked, n/a and crashed cases."""

from __future__ import annotations

from typing import Any

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
        "device": device,
        "dequant": "none",
        "settings": {"backend": backend},
        "cases": [{"id": cid, "prompts": rows} for cid, rows in cases.items()],
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
