"""The real workflow on tiny real GGUF models: outputs, kernels, caching."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, Workspace, quantize_in_child, tiny_config, tiny_text
from tinymodel import write_tiny_llama

pytestmark = pytest.mark.workflow


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Workspace:
    """One complete run of the tiny matrix: 2 models x 2 CPU devices x (none, f32), every
    stage on (serving with two of its cases, the text in 3 short windows)."""
    ws = Workspace(tmp_path_factory.mktemp("finished") / "ws")
    serving = {"n_tokens": 4, "cases": ["repeat", "batch"]}
    ws.write_config(tiny_config(tiny_gguf, serving=serving, text=tiny_text(ws.root)))
    ws.snakemake()
    return ws


def record(ws: Workspace, model: str, device: str, dequant: str) -> dict:
    return json.loads(
        (ws.root / f"results/runs/{model}/{device}/{dequant}/record.json").read_text()
    )


def by_rule(jobs) -> Counter:
    return Counter(j.rule for j in jobs)


def test_every_combination_ran_with_real_inference(finished: Workspace) -> None:
    for model in ("tiny", "tiny.requant-q8_0"):
        for device in ("cpu", "cpu-fa"):
            for dq in ("none", "f32"):
                rec = record(finished, model, device, dq)
                assert rec["status"] == "ok", rec.get("error")
                logits = np.load(
                    finished.root / f"results/runs/{model}/{device}/{dq}/logits.npy",
                    allow_pickle=False,
                )
                assert logits.dtype == np.float32
                assert logits.shape == (2, 411)  # prompts x the tiny vocabulary
                assert np.isfinite(logits).all() and logits.std() > 0.1
                assert [p["id"] for p in rec["prompts"]] == ["rust", "france"]
                assert all(len(p["tokens"]) == 8 for p in rec["prompts"])
                assert rec["timings"]["decode_ms_per_token"] > 0


def test_each_per_combination_job_times_itself_without_snakemake_s_sampler(
    finished: Workspace,
) -> None:
    from qdiff.core.records import JOB_USAGE
    from qdiff.core.stages import STAGES

    for stage in STAGES.values():
        paths = list((finished.root / stage.folder).rglob("record.json"))
        assert paths, stage.name
        for path in paths:
            timings = json.loads(path.read_text())["timings"]
            wall, cpu, peak = (timings[k] for k in JOB_USAGE)
            assert wall > timings["load_s"] > 0, (path, timings)
            assert cpu > 0, (path, timings)
            assert 20 < peak < 4096, (path, timings)  # llama.cpp and the tiny model, in MiB
        # no benchmark file: Snakemake's sampler slowed the inference it watched
        assert not (finished.root / "results/benchmarks" / stage.name).exists()
    runs = (finished.root / "results/runs.tsv").read_text().splitlines()
    header = runs[0].split("\t")
    assert set(JOB_USAGE) <= set(header)
    column = header.index("children_peak_rss_mib")
    assert all(float(row.split("\t")[column]) > 20 for row in runs[1:])


def test_provenance_names_versions_buffers_and_kernels(finished: Workspace) -> None:
    rec = record(finished, "tiny.requant-q8_0", "cpu", "none")
    prov = rec["provenance"]
    assert prov["llama_cpp_python"] == "0.3.36"
    assert prov["qdiff"] and prov["cpu_model"]
    assert "CPU :" in prov["system_info"]
    assert prov["used_devices"][0]["name"] == "CPU"
    assert prov["placement"]["model_buffers"]  # e.g. {"CPU_Mapped": 0.45}
    assert prov["cpu_kernels"]["extra_bufts"] is False
    assert prov["cpu_kernels"]["weight_buffers"] == sorted(prov["placement"]["model_buffers"])
    assert "AVX2" in prov["cpu_kernels"]["features"] or "NEON" in prov["cpu_kernels"]["features"]
    assert prov["model_file"]["weight_types"].get("q8_0", 0) > 0
    assert len(prov["model_file"]["sha256"]) == 64
    # the licence the file declares, carried to the copy llama_model_quantize made of it
    assert prov["model_file"]["licence"] == "cc0-1.0 (the file's general.license)"
    summary = (finished.root / "results/summary.md").read_text()
    assert "Licence: cc0-1.0 (the file's general.license)." in summary
    assert "  - `tiny.requant-q8_0`: cc0-1.0 (the file's general.license)" in summary


def test_two_cpu_devices_use_different_attention_kernels(finished: Workspace) -> None:
    """llama.cpp itself reports flash attention on for cpu-fa and off for cpu, and the
    quantized model's logits move while staying top-1-stable."""
    plain = record(finished, "tiny.requant-q8_0", "cpu", "none")
    fa = record(finished, "tiny.requant-q8_0", "cpu-fa", "none")
    assert plain["provenance"]["llama_context"]["flash_attn"] == "disabled"
    assert fa["provenance"]["llama_context"]["flash_attn"] == "enabled"
    result = finished.pair("tiny.requant-q8_0", "cpu.none", "cpu-fa.none")
    assert result["differs"] == ["flash_attn off→on"]
    assert result["summary"]["bit_identical_count"] == 0
    assert result["summary"]["max_abs_max"] > 0


