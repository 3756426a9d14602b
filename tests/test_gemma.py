"""The shipped default experiment on the real Gemma 3 270M model, as a user runs it."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO, Workspace

pytestmark = pytest.mark.gemma


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    ws = Workspace(tmp_path_factory.mktemp("gemma") / "ws")
    shutil.copytree(REPO / "config", ws.root / "config")
    ws.snakemake()
    return ws


def test_default_experiment_report(default_run: Workspace) -> None:
    root = default_run.root
    records = sorted((root / "results/runs").glob("*/*/*/record.json"))
    assert len(records) == 2 * 2 * 3
    for path in records:
        rec = json.loads(path.read_text())
        assert rec["status"] == "ok", rec.get("error")
        assert len(rec["prompts"]) >= 8
        assert all(len(p["tokens"]) >= 1 for p in rec["prompts"])
    q4 = json.loads((root / "results/runs/gemma-3-270m-q4_k_m/cpu/none/record.json").read_text())
    assert q4["provenance"]["model_file"]["file_type"] == "Q4_K - Medium"
    assert q4["provenance"]["model_file"]["sha256"].startswith("a5fd3b62")
    q8 = json.loads(
        (root / "results/runs/gemma-3-270m-q4_k_m.requant-q8_0/cpu/none/record.json").read_text()
    )
    assert q8["provenance"]["model_file"]["file_type"] == "Q8_0"
    f32 = json.loads((root / "results/runs/gemma-3-270m-q4_k_m/cpu/f32/record.json").read_text())
    assert set(f32["provenance"]["model_file"]["weight_types"]) == {"f32"}
    summary = (root / "results/summary.md").read_text()
    assert "## Model `gemma-3-270m-q4_k_m`" in summary
    assert "## Model `gemma-3-270m-q4_k_m.requant-q8_0`" in summary
    assert "Every stage of every combination ran." in summary
    # teacher forcing: the reference reproduces its own path; forks are classified by site
    assert "chose that output at" in summary
    assert "every forced first position was bit-identical to the combination's free run" in summary
    assert "**forks**: along the teacher's text" in summary
    # capture: the largest pair of two devices on one file, and the configured pair, are
    # localised against their floor; capturing did not change what it observed
    for model in ("gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m.requant-q8_0"):
        localised = json.loads((root / f"results/localise/{model}.json").read_text())
        pairs = {(p["a"], p["b"]): p for p in localised["pairs"]}
        assert ("cpu.none", "cpu-fa.none") in pairs
        for (a, b), entry in pairs.items():
            assert a.split(".")[1] == b.split(".")[1]  # the same weights file
            (prompt,) = entry["prompts"]
            assert prompt["first_divergence"] is not None and prompt["capture_changed_logits"] == []
            assert prompt["robustness"]["later_compared"] > 0
    assert summary.count("Capturing left both combinations' logits bit-identical.") >= 2
    # the tolerances cover the forced positions, and a flash-attention toggle is no device change
    tolerances = summary.split("### Tolerances for tests")[1].split("### Plots")[0]
    assert "same device, other settings (flash_attn off→on)" in tolerances
    assert "cross-device" not in tolerances and "teacher-forced positions" in tolerances


def test_rerun_plans_nothing(default_run: Workspace) -> None:
    assert default_run.planned_jobs() == []
