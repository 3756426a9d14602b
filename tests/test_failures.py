"""Crashes, corrupt models and missing backends: recorded, reported, retried; never hidden."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import Workspace
from tinymodel import spm_vocab, write_tiny_llama

pytestmark = pytest.mark.workflow
SECRET = "hf_qdiff_secret_value_42"


def write_aborting_model(path: Path) -> Path:
    """A GGUF whose vocabulary repeats a piece: llama.cpp hits GGML_ASSERT and aborts."""
    write_tiny_llama(path)
    reader = gguf.GGUFReader(path)
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    assert tokens == spm_vocab()[0]
    data = path.read_bytes()
    # rename "<0x01>" to "<0x00>": same length, so the file stays well-formed
    path.write_bytes(data.replace(b"<0x01>", b"<0x00>", 1))
    return path


def config(models: dict, devices: dict, **extra) -> dict:
    return {
        "models": models,
        "devices": devices,
        "dequant": ["none"],
        "prompts": [{"id": "p", "text": "What is Rust?"}],
        "generation": {"n_tokens": 4, "n_ctx": 128},
        **extra,
    }


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Workspace:
    models_dir = tmp_path_factory.mktemp("broken_models")
    truncated = models_dir / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    aborting = write_aborting_model(models_dir / "aborting.gguf")
    alien = write_tiny_llama(models_dir / "alien.gguf", arch="qdiffnet")
    ws = Workspace(tmp_path_factory.mktemp("broken") / "ws")
    ws.write_config(
        config(
            models={
                "good": {"path": str(tiny_gguf)},
                "truncated": {"path": str(truncated)},
                "aborting": {"path": str(aborting)},
                "alien": {"path": str(alien)},
            },
            devices={
                "cpu": {"backend": "cpu", "threads": 1, "env": {"HF_TOKEN": SECRET}},
                "gpu": {"backend": "cuda"},
            },
        )
    )
    ws.snakemake()  # every job "succeeds": failures are recorded, not raised
    return ws


def rec(ws: Workspace, model: str, device: str) -> dict:
    return json.loads((ws.root / f"results/runs/{model}/{device}/none/record.json").read_text())


def test_missing_backend_is_left_out_never_substituted(broken: Workspace) -> None:
    r = rec(broken, "good", "gpu")
    assert r["status"] == "unavailable"
    assert "cannot use the cuda backend" in r["error"]["message"]
    assert r["prompts"] == []
    logits = np.load(broken.root / "results/runs/good/gpu/none/logits.npy", allow_pickle=False)
    assert logits.size == 0
    assert rec(broken, "good", "cpu")["status"] == "ok"


def test_llama_cpp_abort_is_recorded_with_signal_and_log(broken: Workspace) -> None:
    r = rec(broken, "aborting", "cpu")
    assert r["status"] == "failed"
    assert r["error"]["kind"] == "crash" and r["error"]["signal"] == "SIGABRT"
    assert any("GGML_ASSERT" in line for line in r["error"]["error_lines"])
    assert "GGML_ASSERT(id_to_token.size() == token_to_id.size())" in r["error"]["message"]
    assert r["error"]["log_tail"]


def test_truncated_model_fails_with_file_and_reason(broken: Workspace) -> None:
    r = rec(broken, "truncated", "cpu")
    assert r["status"] == "failed" and r["error"]["kind"] == "model"
    assert "truncated.gguf" in r["error"]["message"]
    assert "complete GGUF" in r["error"]["message"]


def test_unknown_architecture_fails_with_the_reason(broken: Workspace) -> None:
    r = rec(broken, "alien", "cpu")
    assert r["status"] == "failed" and r["error"]["kind"] == "model"
    assert "alien.gguf" in r["error"]["message"]
    assert "unknown model architecture: 'qdiffnet'" in r["error"]["message"]


def test_secrets_in_device_env_never_reach_results(broken: Workspace) -> None:
    assert rec(broken, "good", "cpu")["settings"]["env"] == {"HF_TOKEN": "<redacted>"}
    for path in (broken.root / "results").rglob("*"):
        if path.is_file() and path.suffix != ".npy":
            assert SECRET not in path.read_text(errors="replace"), path


def test_gpu_runs_declare_a_gpu_resource(workspace: Workspace, tiny_gguf: Path) -> None:
    workspace.write_config(
        config(models={"good": {"path": str(tiny_gguf)}},
               devices={"cpu": {"backend": "cpu"}, "gpu": {"backend": "vulkan"}})
    )
    runs = [j for j in workspace.planned_jobs() if j.rule == "run_combination"]
    assert {j.wildcards["device"]: j.resources["gpu"] for j in runs} == {"cpu": "0", "gpu": "1"}


def test_report_marks_failures_and_left_out_devices(broken: Workspace) -> None:
    text = (broken.root / "results/summary.md").read_text()
    left_out = text.split("## Left out and failed")[1].split("## Model")[0]
    assert re.search(r"`good`\s+\| `gpu.none`\s+\| unavailable", left_out)
    assert "SIGABRT" in left_out
    assert "truncated.gguf" in left_out
    pairs = json.loads((broken.root / "results/compare/good/cpu.none__gpu.none.json").read_text())
    assert pairs["status"] == "n/a" and "gpu.none unavailable" in pairs["reason"]
    assert "n/a: gpu.none unavailable" in text


def test_rerun_retries_only_the_failed_runs(broken: Workspace, tmp_path: Path, tiny_gguf: Path) -> None:
    ws = broken.copy_to(tmp_path / "ws")
    jobs = ws.planned_jobs()
    runs = {(j.wildcards["model"], j.wildcards["device"]) for j in jobs if j.rule == "run_combination"}
    assert runs == {("truncated", "cpu"), ("aborting", "cpu"), ("alien", "cpu")}
    # fix the cause: point the aborting model at a good file; its run then succeeds
    cfg = ws.read_config()
    cfg["models"]["aborting"]["path"] = str(tiny_gguf)
    ws.write_config(cfg)
    ws.snakemake()
    assert rec(ws, "aborting", "cpu")["status"] == "ok"
    assert rec(ws, "truncated", "cpu")["status"] == "failed"
    counts = Counter(j.rule for j in ws.planned_jobs())
    # truncated and alien: their failed runs and captures are retried, and the forced passes
    # of both devices follow their teacher's (the cpu run's) new record
    assert counts == Counter(
        run_combination=2, capture_combination=2, force_combination=4, compare_pair=2,
        localise_model=2, report=1,
    )


def test_strict_devices_stops_with_a_clear_message(workspace: Workspace, tiny_gguf: Path) -> None:
    workspace.write_config(
        config(models={"good": {"path": str(tiny_gguf)}}, devices={"gpu": {"backend": "cuda"}},
               strict_devices=True)
    )
    proc = workspace.snakemake(check=False)
    assert proc.returncode != 0
    log = (workspace.root / "results/logs/run/good/gpu/none.log").read_text()
    assert "device 'gpu'" in log and "strict_devices is on" in log
    assert not (workspace.root / "results/runs/good/gpu/none/record.json").exists()


def test_extra_buffer_types_amx_crash_is_isolated(workspace: Workspace, tiny_gguf: Path) -> None:
    """qdiff's answer to the AMX crash: extra buffer types are off by default, and a device
    that turns them on is isolated. On an AMX CPU (this project's Xeon) llama.cpp's AMX kernel
    kills the run (SIGSEGV on Gemma, SIGILL on this VM); elsewhere it runs normally."""
    info = subprocess.run(
        [sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
        capture_output=True, text=True, check=True,
    ).stdout
    workspace.write_config(
        config(
            models={"tiny": {"path": str(tiny_gguf), "requantize": ["q8_0"]}},
            devices={"cpu": {"backend": "cpu", "threads": 1},
                     "cpu-amx": {"backend": "cpu", "threads": 1, "extra_bufts": True}},
        )
    )
    workspace.snakemake()
    plain = rec(workspace, "tiny.requant-q8_0", "cpu")
    assert plain["status"] == "ok"
    assert plain["provenance"]["cpu_kernels"]["weight_buffers"] == ["CPU_Mapped"]
    amx = rec(workspace, "tiny.requant-q8_0", "cpu-amx")
    if "AMX_INT8 = 1" in info:
        assert amx["status"] == "failed", "the AMX kernel ran: update README 'CPU kernels'"
        assert amx["error"]["signal"] in {"SIGSEGV", "SIGILL", "SIGABRT"}
        assert "AMX" in amx["error"]["model_buffers"]
    else:
        assert amx["status"] == "ok"