def test_dequantized_copy_removes_activation_quantization(finished: Workspace) -> None:
    """Q8_0 vs its f32 copy differs far more than f32 plain vs f32 flash-attention."""
    quant_vs_f32 = finished.pair("tiny.requant-q8_0", "cpu.none", "cpu.f32")["summary"]
    f32_fa = finished.pair("tiny.requant-q8_0", "cpu.f32", "cpu-fa.f32")["summary"]
    assert quant_vs_f32["max_abs_max"] > 5 * f32_fa["max_abs_max"] > 0
    copy_info = json.loads(
        (finished.root / "resources/models/tiny.requant-q8_0.dequant-f32.gguf.json").read_text()
    )
    assert "f32 of tiny.requant-q8_0.gguf" in copy_info["origin"]


def test_report_has_every_section(finished: Workspace) -> None:
    text = (finished.root / "results/summary.md").read_text()
    for heading in (
        "## Left out and failed",
        "## Model `tiny`",
        "## Model `tiny.requant-q8_0`",
        "### Runs",
        "### Diagnosis",
        "### Pairwise differences, largest first",
        "### Free-running generations",
        "### Teacher-forced comparison",
        "### Where the pairs part: op by op",
        "### Distance from the reference",
        "### Tolerances for tests",
        "### Plots",
        "### Generated text",
        "## Provenance",
    ):
        assert heading in text
    # diagnosis on the tiny matrix: the flash-attention setting; its two prompts are too few
    # to decide an amplification over prompts (qdiff.judge.diagnosis.MIN_PROMPTS)
    q8 = text.split("## Model `tiny.requant-q8_0`")[1].split("### Pairwise")[0]
    assert "**setting**: `cpu` vs `cpu-fa` (same backend) differ only in flash_attn off→on" in q8
    assert "**activation-quantization**" not in q8
    assert "np.testing.assert_allclose(logits_device, logits_reference, rtol=0, atol=" in text
    # a flash-attention toggle on one CPU is not "cross-device"
    tolerances = text.split("## Model `tiny.requant-q8_0`")[1].split("### Tolerances for tests")[1]
    tolerances = tolerances.split("### Plots")[0]
    assert "same device, other settings (flash_attn off→on)" in tolerances
    assert "cross-device" not in tolerances
    assert "KL(`cpu.f32` ‖ combination)" in text
    for model in ("tiny", "tiny.requant-q8_0"):
        for plot in (f"plots/{model}.heatmap.png", f"plots/{model}.largest-pair.png"):
            assert f"]({plot})" in text
            assert (finished.root / "results" / plot).stat().st_size > 5000
    assert "| `cpu.none`" in text and "flash_attn off→on" in text
    pairs = (finished.root / "results/pairs.tsv").read_text().splitlines()
    assert len(pairs) == 1 + 12 * 2  # header + 12 pairs x 2 prompts
    # largest difference first in each model's pair table
    section = text.split("## Model `tiny.requant-q8_0`")[1]
    section = section.split("### Pairwise differences")[1].split("### Free-running")[0]
    values = [float(line.split("|")[4]) for line in section.splitlines() if line.startswith("| `")]
    assert values == sorted(values, reverse=True)


def forced_record(ws: Workspace, model: str, device: str, dequant: str) -> dict:
    return json.loads(
        (ws.root / f"results/forced/{model}/{device}/{dequant}/record.json").read_text()
    )


def test_teacher_forcing_compares_every_position(finished: Workspace) -> None:
    for model in ("tiny", "tiny.requant-q8_0"):
        teacher = forced_record(finished, model, "cpu", "f32")
        assert teacher["teacher"] == "cpu.f32" and teacher["n_positions"] == 16
        # the teacher, fed its own greedy output, chooses it again at every position
        assert teacher["agrees_with_teacher_tokens"] == 16
        for device in ("cpu", "cpu-fa"):
            for dq in ("none", "f32"):
                rec = forced_record(finished, model, device, dq)
                assert rec["status"] == "ok"
                # forcing takes generation's arithmetic path: position 0 is the free run's
                assert rec["first_step_identical_to_free_run"] == 2
    # tiny is an F32 file, so its f32 copy holds the same weights: identical everywhere
    same = finished.pair("tiny", "cpu.none", "cpu.f32")["forced"]
    assert same["bit_identical"] == same["n_positions"] == 16 and same["max_abs"] == 0
    fa = finished.pair("tiny.requant-q8_0", "cpu.none", "cpu-fa.none")["forced"]
    assert fa["status"] == "ok" and fa["n_positions"] == 16 and fa["bit_identical"] == 0
    assert len(fa["per_position"]) == 8 and fa["max_abs"] > 0
    assert fa["top1_agree"] + len(fa["forks"]) == 16
    text = (finished.root / "results/summary.md").read_text()
    assert "Every combination was fed the greedy output of `cpu.f32`" in text
    assert "chose that output at 16/16 positions" in text
    assert (
        finished.root / "results/plots/tiny.requant-q8_0.forced-positions.png"
    ).stat().st_size > 5000


