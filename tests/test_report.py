"""The report's sections, each rendered from a small hand-made view (pure logic; the
workflow tests render real reports)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

import qdiff.report
from qdiff.report import MODEL_SECTIONS, render_model, render_models, safely
from qdiff.report.sections import overview, pairs, runs
from qdiff.report.view import ModelView


def run_record(device: str, dequant: str, status: str = "ok", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "device": device,
        "dequant": dequant,
        "status": status,
        "settings": {"backend": "cpu", "env": {}},
        "prompts": [{"id": "p", "prompt_text": "Hi", "tokens": [1, 2], "text": "ab"}]
        if status == "ok"
        else [],
        "timings": {"load_s": 0.5, "prompt_ms_mean": 10.0, "decode_ms_per_token": 2.0},
        "provenance": {
            "model_file": {
                "file": "m.gguf",
                "sha256": "0" * 64,
                "origin": "test",
                "weight_types": {"q8_0": 2},
            }
        },
        **extra,
    }


def pair(
    a: str,
    b: str,
    max_abs: float,
    relation: str = "backend",
    differs: str = "backend cpu→cuda",
    **summary: Any,
) -> dict[str, Any]:
    return {
        "model": "m",
        "a": a,
        "b": b,
        "status": "ok",
        "differs": [differs],
        "relation": relation,
        "summary": {
            "n_prompts": 4,
            "max_abs_max": max_abs,
            "mean_abs_mean": max_abs / 10,
            "rms_rms": max_abs / 5,
            "nmse_mean": 1e-6,
            "kl_mean": 1e-3,
            "kl_max": 2e-3,
            "top1_agree_count": 4,
            "bit_identical_count": 0,
            "forked": 1,
            "first_fork_step": 3,
            **summary,
        },
        "prompts": [
            {
                "prompt": f"p{i}",
                "max_abs": max_abs * (i + 1) / 4,
                "kl": 1e-3,
                "kl_ba": 1e-3,
                "dp_top": 0.01,
                "dp_top_ba": 0.01,
                "top1_agree": True,
            }
            for i in range(4)
        ],
    }


def test_the_pairs_table_sorts_by_number_not_by_its_text() -> None:
    # formatted, "9.5e-05" sorts after "0.2" as text; as numbers it is the smallest
    view = ModelView(
        "m",
        {"run": []},
        [
            pair("cpu.none", "cuda.none", 9.5e-05),
            pair("cpu.f32", "cuda.f32", 0.2),
            pair("cpu.f16", "cuda.f16", 150.0),
        ],
    )
    rows = [line for line in pairs.pairs_table(view).splitlines() if line.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == ["`cpu.f16`", "`cpu.f32`", "`cpu.none`"]


def test_a_pair_that_did_not_run_is_never_shown_as_a_number() -> None:
    view = ModelView(
        "m",
        {"run": []},
        [
            {
                "model": "m",
                "a": "cpu.none",
                "b": "gpu.none",
                "status": "n/a",
                "differs": [],
                "reason": "gpu.none unavailable",
                "prompts": [],
            }
        ],
    )
    assert "n/a: gpu.none unavailable" in pairs.pairs_table(view)


def test_failures_are_listed_once_per_cause_with_every_stage_they_cost() -> None:
    upstream = {"kind": "upstream", "message": "model file m.gguf is missing: HTTP 404"}
    failed = run_record("cpu", "none", "failed", error=upstream)
    view = ModelView(
        "m",
        {
            "run": [failed, run_record("gpu", "none", "unavailable", error={"message": "no cuda"})],
            "forced": [failed],
            "capture": [failed],
        },
        [],
    )
    text = overview.failures([view])
    (row,) = [line for line in text.splitlines() if "`cpu.none`" in line]
    assert "run, teacher forcing, capture" in row and "HTTP 404" in row
    assert "`gpu.none`" in text and "unavailable" in text


def test_a_broken_section_costs_only_itself(capsys: pytest.CaptureFixture[str]) -> None:
    def broken(view: ModelView) -> str:
        raise KeyError("summary")

    assert "could not be rendered (KeyError: 'summary')" in safely(
        broken, ModelView("m", {"run": []}, [])
    )
    assert "KeyError" in capsys.readouterr().err  # the traceback goes to the job's log


def views_with_plots(plot_dir: Path) -> list[ModelView]:
    return [
        ModelView(
            f"m{i}",
            {"run": [run_record("cpu", "none"), run_record("cuda", "none")]},
            [pair("cpu.none", "cuda.none", 0.5 * (i + 1))],
            plot_dir=plot_dir,
        )
        for i in range(3)
    ]


def test_models_rendered_side_by_side_are_the_models_rendered_one_by_one(tmp_path: Path) -> None:
    alone = render_models(views_with_plots(tmp_path / "alone"), workers=1)
    side_by_side = render_models(views_with_plots(tmp_path / "side"), workers=2)
    assert side_by_side == alone
    drawn = sorted(p.name for p in (tmp_path / "alone").iterdir())
    assert drawn and drawn == sorted(p.name for p in (tmp_path / "side").iterdir())
    for name in drawn:
        assert (tmp_path / "alone" / name).read_bytes() == (tmp_path / "side" / name).read_bytes()


def test_a_model_whose_process_dies_renders_again_in_the_report_s_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = os.getpid()

    def dies_in_a_worker(view: ModelView) -> str:
        if os.getpid() != report:
            os._exit(1)  # as a native crash would end it
        return "rendered here"

    monkeypatch.setattr(qdiff.report, "MODEL_SECTIONS", [("Crash", dies_in_a_worker)])
    lines = render_models(views_with_plots(tmp_path), workers=2)
    assert lines.count("rendered here") == 3
    assert "BrokenProcessPool" in capsys.readouterr().err


def test_every_section_renders_for_a_model_that_did_not_run_at_all() -> None:
    view = ModelView(
        "m", {"run": [run_record("cpu", "none", "failed", error={"message": "boom"})]}, []
    )
    text = "\n".join(render_model(view))
    for heading, _ in MODEL_SECTIONS:
        assert f"### {heading}" in text
    assert "could not be rendered" not in text


def test_texts_mark_which_combinations_agree_with_the_first() -> None:
    a, b = run_record("cpu", "none"), run_record("cuda", "none")
    b["prompts"][0]["tokens"] = [1, 3]
    text = runs.texts(ModelView("m", {"run": [a, b]}, []))
    assert re.search(r"\| `cpu.none`\s+\| same", text) and re.search(
        r"\| `cuda.none`\s+\| differs", text
    )


def test_the_tolerance_says_what_it_covers_and_never_calls_a_setting_change_cross_device() -> None:
    view = ModelView(
        "m",
        {"run": []},
        [
            pair("cpu.none", "cuda.none", 2.0),
            pair("cpu.none", "cpu-fa.none", 1.8, "settings", "flash_attn off→on"),
        ],
    )
    text = pairs.tolerance_table(view)
    assert "| cross-device " in text and "same device, other settings (flash_attn off→on)" in text
    assert "atol=3)" in text  # 1.5 x 2.0, rounded up
    assert "Covers the first-step logits of 4 prompt comparisons over the full vocabulary" in text
    # from 2 of the 4 prompts, on the other 2: 200 random halves
    assert (
        "held on the other half: 92% of prompts (95% interval 51%–100%); all 2 of a half in 84%"
        in (text)
    )
    assert "# set by prompt p3; without it the atol would be 2.3" in text


def test_a_tolerance_is_checked_on_prompts_it_was_not_derived_from() -> None:
    """An atol from half of the prompts, checked on the other half: a prompt far above the
    others breaks it whenever it is held out, though the atol over all four covers it."""
    outlier = pair("cpu.none", "cuda.none", 5.0)
    for row, value in zip(outlier["prompts"], [1.0, 1.0, 1.0, 5.0], strict=True):
        row["max_abs"] = value
    text = pairs.tolerance_table(ModelView("m", {"run": []}, [outlier]))
    assert "atol=7.5)" in text and "74% of prompts (95% interval 30%–95%)" in text
    assert "# set by prompt p3; without it the atol would be 1.5" in text


def exact_row(combination: str, values: list[float]) -> dict[str, Any]:
    """A distance-from-exact row with its per-prompt first-step max |Δ|."""
    first = {"max_abs": max(values), "max_abs_by_prompt": values}
    return {"combination": combination, "status": "ok", "first_step": first}


def test_the_findings_rank_distances_from_exact_over_all_prompts() -> None:
    """The worst prompt would name `cpu-fa.f32` (0.05 against 0.06); over the prompts
    `cpu.f32` is nearer, and by how much is said with its interval."""

    view = ModelView("m", {"run": []}, [pair("cpu.f32", "cpu-fa.f32", 0.02)])
    view.exact = {
        "status": "ok",
        "rows": [
            exact_row("cpu.f32", [0.01, 0.012, 0.011, 0.06]),
            exact_row("cpu-fa.f32", [0.03, 0.032, 0.031, 0.05]),
            exact_row("cpu.none", [1.0, 1.2, 1.1, 1.3]),
        ],
    }
    text = overview.found([view])
    assert (
        "`cpu.f32` is closest to the exact answer (0.0168; 2.08× nearer than `cpu-fa.f32`, "
        "95% interval 1.13–2.91)"
    ) in text
    assert "`cpu.none` farthest (1.14) (first-step max |Δ|, geometric mean over prompts)" in text


def test_the_findings_never_read_nothing_compared_as_equal() -> None:
    ran = ModelView("m", {"run": [run_record("cpu", "none")]}, [])
    assert overview.found([ran]) == "- On `m`, no two combinations' first steps were compared."
    same = ModelView("m", {"run": []}, [pair("cpu.none", "cpu.f32", 0.0, forked=0)])
    assert "every compared pair gave bit-identical first-step logits (1 pair(s), 4 prompts)" in (
        overview.found([same])
    )


def test_the_findings_quote_the_largest_pair_and_the_distance_from_exact() -> None:
    def row(combination: str, max_abs: float) -> dict[str, Any]:
        return {"combination": combination, "status": "ok", "first_step": {"max_abs": max_abs}}

    exact = {"status": "ok", "rows": [row("cpu.none", 1.48), row("cpu.f32", 0.0136)]}
    views = [
        ModelView(
            f"m{i}", {"run": []}, [pair("cpu.none", "cpu.f32", 0.5), pair("a.none", "b.none", 1.79)]
        )
        for i in range(4)
    ]
    views[0].exact = exact
    text = overview.found(views)
    assert text.startswith(
        "- On `m0`, `a.none` and `b.none` differ most (first-step max |Δ|, geometric mean over 4 prompts "
        "0.99, worst 1.79; 1/4 greedy texts fork; 3.58× the next, `cpu.none` vs `cpu.f32`, 95% "
        "interval 3.58–3.58); `cpu.f32` has the smallest worst-prompt distance from the exact answer (max |Δ| "
        "0.0136), `cpu.none` the largest (1.48).\n- On `m1`,"
    )
    assert "1 more model has its own section." in text and "On `m3`" not in text


def test_two_farthest_combinations_the_prompts_cannot_tell_apart_are_both_named() -> None:
    view = ModelView("m", {"run": []}, [pair("cpu.none", "cpu-fa.none", 0.5)])
    view.exact = {
        "status": "ok",
        "rows": [
            exact_row("cpu.f32", [0.01, 0.012, 0.011, 0.013]),
            exact_row("cpu.none", [1.0, 1.3, 0.9, 1.2]),
            exact_row("cpu-fa.none", [1.2, 1.0, 1.1, 1.0]),
        ],
    }
    text = overview.found([view])
    assert "`cpu.none` and `cpu-fa.none` farthest (1.09 and 1.07, indistinguishable on these" in (
        text
    )


def test_when_no_combination_is_nearer_than_another_none_is_named_closest() -> None:
    """Two combinations the prompts cannot tell apart: neither is "closest" (nor one both
    closest and farthest, as the qwen2 1.5B run's report once said)."""
    view = ModelView("m", {"run": []}, [pair("cpu.none", "cpu-fa.none", 0.5)])
    view.exact = {
        "status": "ok",
        "rows": [
            exact_row("cpu.none", [1.0, 1.3, 0.9, 1.2]),
            exact_row("cpu-fa.none", [1.2, 1.0, 1.1, 1.0]),
        ],
    }
    text = overview.found([view])
    assert "closest" not in text and "farthest" not in text, text
    assert "all 2 combinations are as far from the exact answer as each other on these" in text


def test_what_the_exact_engine_did_not_read_is_named_and_escaped() -> None:
    from qdiff.report.sections.distance import left_out

    assert left_out({"unread": {"keys": [], "tensors": []}}) == left_out({}) == ""
    line = left_out(
        {"unread": {"keys": ["llama.expert_count"], "tensors": ["blk.*.ffn_gate_inp.weight"]}}
    )
    assert "**The engine did not read**" in line
    assert "`llama.expert_count`, `blk.*.ffn_gate_inp.weight`" in line
    # a key is the file's text: one code span, whatever backticks it holds
    hostile = left_out({"unread": {"keys": ["x.<script>`a`"], "tensors": []}})
    assert hostile.endswith(": `` x.<script>`a` ``.")
