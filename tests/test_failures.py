"""Every promise of the README's "When things go wrong", with each fault injected for real:
real HTTP, real corrupt files, real llama.cpp aborts and refusals, real Snakemake."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import Workspace
from modelserver import REDIRECT_QUERY, serving
from tinymodel import spm_vocab, write_tiny_llama

pytestmark = pytest.mark.workflow
# values under names that no redaction list knows, and in a URL's query string
SECRET = "sekrit-MY-service-pat-42"
URL_SECRET = "sig-abc-secret-987"


def write_aborting_model(path: Path) -> Path:
    """A GGUF whose vocabulary repeats a piece: llama.cpp hits GGML_ASSERT and aborts."""
    write_tiny_llama(path)
    reader = gguf.GGUFReader(path)
    tokens = [
        bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
        for i in reader.fields["tokenizer.ggml.tokens"].data
    ]
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
def broken(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path):
    """One experiment with a fault in every stage that can meet one: a 404, an empty file and
    a web page as sources; a truncated model that cannot be requantized or copied; a model
    that aborts llama.cpp; an unknown architecture; a missing backend; a context llama.cpp
    refuses. Returns the workspace, Snakemake's console output and the HTTP server's log."""
    models_dir = tmp_path_factory.mktemp("broken_models")
    truncated = models_dir / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    (models_dir / "empty.gguf").write_bytes(b"")
    (models_dir / "page.html").write_bytes(b"<html>not a model</html>")
    ws = Workspace(tmp_path_factory.mktemp("broken") / "ws")
    with serving(tiny_gguf.read_bytes()) as server:
        ws.write_config(
            config(
                models={
                    "good": {"path": str(tiny_gguf)},
                    "truncated": {"path": str(truncated), "requantize": ["q8_0"]},
                    "aborting": {"path": str(write_aborting_model(models_dir / "aborting.gguf"))},
                    "alien": {
                        "path": str(write_tiny_llama(models_dir / "alien.gguf", arch="qdiffnet"))
                    },
                    "gone": {
                        "url": f"{server.base}/missing.gguf?sig={URL_SECRET}",
                        "sha256": "0" * 64,
                    },
                    # redirected to plain http elsewhere, with a signed query: refused
                    "away": {"url": f"{server.base}/redirect-away/m.gguf", "sha256": "0" * 64},
                    "empty": {"path": str(models_dir / "empty.gguf")},
                    "webpage": {"path": str(models_dir / "page.html")},
                },
                devices={
                    "cpu": {"backend": "cpu", "threads": 1, "env": {"MY_SERVICE_PAT": SECRET}},
                    "gpu": {"backend": "cuda"},
                    "cpu-q8kv": {"backend": "cpu", "threads": 1, "kv_cache_type": "q8_0"},
                },
                dequant=["none", "f32"],
            )
        )
        # every job "succeeds": failures are recorded, not raised; every Python process the
        # workflow starts notes whether its environment holds the hidden value (probe)
        proc = ws.snakemake(env=environment_probe(ws.root.parent / "probe", SECRET))
        requests = list(server.requests)
    return ws, proc.stdout + proc.stderr, requests


PROBE = r"""
import hashlib, os, sys
if os.environ.get("QDIFF_TEST_PROBE_LOG"):
    wanted = os.environ["QDIFF_TEST_PROBE_DIGEST"]
    held = [k for k, v in os.environ.items() if hashlib.sha256(v.encode()).hexdigest() == wanted]
    with open(os.environ["QDIFF_TEST_PROBE_LOG"], "a") as log:
        argv = open("/proc/self/cmdline").read().replace("\0", " ")
        log.write(f"{held}\t{argv[:150]}\n")
"""


def environment_probe(folder: Path, secret: str) -> dict[str, str]:
    """An environment whose Python processes each log, at start, the names of the variables
    that hold ``secret`` (a sitecustomize on PYTHONPATH): ``folder/log``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(PROBE)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
        "QDIFF_TEST_PROBE_LOG": str(folder / "log"),
        "QDIFF_TEST_PROBE_DIGEST": hashlib.sha256(secret.encode()).hexdigest(),
    }