def test_teacher_forcing_settings_rerun_only_the_forced_passes(
    finished: Workspace, tmp_path: Path
) -> None:
    ws = finished.copy_to(tmp_path / "ws")
    config = ws.read_config()
    config["teacher_forcing"] = {"top_k": 16}
    ws.write_config(config)
    # the exact reference keeps the logits forcing keeps: it follows; its emulations (first
    # steps only) do not
    assert by_rule(ws.planned_jobs()) == Counter(
        forced_combination=8,
        compare_model=2,
        localise_model=2,
        report=1,
        exact_reference=2,
        distance_from_exact=2,
    )
    config["teacher_forcing"] = {"enabled": False}
    ws.write_config(config)
    assert by_rule(ws.planned_jobs()) == Counter(
        compare_model=2, localise_model=2, report=1, exact_reference=2, distance_from_exact=2
    )


def test_forcing_fewer_tokens_than_generated_cuts_every_forced_text_alike(
    finished: Workspace, tmp_path: Path
) -> None:
    """teacher_forcing.n_tokens: the forced passes and the exact reference follow the first
    tokens of the teacher's texts, the same positions on every side; the runs stay."""
    ws = finished.copy_to(tmp_path / "ws")
    config = ws.read_config()
    config["teacher_forcing"] = {"n_tokens": 3}
    ws.write_config(config)
    assert "run_combination" not in by_rule(ws.planned_jobs())
    ws.snakemake()
    for model in ("tiny", "tiny.requant-q8_0"):
        teacher = json.loads((ws.root / f"results/runs/{model}/cpu/f32/record.json").read_text())
        assert all(len(p["tokens"]) == 8 for p in teacher["prompts"])  # generated 8
        for device, dequant in itertools.product(("cpu", "cpu-fa"), ("none", "f32")):
            forced = json.loads(
                (ws.root / f"results/forced/{model}/{device}/{dequant}/record.json").read_text()
            )
            assert forced["status"] == "ok" and forced["forced_tokens"] == 3
            assert forced["n_positions"] == 6, (model, device, dequant)
        exact = json.loads((ws.root / f"results/exact/{model}/record.json").read_text())
        assert exact["status"] == "ok" and exact["n_positions"] == 6
        distance = json.loads((ws.root / f"results/exact/{model}/distance.json").read_text())
        assert all(r["forced"]["n_positions"] == 6 for r in distance["rows"])
    text = (ws.root / "results/summary.md").read_text()
    assert "the first 3 tokens of each of its texts (6 positions over 2 prompts)" in text


def test_the_summary_page_embeds_the_report_and_its_plots(finished: Workspace) -> None:
    page = (finished.root / "results/summary.html").read_text()
    text = (finished.root / "results/summary.md").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<h2>What this experiment found</h2>" in page
    assert page.count("<table>") == text.count("\n|---") + text.count("\n|:--")
    assert page.count('<img src="data:image/png;base64,') == text.count("](plots/")
    assert '<img src="plots/' not in page and "\\|" not in page
    # the findings: one sentence per model, numbers as the tables below print them
    found = text.split("## What this experiment found")[1].split("\n## ")[0]
    for model in ("tiny", "tiny.requant-q8_0"):
        assert f"On `{model}`, " in found
    assert "red flag" in found


def test_snakemake_report_renders_without_rerunning_anything(
    finished: Workspace, tmp_path: Path
) -> None:
    html, archive = tmp_path / "report.html", tmp_path / "report.zip"
    finished.snakemake("--report", str(html))
    finished.snakemake("--report", str(archive))
    page = html.read_text()
    for category in ("1. Summary", "2. Tables", "3. Plots", "tiny.requant-q8_0"):
        assert category in page
    with zipfile.ZipFile(archive) as z:
        names = {Path(n).name for n in z.namelist()}
    assert {"report.html", "summary.html", "pairs.tsv", "runs.tsv"} <= names
    for model in ("tiny", "tiny.requant-q8_0"):
        assert {f"{model}.heatmap.png", f"{model}.largest-pair.png"} <= names
        assert any(n.startswith(f"{model}.depth.") for n in names)  # a kind with its detail
    assert finished.planned_jobs() == []


def test_the_catalogs_workflow_snakefile_is_the_same_workflow(finished: Workspace) -> None:
    # workflow/Snakefile only includes the top-level one: same rules, so nothing to do
    out = finished.snakemake("--snakefile", str(REPO / "workflow/Snakefile"), "--dry-run")
    assert "Nothing to be done" in out.stdout + out.stderr


def test_nothing_to_do_after_a_complete_run(finished: Workspace) -> None:
    assert finished.planned_jobs() == []


