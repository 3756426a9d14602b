"""The shipped default experiment on the real models, as a user runs it: the README's
quick start, exactly as written, in a checkout set up as ./setup leaves it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import pytest

from conftest import SETUP, Clone, Workspace
from test_readme import QUICK_START

pytestmark = pytest.mark.gemma


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    clone = Clone.of_repo(tmp_path_factory.mktemp("gemma") / "qdiff")
    clone.shell(QUICK_START.removeprefix(SETUP))  # the set-up is CI's first step
    return Workspace(clone.root)


MODELS = (
    "gemma-3-270m-q4_k_m",
    "smollm2-135m-instruct.requant-q8_0",
    "smollm2-135m-instruct.requant-q4_k_m",
)


def _record(root: Path, model: str, device: str, dequant: str) -> dict[str, Any]:
    path = root / "results/runs" / model / device / dequant / "record.json"
    return cast(dict[str, Any], json.loads(path.read_text()))


def test_default_experiment_report(default_run: Workspace) -> None:
    root = default_run.root
    records = sorted((root / "results/runs").glob("*/*/*/record.json"))
    assert len(records) == len(MODELS) * 2 * 2  # cpu, cpu-fa × none, f32
    for path in records:
        rec = json.loads(path.read_text())
        assert rec["status"] == "ok", rec.get("error")
        assert len(rec["prompts"]) >= 8
        assert all(len(p["tokens"]) >= 1 for p in rec["prompts"])
    gemma = _record(root, "gemma-3-270m-q4_k_m", "cpu", "none")["provenance"]["model_file"]
    assert gemma["file_type"] == "Q4_K - Medium" and gemma["sha256"].startswith("a5fd3b62")
    # the write-up's two formats, requantized from the Q4_1 file the package ships
    for model, file_type in zip(MODELS[1:], ("Q8_0", "Q4_K - Medium"), strict=True):
        made = _record(root, model, "cpu", "none")["provenance"]["model_file"]
        assert made["file_type"] == file_type
        assert "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in made["origin"]
        f32 = _record(root, model, "cpu", "f32")["provenance"]["model_file"]
        assert set(f32["weight_types"]) == {"f32"}
    assert not (root / "results/runs/smollm2-135m-instruct").exists()  # run: false
    summary = (root / "results/summary.md").read_text()
    assert "Every stage of every combination ran." in summary
    for model in MODELS:
        section = summary.split(f"## Model `{model}`")[1].split("\n## Model ")[0]
        # teacher forcing: the reference reproduces its own path; forks are classified by site
        assert "chose that output at" in section
        assert (
            "every forced first position was bit-identical to the combination's free run" in section
        )
        assert "**forks**: along the teacher's text" in section
        # the exact reference ran, and the f32 copies are closer to it than the quantized files
        exact = section.split("### Distance from the exact answer")[1].split("\n### ")[0]
        assert "peak memory" in exact and "★" in exact
        for device in ("cpu", "cpu-fa"):
            row = next(line for line in exact.splitlines() if line.startswith(f"| `{device}.f32`"))
            assert float(row.split("|")[2]) < 0.1
        # capture: the configured pair is localised against its floor, on one weights file,
        # and capturing did not change what it observed
        localised = json.loads((root / f"results/localise/{model}.json").read_text())
        pairs = {(p["a"], p["b"]): p for p in localised["pairs"]}
        assert ("cpu.none", "cpu-fa.none") in pairs
        for (a, b), entry in pairs.items():
            assert a.split(".")[1] == b.split(".")[1]
            (prompt,) = entry["prompts"]
            assert prompt["first_divergence"] is not None and prompt["capture_changed_logits"] == []
            assert prompt["robustness"]["later_compared"] > 0
        assert "Capturing left both combinations' logits bit-identical." in section
        # the tolerances cover the forced positions, and a flash-attention toggle is no device
        # change
        tolerances = section.split("### Tolerances for tests")[1].split("### Plots")[0]
        assert "same device, other settings (flash_attn off→on)" in tolerances
        assert "cross-device" not in tolerances and "teacher-forced positions" in tolerances


def test_the_exact_stages_memory_estimate_covers_its_peak(default_run: Workspace) -> None:
    """The estimate the exact stage is refused by (qdiff.exact.reference.memory_needed) is never below
    the peak resident memory it measured, on the real models; and not far above."""
    for model in MODELS:
        # the reference, the emulations, the text
        for name in ("record.json", "roundings.json", "text.json"):
            record = json.loads((default_run.root / f"results/exact/{model}/{name}").read_text())
            estimate, peak = record["memory_estimate_mib"], record["peak_rss_mib"]
            assert peak <= estimate <= 1.5 * peak, (model, name, estimate, peak)


def test_the_free_running_generations_on_the_real_models(default_run: Workspace) -> None:
    """Every run records the chosen token's probability at every step, and the report
    compares each model's generations over its four combinations."""
    for path in (default_run.root / "results/runs").glob("*/*/*/record.json"):
        prompts = json.loads(path.read_text())["prompts"]
        assert all(len(p["top1_probs"]) == len(p["tokens"]) for p in prompts), path
        assert all(0 < x <= 1 for p in prompts for x in p["top1_probs"]), path
    summary = (default_run.root / "results/summary.md").read_text()
    for model in MODELS:
        section = summary.split(f"## Model `{model}`")[1].split("\n## Model ")[0]
        generated = section.split("### Free-running generations")[1].split("\n### ")[0]
        assert re.search(r"Over 1[0-2] prompts and 4 combinations: \d+ of", generated)
        assert re.search(r"Avg_Std@top1_prob \d", generated), generated[:2000]