def rec(ws: Workspace, model: str, device: str, dequant: str = "none", stage: str = "runs") -> dict:
    return json.loads(
        (ws.root / f"results/{stage}/{model}/{device}/{dequant}/record.json").read_text()
    )


def failures_table(ws: Workspace) -> str:
    return (
        (ws.root / "results/summary.md")
        .read_text()
        .split("## Left out and failed")[1]
        .split("## Model")[0]
    )


def test_the_report_renders_with_a_failure_in_every_stage(broken) -> None:
    ws, _, _ = broken
    table = failures_table(ws)
    expected = {
        # fetch: a 404, an empty file, a file that is not GGUF
        "gone": r"HTTP 404 Not Found for http://127\.0\.0\.1:\d+/missing\.gguf\?…: check the URL",
        "empty": r"is an empty file: check the source",
        "webpage": r"is not a GGUF file \(it starts with b'\\<htm'\)",  # escaped Markdown
        # derivation: the requantized model and the f32 copy of a truncated file
        "truncated.requant-q8_0": r"making the q8_0 copy of truncated\.gguf failed: llama_model_quantize "
        r"failed \(code 1\): .*data is not within the file bounds",
        # runs: an abort, an unknown architecture
        "aborting": r"killed by SIGABRT \(.*GGML_ASSERT\(id_to_token\.size\(\) == token_to_id\.size\(\)\)",
        "alien": r"unknown model architecture: 'qdiffnet'",
    }
    for model, reason in expected.items():
        rows = [line for line in table.splitlines() if line.startswith(f"| `{model}`")]
        assert rows and any(re.search(reason, row) for row in rows), (model, rows)
    # the f32 copy of the truncated file failed to be made: every stage that needs it says so
    assert re.search(
        r"`truncated`\s+\| `cpu.f32`\s+\| run, teacher forcing, capture, serving\s+\| failed\s+\| "
        r"model file truncated.dequant-f32.gguf is missing",
        table,
    )
    assert not re.search(r"`good`\s+\| `cpu\.", table)  # the healthy model ran on cpu
    text = (ws.root / "results/summary.md").read_text()
    good = text.split("## Model `good`")[1].split("## Model")[0]
    assert re.search(
        r"\| `cpu.none`\s+\| `cpu.f32`\s+\| dequant none→f32\s+\| 0 ", good
    )  # compared as usual
    for model in ("gone", "empty", "webpage"):
        info = json.loads((ws.root / f"resources/models/{model}.gguf.json").read_text())
        assert info["status"] == "failed" and info["run_token"]
        assert (ws.root / f"resources/models/{model}.gguf").stat().st_size == 0
        assert rec(ws, model, "cpu")["error"]["kind"] == "upstream"


def test_deterministic_failures_are_not_retried_within_a_run(broken) -> None:
    _, _, requests = broken
    assert [path for method, path, _ in requests if "missing.gguf" in path] != []
    assert (
        len([1 for method, path, _ in requests if "missing.gguf" in path and method == "GET"]) == 1
    )


def test_missing_backend_is_left_out_never_substituted(broken) -> None:
    ws, _, _ = broken
    r = rec(ws, "good", "gpu")
    assert r["status"] == "unavailable"
    assert "cannot use the cuda backend" in r["error"]["message"]
    assert r["prompts"] == []
    logits = np.load(ws.root / "results/runs/good/gpu/none/logits.npy", allow_pickle=False)
    assert logits.size == 0
    assert rec(ws, "good", "cpu")["status"] == "ok"
    pair = ws.pair("good", "cpu.none", "gpu.none")
    assert pair["status"] == "n/a" and "gpu.none unavailable" in pair["reason"]
    assert re.search(r"`good`\s+\| `gpu.none`\s+\| run\s+\| unavailable", failures_table(ws))