def test_adding_a_model_runs_only_that_model(
    finished: Workspace, tmp_path: Path, tiny_gguf_b: Path
) -> None:
    ws = finished.copy_to(tmp_path / "ws")
    config = ws.read_config()
    config["models"]["other"] = {"path": str(tiny_gguf_b)}
    ws.write_config(config)
    jobs = ws.planned_jobs()
    assert {j.wildcards.get("model") for j in jobs if j.rule != "report"} == {"other"}
    assert by_rule(jobs) == Counter(
        fetch_model=1,
        dequantize_model=1,
        run_combination=4,
        forced_combination=4,
        capture_combination=4,
        serving_combination=4,
        text_combination=4,
        compare_model=1,
        localise_model=1,
        compare_text=1,
        exact_reference=1,
        exact_roundings=1,
        exact_text=1,
        distance_from_exact=1,
        report=1,
    )


def test_changing_one_device_reruns_only_its_runs_and_pairs(
    finished: Workspace, tmp_path: Path
) -> None:
    ws = finished.copy_to(tmp_path / "ws")
    config = ws.read_config()
    config["devices"]["cpu-fa"]["n_ubatch"] = 1
    ws.write_config(config)
    jobs = ws.planned_jobs()
    runs = [j for j in jobs if j.rule == "run_combination"]
    assert {j.wildcards["device"] for j in runs} == {"cpu-fa"}
    assert len(runs) == 4  # 2 models x 2 dequant modes
    assert by_rule(jobs)["compare_model"] == 2  # one per model
    for rule in ("forced_combination", "capture_combination", "serving_combination"):
        again = [j for j in jobs if j.rule == rule]
        assert {j.wildcards["device"] for j in again} == {"cpu-fa"} and len(again) == 4
    assert by_rule(jobs)["localise_model"] == 2
    assert by_rule(jobs)["report"] == 1
    assert not {"fetch_model", "requantize_model", "dequantize_model"} & set(by_rule(jobs))
    # a model's comparison is one job, and it recomputes only the pairs that involve cpu-fa
    before = {m: ws.pairs(m) for m in ("tiny", "tiny.requant-q8_0")}
    ws.snakemake()
    for model, pairs in before.items():
        log = (ws.root / f"results/logs/compare/{model}.log").read_text()
        assert "compared 5 pairs" in log and "reused 1 pairs" in log, log
        unchanged = ws.pair(model, "cpu.none", "cpu.f32")
        assert unchanged == next(p for p in pairs if (p["a"], p["b"]) == ("cpu.none", "cpu.f32"))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            lambda c: c["prompts"].append({"id": "new", "text": "Once upon a time"}), id="prompts"
        ),
        pytest.param(lambda c: c["generation"].update(n_tokens=5), id="n_tokens"),
    ],
)
def test_changing_prompts_or_token_count_reruns_runs(
    finished: Workspace, tmp_path: Path, change
) -> None:
    ws = finished.copy_to(tmp_path / "ws")
    config = ws.read_config()
    change(config)
    ws.write_config(config)
    counts = by_rule(ws.planned_jobs())
    # a capture covers one prompt's forward pass, so it does not rerun; a serving job reads
    # its run's record (the process case) and the other prompts (a batch's others)
    assert counts == Counter(
        run_combination=8,
        forced_combination=8,
        serving_combination=8,
        compare_model=2,
        localise_model=2,
        report=1,
        exact_reference=2,
        exact_roundings=2,
        distance_from_exact=2,
    )


def test_repeated_runs_report_bit_identity(workspace: Workspace, tiny_gguf: Path) -> None:
    """repeats: 3 runs each combination in three fresh processes and says what it saw."""
    workspace.write_config(tiny_config(tiny_gguf, dequant=["none"], repeats=3))
    workspace.snakemake()
    rec = record(workspace, "tiny.requant-q8_0", "cpu", "none")
    det = rec["determinism"]
    assert det["repeats"] == 3
    # llama.cpp promises nothing; on this CPU a run is deterministic, and qdiff must say so
    assert det["bit_identical_logits"] is True and det["max_abs_between_repeats"] == 0.0
    log = (workspace.root / "results/logs/run/tiny.requant-q8_0/cpu/none.log").read_text()
    assert log.count("[qdiff] prompt rust") == 3
    assert "3× bit-identical" in (workspace.root / "results/summary.md").read_text()