def test_the_text_on_the_real_models(default_run: Workspace) -> None:
    """Every combination scored 4 windows of Macbeth against the exact answer along them:
    the f32 copies' KL divergence from exact is far below the quantized files'."""
    summary = (default_run.root / "results/summary.md").read_text()
    for model in MODELS:
        path = default_run.root / f"results/compare/{model}.text.json"
        result = json.loads(path.read_text())
        assert result["status"] == "ok" and result["exact_status"] == "ok", result
        assert result["n_windows"] == 4 and result["n_scored"] == 4 * 255
        kld = {label: s["kld"][0] for label, s in result["vs_exact"].items()}
        assert set(kld) == {"cpu.none", "cpu.f32", "cpu-fa.none", "cpu-fa.f32"}
        assert max(kld["cpu.f32"], kld["cpu-fa.f32"]) * 100 < min(
            kld["cpu.none"], kld["cpu-fa.none"]
        )
        assert len(result["pairs"]) == 6
        section = summary.split(f"## Model `{model}`")[1].split("\n## Model ")[0]
        text = section.split("### A real text, scored as llama-perplexity scores it")[1]
        assert "**Against the exact answer**" in text.split("\n### ")[0]


def test_every_default_combination_has_an_error_budget(default_run: Workspace) -> None:
    """Each CPU combination's sources (the activations only for the quantized files, the GELU
    table only for Gemma), a residual and a floor on every prompt, and a reading; the
    report's table has a row for each."""
    summary = (default_run.root / "results/summary.md").read_text()
    for model in MODELS:
        path = default_run.root / f"results/exact/{model}/distance.json"
        rows = {r["combination"]: r for r in json.loads(path.read_text())["rows"]}
        for label, row in rows.items():
            budget = row["budget"]
            assert budget["status"] == "ok" and budget["n_prompts"] == 12, (model, label)
            names = {s["name"] for s in budget["sources"]}
            assert ("activations" in names) == label.endswith(".none"), (label, names)
            assert ("gelu_table" in names) == model.startswith("gemma"), (label, names)
            assert ("flash_cpu" in names) == label.startswith("cpu-fa"), (label, names)
            assert budget["floor"]["median"] > 0 and budget["residual"]["median"] > 0
            assert 0 <= budget["within_floor"] <= 12 and 0 < budget["p_value"] <= 1
            along = row["forced"]["max_abs_median_by_prompt"]  # what the diagnosis pairs
            assert len(along) == 12 and all(v > 0 for v in along.values()), (label, along)
    sections = [part.split("### ")[0] for part in summary.split("### Error budget")[1:]]
    assert len(sections) == len(MODELS) and all(s.count("| `cpu") == 4 for s in sections)


def test_the_serving_map_on_the_real_models(default_run: Workspace) -> None:
    """Every combination's serving job ran every case; decoding again, in a new context or
    in the run's own process, is bit-identical on every real model and combination, and
    the report's map has a row for each combination."""
    summary = (default_run.root / "results/summary.md").read_text()
    for model in MODELS:
        for device in ("cpu", "cpu-fa"):
            for dequant in ("none", "f32"):
                path = default_run.root / f"results/serving/{model}/{device}/{dequant}/record.json"
                record = json.loads(path.read_text())
                assert record["status"] == "ok", record.get("error")
                by_case = {c["id"]: c["prompts"] for c in record["cases"]}
                assert len(by_case) == 9 and all(len(rows) == 2 for rows in by_case.values())
                assert all(r["status"] == "ok" for rows in by_case.values() for r in rows)
                # the README's reading: one thread against two changes nothing without flash
                # attention, and with it the first decoded step (the split-KV path)
                threads = by_case["threads-1"]
                assert all(r["n_steps"] > 1 and r["prompt_tokens"] > 256 for r in threads)
                expected = 1 if device == "cpu-fa" else None
                assert [r["first_differing_step"] for r in threads] == [expected] * 2, threads
                for row in by_case["repeat"] + by_case["process"]:
                    assert row["first_differing_step"] is None and row["fork_step"] is None
        section = summary.split(f"## Model `{model}`", 1)[1].split("### Serving conditions", 1)[1]
        for label in ("cpu.none", "cpu.f32", "cpu-fa.none", "cpu-fa.f32"):
            assert f"| `{label}`" in section.split("###", 1)[0], (model, label)


def test_rerun_plans_nothing(default_run: Workspace) -> None:
    assert default_run.planned_jobs() == []