def test_llama_cpp_abort_is_recorded_with_signal_and_its_own_words(broken) -> None:
    r = rec(broken[0], "aborting", "cpu")
    assert r["status"] == "failed"
    assert r["error"]["kind"] == "crash" and r["error"]["signal"] == "SIGABRT"
    assert r["error"]["error_lines"][-1].endswith(
        "GGML_ASSERT(id_to_token.size() == token_to_id.size()) failed"
    )
    # no ordinary log line (llama.cpp prints "unknown_token_id" while loading) is a reason
    assert not any("unknown_token_id" in line for line in r["error"]["error_lines"])
    assert r["error"]["log_tail"]


def test_a_refused_context_is_blamed_on_the_settings_in_llama_cpps_words(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    workspace.write_config(
        config(
            models={"good": {"path": str(tiny_gguf)}},
            devices={"cpu-q8kv": {"backend": "cpu", "threads": 1, "kv_cache_type": "q8_0"}},
        )
    )
    workspace.snakemake()
    r = rec(workspace, "good", "cpu-q8kv")
    assert r["status"] == "failed" and r["error"]["kind"] == "context"
    message = r["error"]["message"]
    assert (
        "refused a context for device 'cpu-q8kv' (kv_cache_type q8_0, flash_attn False" in message
    )
    assert "quantized V cache requires flash_attn to be enabled" in message
    assert "complete GGUF" not in message  # not the model file's fault


def test_truncated_model_fails_with_file_and_reason(broken) -> None:
    r = rec(broken[0], "truncated", "cpu")
    assert r["status"] == "failed" and r["error"]["kind"] == "model"
    assert "truncated.gguf" in r["error"]["message"]
    assert "data is not within the file bounds" in r["error"]["message"]


def test_secrets_reach_the_job_and_nothing_else(broken, tmp_path: Path) -> None:
    """A secret under an unknown name and one in a URL's query string: never in a log, in
    .snakemake/, a record, a table or the report, nor on the console, also when it changes;
    and the job itself did receive it."""
    ws, console, _ = broken
    r = rec(ws, "good", "cpu")
    assert re.fullmatch(r"<hidden:[0-9a-f]{16}>", r["settings"]["env"]["MY_SERVICE_PAT"])
    assert r["provenance"]["hidden_env_received"] == {"MY_SERVICE_PAT": True}
    # no process the workflow started held the value in its environment: the llama.cpp
    # worker is given it (above) by its supervisor, which asked Snakemake's process for it
    started = (ws.root.parent / "probe" / "log").read_text().splitlines()
    holding = [line for line in started if not line.startswith("[]\t")]
    # but gdb, which ggml starts from the aborting llama.cpp worker to print its backtrace:
    # a child of the one process that holds the value, with its environment
    assert len(started) > 20 and all("\tgdb --batch" in line for line in holding), holding
    # a redirect's signed query was never configured, so never hidden: messages drop it
    hidden = (SECRET, URL_SECRET, REDIRECT_QUERY.split("=")[1])
    away = json.loads((ws.root / "resources/models/away.gguf.json").read_text())
    assert "refusing redirect" in away["error"]["message"]
    assert "plain http:// is refused for example.invalid" in away["error"]["message"]

    def leaks(root: Path, text: str) -> list[str]:
        found = [
            str(p)
            for p in root.rglob("*")
            if p.is_file()
            and p.suffix not in (".npy", ".npz", ".gguf")
            and "config" not in p.relative_to(root).parts
            and any(s.encode() in p.read_bytes() for s in hidden)
        ]
        found += [f"console: {s}" for s in hidden if s in text]
        return found

    assert leaks(ws.root, console) == []
    changed = ws.copy_to(tmp_path / "ws")
    cfg = changed.read_config()
    cfg["devices"]["cpu"]["env"]["MY_SERVICE_PAT"] = SECRET + "-rotated"
    changed.write_config(cfg)
    dry = changed.snakemake("--dry-run")  # prints why each job reruns: params changed
    assert "Params have changed" in dry.stdout + dry.stderr
    assert leaks(changed.root, dry.stdout + dry.stderr) == []


def test_strict_devices_stops_before_any_job(workspace: Workspace, tiny_gguf: Path) -> None:
    """A missing backend stops a run before its first job, and a dry run; the commands that
    run no job (--unlock, --report, --cleanup-metadata) work, so that results made where the
    backend was can be reported on a machine without it."""
    strict = config(
        models={"good": {"path": str(tiny_gguf)}},
        devices={"cpu": {"backend": "cpu"}, "gpu": {"backend": "cuda"}},
        strict_devices=True,
    )
    workspace.write_config(strict)
    for args in ((), ("--dry-run",)):
        proc = workspace.snakemake(*args, check=False)
        assert proc.returncode != 0
        assert (
            "config.devices.gpu: strict_devices is on and this llama-cpp-python build cannot use "
            "the cuda backend on this machine"
        ) in proc.stdout + proc.stderr
        assert not (workspace.root / "results").exists()  # not one job ran
    workspace.write_config({**strict, "strict_devices": False})
    workspace.snakemake()  # the results, the gpu device left out
    workspace.write_config(strict)
    for args in (
        ("--unlock",),
        ("--report", str(workspace.root / "report.html")),
        ("--cleanup-metadata", "results/summary.md"),
    ):
        proc = workspace.snakemake(*args, check=False)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
    assert (workspace.root / "report.html").is_file()


def test_gpu_runs_declare_a_gpu_resource(workspace: Workspace, tiny_gguf: Path) -> None:
    workspace.write_config(
        config(
            models={"good": {"path": str(tiny_gguf)}},
            devices={"cpu": {"backend": "cpu"}, "gpu": {"backend": "vulkan"}},
        )
    )
    jobs = workspace.planned_jobs()
    for rule in ("run_combination", "forced_combination", "capture_combination"):
        planned = {j.wildcards["device"]: j.resources for j in jobs if j.rule == rule}
        assert {d: r["gpu"] for d, r in planned.items()} == {"cpu": "0", "gpu": "1"}
        assert all(int(r["runtime"]) > 0 for r in planned.values())  # from the stage table


def test_rerun_retries_only_what_failed(broken, tmp_path: Path, tiny_gguf: Path) -> None:
    ws = broken[0].copy_to(tmp_path / "ws")
    counts = Counter(j.rule for j in ws.planned_jobs())
    # the failed fetches and derivations are retried; failed runs too, never the good ones
    # gone, away, empty and webpage; truncated's requantization
    assert counts["fetch_model"] == 4 and counts["requantize_model"] == 1
    planned_runs = {
        (j.wildcards["model"], j.wildcards["device"], j.wildcards["dequant"])
        for j in ws.planned_jobs()
        if j.rule == "run_combination"
    }
    assert ("good", "cpu", "none") not in planned_runs and (
        "good",
        "cpu-q8kv",
        "none",
    ) in planned_runs
    assert ("good", "gpu", "none") not in planned_runs  # unavailable: not retried
    # fix a cause: point the aborting model at a good file; its run then succeeds
    cfg = ws.read_config()
    cfg["models"]["aborting"]["path"] = str(tiny_gguf)
    ws.write_config(cfg)
    ws.snakemake()
    assert rec(ws, "aborting", "cpu")["status"] == "ok"
    assert rec(ws, "truncated", "cpu")["status"] == "failed"


@pytest.fixture
def healthy(workspace: Workspace, tiny_gguf: Path) -> Workspace:
    workspace.write_config(
        config(
            models={"good": {"path": str(tiny_gguf)}},
            devices={
                "cpu": {"backend": "cpu", "threads": 1},
                "cpu-fa": {"backend": "cpu", "threads": 1, "flash_attn": True},
            },
        )
    )
    workspace.snakemake()
    return workspace


def test_forced_pass_and_comparison_failures_are_reported(healthy: Workspace) -> None:
    """Files corrupted on disk between stages: a forced pass that reads the teacher's
    truncated forced pass, and the comparisons that read a truncated logits file."""
    logits = healthy.root / "results/runs/good/cpu-fa/none/logits.npy"
    logits.write_bytes(logits.read_bytes()[:100])
    teacher = healthy.root / "results/forced/good/cpu/none/forced.npz"
    teacher.write_bytes(teacher.read_bytes()[:100])
    healthy.snakemake("--forcerun", "results/forced/good/cpu-fa/none/record.json", "compare_model")
    forced = rec(healthy, "good", "cpu-fa", stage="forced")
    assert forced["status"] == "failed" and forced["error"]["log"].endswith(
        "forced/good/cpu-fa/none.log"
    )
    pair = healthy.pair("good", "cpu.none", "cpu-fa.none")
    assert pair["status"] == "failed" and "comparison failed" in pair["reason"]
    table = failures_table(healthy)
    assert re.search(r"`good`\s+\| `cpu-fa.none`\s+\| teacher forcing\s+\| failed", table)
    assert re.search(r"`good`\s+\| `cpu.none vs cpu-fa.none`\s+\| comparison\s+\| failed", table)


def test_model_bytes_replaced_behind_qdiffs_back_are_made_again(healthy: Workspace) -> None:
    """Other bytes of the same size in a fetched model file, its mtime set back: the next
    invocation notices (the hash cache keys on ctime too), fetches the file again before any
    job reads it, and keeps every result, which the right bytes made."""
    model = healthy.root / "resources/models/good.gguf"
    original, stat = model.read_bytes(), model.stat()
    model.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    record = (healthy.root / "results/runs/good/cpu/none/record.json").read_bytes()
    out = healthy.snakemake()
    said = out.stdout + out.stderr
    assert re.search(r"remake: bytes changed to sha256 [0-9a-f]{64}", said), said[-3000:]
    assert model.read_bytes() == original  # fetched again, before anything read it
    assert (healthy.root / "results/runs/good/cpu/none/record.json").read_bytes() == record
    # the 2 runs, 2 forced passes, 2 captures, 2 serving jobs, the exact reference and its
    # emulations
    assert said.count("kept its outputs") == 10
    assert "Nothing to be done" in healthy.snakemake("--dry-run").stdout


def test_a_capture_pattern_that_matches_nothing_is_not_read_as_equal(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    workspace.write_config(
        config(
            models={"good": {"path": str(tiny_gguf), "requantize": ["q8_0"]}},
            devices={
                "cpu": {"backend": "cpu", "threads": 1},
                "cpu-fa": {"backend": "cpu", "threads": 1, "flash_attn": True},
            },
            capture={"tensors": "^no-such-tensor$"},
            teacher_forcing={"enabled": False},
        )
    )
    workspace.snakemake()
    text = (workspace.root / "results/summary.md").read_text()
    section = text.split("## Model `good.requant-q8_0`")[1].split("### Where the pairs part")[1]
    assert "0 tensors compared" in section and "**Nothing was compared**" in section
    assert "bit-identical: the pair does not part" not in text


def test_a_model_name_that_collides_with_a_copy_is_a_config_error(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    workspace.write_config(
        config(
            models={"m": {"path": str(tiny_gguf)}, "m.dequant-f32": {"path": str(tiny_gguf)}},
            devices={"cpu": {"backend": "cpu"}},
            dequant=["none", "f32"],
        )
    )
    proc = workspace.snakemake("--dry-run", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "AmbiguousRuleException" not in out
    assert "config.models.m.dequant-f32: names containing '.dequant-' are reserved" in out


def test_extra_buffer_types_amx_crash_is_isolated(workspace: Workspace, tiny_gguf: Path) -> None:
    """qdiff's answer to the AMX crash: extra buffer types are off by default, and a device
    that turns them on is isolated. On an AMX CPU (this project's Xeon) llama.cpp's AMX kernel
    kills the run (SIGSEGV on Gemma, SIGILL on this VM); elsewhere it runs normally."""
    info = subprocess.run(
        [
            sys.executable,
            "-c",
            "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    workspace.write_config(
        config(
            models={"tiny": {"path": str(tiny_gguf), "requantize": ["q8_0"]}},
            devices={
                "cpu": {"backend": "cpu", "threads": 1},
                "cpu-amx": {"backend": "cpu", "threads": 1, "extra_bufts": True},
            },
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