def test_capture_localises_the_attention_kernel_change(finished: Workspace) -> None:
    """cpu and cpu-fa differ in one kernel choice: plain attention ops vs flash attention.
    The localisation must point there, and capturing must not change the logits."""
    for model in ("tiny", "tiny.requant-q8_0"):
        for device in ("cpu", "cpu-fa"):
            for dq in ("none", "f32"):
                rec = json.loads(
                    (
                        finished.root / f"results/capture/{model}/{device}/{dq}/record.json"
                    ).read_text()
                )
                assert rec["status"] == "ok"
                (prompt,) = rec["prompts"]
                assert prompt["id"] == "rust" and len(prompt["tensors"]) > 30
                assert prompt["logits_identical_with_capture"] is True
                assert prompt["logits_max_abs_with_capture"] == 0.0
    localised = json.loads((finished.root / "results/localise/tiny.requant-q8_0.json").read_text())
    (entry,) = [e for e in localised["pairs"] if {e["a"], e["b"]} == {"cpu.none", "cpu-fa.none"}]
    assert entry["status"] == "ok" and entry["floor"] == ["cpu.f32", "cpu-fa.f32"]
    (q,) = entry["prompts"]
    first = q["first_difference"]
    # everything before layer 0's attention is bit-identical; the graphs differ right there
    assert all(r["identical"] for r in q["rows"][: first["index"]])
    assert first["layer"] == 0
    families = " ".join(first["only_a_before"] + first["only_b_before"])
    assert "soft_max" in families and "flash-attention kernel" in families
    text = (finished.root / "results/summary.md").read_text()
    assert "FLASH_ATTN_EXT (unnamed) (attention (flash-attention kernel))" in text
    assert "Capturing left both combinations' logits bit-identical." in text
    assert (
        finished.root / "results/plots/tiny.requant-q8_0.depth.cpu.none__cpu-fa.none.rust.png"
    ).exists()


def test_capture_of_two_identical_configurations_finds_no_divergence(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    config = tiny_config(
        tiny_gguf,
        devices={
            "cpu": {"backend": "cpu", "threads": 1},
            "cpu-again": {"backend": "cpu", "threads": 1},
        },
        dequant=["none"],
        capture={"pairs": [["cpu.none", "cpu-again.none"]]},
        teacher_forcing={"enabled": False},
    )
    config["models"]["tiny"].pop("requantize")
    workspace.write_config(config)
    workspace.snakemake()
    localised = json.loads((workspace.root / "results/localise/tiny.json").read_text())
    (entry,) = localised["pairs"]
    (q,) = entry["prompts"]
    assert q["first_difference"] is None and q["first_divergence"] is None
    assert all(r["identical"] for r in q["rows"]) and len(q["rows"]) > 30
    n = len(q["rows"])
    assert (
        f"All {n} compared tensors are bit-identical"
        in (workspace.root / "results/summary.md").read_text()
    )


def test_a_localisation_that_fails_is_a_row_of_the_failure_table(
    finished: Workspace, tmp_path: Path
) -> None:
    """A capture file cut short after its record was written (a disk fault, say): the
    localisation that reads it fails on its own, the report names it with the error, and
    the other model's localisation is untouched."""
    ws = finished.copy_to(tmp_path / "ws")
    capture = ws.root / "results/capture/tiny/cpu/none/capture.npz"
    capture.write_bytes(capture.read_bytes()[:100])
    other = (ws.root / "results/localise/tiny.requant-q8_0.json").read_text()
    ws.snakemake("--forcerun", "localise_model")
    localised = json.loads((ws.root / "results/localise/tiny.json").read_text())
    assert localised["status"] == "failed" and localised["pairs"] == [], localised
    assert json.loads(other) == json.loads(
        (ws.root / "results/localise/tiny.requant-q8_0.json").read_text()
    )
    summary = (ws.root / "results/summary.md").read_text()
    (row,) = [line for line in summary.splitlines() if "| `localisation`" in line]
    assert row.startswith("| `tiny`") and "failed" in row, row
    assert "BadZipFile" in row and "its traceback: results/logs/localise/tiny.log" in row, row


def test_reruns_follow_content_not_timestamps_or_names(
    finished: Workspace, tmp_path: Path, tiny_gguf: Path
) -> None:
    ws = finished.copy_to(tmp_path / "ws")
    config = ws.read_config()
    private = tmp_path / "moved" / "model.gguf"  # the same bytes under another name
    private.parent.mkdir()
    private.write_bytes(tiny_gguf.read_bytes())
    config["models"]["tiny"]["path"] = str(private)
    ws.write_config(config)
    assert ws.planned_jobs() == []
    # touching every model file, the source and the fetched and derived copies, reruns nothing
    for model in [private, *(ws.root / "resources/models").glob("*.gguf")]:
        os.utime(model)
    assert ws.planned_jobs() == []
    # pinning the sha256 the file already has reruns nothing
    config["models"]["tiny"]["sha256"] = hashlib.sha256(private.read_bytes()).hexdigest()
    ws.write_config(config)
    assert ws.planned_jobs() == []
    # a deleted comparison is recreated, and only what reads it reruns
    (ws.root / "results/compare/tiny.json").unlink()
    assert by_rule(ws.planned_jobs()) == Counter(compare_model=1, localise_model=1, report=1)
    (ws.root / "results/runs/tiny/cpu/f32/logits.npy").unlink()
    assert by_rule(ws.planned_jobs())["run_combination"] == 1


def test_a_replaced_model_reruns_and_a_stale_pin_fails_its_fetch(
    finished: Workspace, tmp_path: Path, tiny_gguf: Path
) -> None:
    ws = finished.copy_to(tmp_path / "ws")
    private = tmp_path / "model.gguf"
    private.write_bytes(tiny_gguf.read_bytes())
    config = ws.read_config()
    config["models"]["tiny"].update(
        path=str(private), sha256=hashlib.sha256(private.read_bytes()).hexdigest()
    )
    ws.write_config(config)
    assert ws.planned_jobs() == []
    write_tiny_llama(private, seed=7)  # new bytes at the same path: the pin no longer holds
    jobs = ws.planned_jobs()
    assert by_rule(jobs)["fetch_model"] == 1
    assert {j.wildcards["model"] for j in jobs if j.rule == "run_combination"} == {
        "tiny",
        "tiny.requant-q8_0",
    }
    ws.snakemake()
    info = json.loads((ws.root / "resources/models/tiny.gguf.json").read_text())
    assert info["status"] == "failed" and "checksum mismatch" in info["error"]["message"]
    assert record(ws, "tiny", "cpu", "none")["status"] == "failed"  # the old results are gone
    assert "checksum mismatch" in (ws.root / "results/summary.md").read_text()


def test_capture_finds_the_token_axis_when_the_prompt_is_as_long_as_the_head_count(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    """A prompt of exactly n_head tokens: a tensor laid out head_dim x heads x tokens has two
    axes of that length. The token axis comes from the graph (a pass over one more token),
    so the kept slice is the last token's: RoPE rotates within each head, so each head's
    norm after it equals the norm before it (the plain matmul output, unambiguous)."""
    config = tiny_config(
        tiny_gguf,
        dequant=["none"],
        prompts=[{"id": "four", "text": "hi"}],
        teacher_forcing={"enabled": False},
        capture={"prompts": ["four"]},
    )
    del config["models"]["tiny"]["requantize"]
    workspace.write_config(config)
    workspace.snakemake()
    rec = json.loads((workspace.root / "results/capture/tiny/cpu/none/record.json").read_text())
    (prompt,) = rec["prompts"]
    n_head = 4  # tinymodel's default
    assert prompt["n_prompt_tokens"] == n_head  # the case under test, not a near miss
    data = np.load(workspace.root / "results/capture/tiny/cpu/none/capture.npz")
    q = {t["op"]: t for t in prompt["tensors"] if t["name"] == "Qcur-0"}
    assert q["ROPE"]["ne"][1:3] == [n_head, n_head] and q["ROPE"]["kept"] == "last position"
    before = data[q["MUL_MAT"]["key"]].reshape(n_head, -1)
    after = data[q["ROPE"]["key"]].reshape(n_head, -1)
    np.testing.assert_allclose(
        np.linalg.norm(after, axis=1), np.linalg.norm(before, axis=1), rtol=1e-5
    )


def test_a_device_that_computes_the_prompt_one_token_at_a_time_is_localised(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    """With n_ubatch 1, llama.cpp runs the prompt as one graph per token. The capture reads
    the last of them (the last token's), so its tensors match a one-graph capture's and the
    pair is compared op by op; capturing must leave its logits bit-identical."""
    config = tiny_config(
        tiny_gguf,
        devices={
            "cpu": {"backend": "cpu", "threads": 1},
            "cpu-ub1": {"backend": "cpu", "threads": 1, "n_ubatch": 1},
        },
        teacher_forcing={"enabled": False},
        capture={"pairs": [["cpu.none", "cpu-ub1.none"]]},
    )
    del config["models"]["tiny"]["requantize"]
    workspace.write_config(config)
    workspace.snakemake()
    rec = json.loads((workspace.root / "results/capture/tiny/cpu-ub1/none/record.json").read_text())
    (prompt,) = rec["prompts"]
    assert prompt["n_captured_tokens"] == 1 < prompt["n_prompt_tokens"]
    assert prompt["logits_identical_with_capture"]
    kept = {t["kept"] for t in prompt["tensors"]}
    assert kept == {"last position"}
    localised = json.loads((workspace.root / "results/localise/tiny.json").read_text())
    (pair,) = [p for p in localised["pairs"] if (p["a"], p["b"]) == ("cpu.none", "cpu-ub1.none")]
    (result,) = pair["prompts"]
    one_graph = json.loads(
        (workspace.root / "results/capture/tiny/cpu/none/record.json").read_text()
    )
    kept_there = [t for t in one_graph["prompts"][0]["tensors"] if t["kept"] == "last position"]
    assert result["n_tensors"] == len(kept_there) > 20  # every tensor with a token axis
    assert result["n_with_floor"] == result["n_tensors"]
    # the same tensor from both graphs: the embedding lookup of the same last token
    first = result["rows"][0]
    assert first["identical"] and first["max_abs"] == 0


def test_recommended_tolerances_cover_every_compared_value(finished: Workspace) -> None:
    """Each recommended atol is checked against all the data it claims to cover: every
    prompt's first-step max |Δ| and every teacher-forced position's, of every pair it covers."""
    from qdiff.judge.tolerance import tolerances

    for model in ("tiny", "tiny.requant-q8_0"):
        results = finished.pairs(model)
        rows = tolerances(results)
        assert rows
        for row in rows:
            covered = [r for r in results if f"{r['a']} vs {r['b']}" in row.pairs]
            values = [q["max_abs"] for r in covered for q in r["prompts"]]
            values += [
                x for r in covered for xs in r["forced"]["per_prompt_max_abs"].values() for x in xs
            ]
            assert len(values) == row.first_step_values + row.forced_values
            assert max(values) == row.largest <= row.atol
        text = (finished.root / "results/summary.md").read_text().split(f"## Model `{model}`")[1]
        assert all(f"| {row.atol:g} " in text or f"atol={row.atol:g})" in text for row in rows)


def test_the_exact_reference_measures_every_combination(finished: Workspace) -> None:
    for model in ("tiny", "tiny.requant-q8_0"):
        exact = json.loads((finished.root / f"results/exact/{model}/record.json").read_text())
        assert exact["status"] == "ok" and exact["architecture"] == "llama"
        assert exact["teacher"] == "cpu.f32" and exact["n_positions"] == 16
        distance = json.loads((finished.root / f"results/exact/{model}/distance.json").read_text())
        rows = {r["combination"]: r for r in distance["rows"]}
        assert set(rows) == {"cpu.none", "cpu.f32", "cpu-fa.none", "cpu-fa.f32"}
        assert all(r["status"] == "ok" and r["forced"]["n_positions"] == 16 for r in rows.values())
        assert distance["closest"] in rows
    # tiny is all F32: its f32 runs are near exact (float32 rounding); the Q8_0 file's quantized
    # kernels round activations and land far further away
    q8 = {
        r["combination"]: r
        for r in json.loads(
            (finished.root / "results/exact/tiny.requant-q8_0/distance.json").read_text()
        )["rows"]
    }
    assert q8["cpu.none"]["first_step"]["max_abs"] > 10 * q8["cpu.f32"]["first_step"]["max_abs"]
    text = (finished.root / "results/summary.md").read_text()
    assert "### Distance from the exact answer" in text and "★" in text


def test_every_cpu_combination_gets_an_error_budget(finished: Workspace) -> None:
    """The emulations ran once per model, every combination has a budget over every prompt,
    the activations' rounding appears only for the quantized file's runs, and the report
    has the table and the picture."""
    for model in ("tiny", "tiny.requant-q8_0"):
        folder = finished.root / f"results/exact/{model}"
        emulated = json.loads((folder / "roundings.json").read_text())
        assert emulated["status"] == "ok" and emulated["stage"] == "roundings"
        quantized_file = model != "tiny"
        applies = emulated["applies"]
        assert set(applies) == set(emulated["configs"]), applies
        assert applies["gelu_table"] is False and applies["kv_f16"] is True  # llama: SiLU
        assert applies["activations"] == quantized_file
        rows = {
            r["combination"]: r for r in json.loads((folder / "distance.json").read_text())["rows"]
        }
        for label, row in rows.items():
            budget = row["budget"]
            assert budget["status"] == "ok" and budget["n_prompts"] == 2, (model, label)
            names = [s["name"] for s in budget["sources"]]
            quantized = model != "tiny" and label.endswith(".none")
            assert ("activations" in names) == quantized, (model, label, names)
            assert "gelu_table" not in names  # llama uses SiLU
            assert ("flash_cpu" in names) != ("qp_f16" in names), names
        assert (finished.root / f"results/plots/{model}.budget.png").stat().st_size > 5000
    text = (finished.root / "results/summary.md").read_text()
    assert text.count("### Error budget") == 2 and "| reading" in text


def test_changing_a_device_other_than_the_teacher_never_reruns_the_exact_reference(
    finished: Workspace, tmp_path: Path
) -> None:
    ws = finished.copy_to(tmp_path / "ws")
    config = ws.read_config()
    config["devices"]["cpu-fa"]["n_ubatch"] = 1
    config["devices"]["extra"] = {"backend": "cpu", "threads": 1, "n_batch": 64}
    ws.write_config(config)
    counts = by_rule(ws.planned_jobs())
    assert "exact_reference" not in counts and counts["distance_from_exact"] == 2
    assert counts["exact_roundings"] == 2  # cpu-fa's flash attention now in 1-token ubatches


def test_another_model_as_the_reference(
    workspace: Workspace, tiny_gguf: Path, tmp_path: Path
) -> None:
    """The F16 original and its Q8_0 and Q4_0 children: each child's combinations measured
    against the original's run and its exact answer; more bits, closer. A model with as
    many tokens but one other token text is not compared, and says why."""
    original = tmp_path / "original-f16.gguf"
    quantize_in_child(tiny_gguf, original, "f16")
    renamed = tmp_path / "renamed-f16.gguf"  # "▁the" is "▁thq" there: same size, same prompts
    renamed.write_bytes(original.read_bytes().replace("▁the".encode(), "▁thq".encode(), 1))
    config = tiny_config(original, dequant=["none"], reference="cpu.none", reference_model="orig")
    config["models"] = {
        "orig": {"path": str(original), "requantize": ["q8_0", "q4_0"]},
        "renamed": {"path": str(renamed)},
    }
    config["capture"] = {"enabled": False}
    workspace.write_config(config)
    workspace.snakemake()
    rows = {}
    for child in ("orig.requant-q8_0", "orig.requant-q4_0"):
        result = json.loads((workspace.root / f"results/reference/{child}.json").read_text())
        assert result["reference"] == "cpu.none" and result["has_exact"]
        rows[child] = {r["combination"]: r for r in result["rows"]}
        assert all(r["status"] == "ok" and r["n_prompts"] == 2 for r in rows[child].values())
    q8, q4 = rows["orig.requant-q8_0"]["cpu.none"], rows["orig.requant-q4_0"]["cpu.none"]
    assert q8["kl_mean"] < q4["kl_mean"] and q8["vs_exact"]["max_abs"] < q4["vs_exact"]["max_abs"]
    renamed_rows = json.loads((workspace.root / "results/reference/renamed.json").read_text())
    for row in renamed_rows["rows"]:
        assert (
            row["status"] == "n/a"
            and "another tokenizer than the reference model's" in (row["reason"])
        ), row
    assert not (workspace.root / "results/reference/orig.json").exists()
    text = (workspace.root / "results/summary.md").read_text()
    assert "This is the reference model" in text
    assert (
        "against `orig`'s `cpu.none` run" in text
        and "against the exact answer of `orig`'s weights" in text
    )


def test_runs_that_keep_only_the_top_k_compare_first_steps_on_the_forced_slice(
    finished: Workspace, tmp_path: Path
) -> None:
    """first_step_logits: top_k drops every logits.npy; first steps then compare on the
    forced passes' position 0. Over a slice as large as the vocabulary (411 tokens here,
    top_k 1024) that is the full comparison; over a smaller one max |Δ| and KL are lower
    bounds, and top-1 and bit-identity stay exact."""
    ws = finished.copy_to(tmp_path / "ws")
    for logits in (ws.root / "results/runs").rglob("logits.npy"):
        logits.unlink()  # what a user with too little disk would do
    config = ws.read_config()
    config["first_step_logits"] = "top_k"
    ws.write_config(config)
    # nothing is run again: only what compares first steps, and the report
    assert by_rule(ws.planned_jobs()) == Counter(
        compare_model=2, localise_model=2, distance_from_exact=2, report=1
    )
    ws.snakemake()
    summary = (ws.root / "results/summary.md").read_text()
    assert "over the teacher's top 411 tokens" in summary
    assert "**Runs kept no full first-step logits**" in summary.split("## What this")[0]
    assert "not drawn: the runs keep no full first-step logits" in summary
    for model in ("tiny", "tiny.requant-q8_0"):
        full = {(p["a"], p["b"]): p for p in finished.pairs(model)}
        for pair in ws.pairs(model):
            assert pair["status"] == "ok" and pair["first_step_top_k"] == 411
            reference = full[pair["a"], pair["b"]]
            for mine, theirs in zip(pair["prompts"], reference["prompts"], strict=True):
                for key in ("top1_agree", "bit_identical", "top1_margin_a"):
                    assert mine[key] == theirs[key], (key, mine, theirs)
                for key in ("max_abs", "mean_abs", "rms", "nmse", "kl", "kl_ba", "dp_top"):
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-12), key
        distances = json.loads((ws.root / f"results/exact/{model}/distance.json").read_text())
        before = json.loads((finished.root / f"results/exact/{model}/distance.json").read_text())
        for mine, theirs in zip(distances["rows"], before["rows"], strict=True):
            assert mine["first_step_top_k"] == 411
            assert mine["first_step"]["max_abs"] == pytest.approx(theirs["first_step"]["max_abs"])

    # a slice smaller than the vocabulary: lower bounds, exact top-1 and bit-identity
    config["teacher_forcing"] = {"top_k": 8}
    ws.write_config(config)
    ws.snakemake()
    for model in ("tiny", "tiny.requant-q8_0"):
        full = {(p["a"], p["b"]): p for p in finished.pairs(model)}
        for pair in ws.pairs(model):
            assert pair["first_step_top_k"] == 8
            reference = full[pair["a"], pair["b"]]
            for mine, theirs in zip(pair["prompts"], reference["prompts"], strict=True):
                assert mine["top1_agree"] == theirs["top1_agree"]
                assert mine["bit_identical"] == theirs["bit_identical"]
                assert mine["max_abs"] <= theirs["max_abs"]
                assert mine["kl"] <= theirs["kl"] * (1 + 1e-9) + 1e-15
    assert not list((ws.root / "results/runs").rglob("logits.npy"))


def test_top_k_first_steps_need_teacher_forcing(workspace: Workspace, tiny_gguf: Path) -> None:
    workspace.write_config(
        tiny_config(tiny_gguf, first_step_logits="top_k", teacher_forcing={"enabled": False})
    )
    proc = workspace.snakemake("--dry-run", check=False)
    assert proc.returncode != 0
    assert "config.first_step_logits: top_k" in proc.stderr + proc.stdout
    assert "teacher_forcing.enabled" in proc.stderr + proc.stdout
