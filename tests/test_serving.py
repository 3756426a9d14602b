"""The serving stage (qdiff.core.serving, qdiff.engine.serving) on tiny real models with
real llama.cpp: cases that must be bit-identical are, a case that changes the arithmetic
is reported as different, bad case configs are named before any job, and a crash in one
case is recorded for that case while the report renders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, Workspace, bigger_llama, processes, tiny_config

pytestmark = pytest.mark.workflow


def serving_config(model: Path, **serving: object) -> dict:
    config = tiny_config(
        model,
        dequant=["none", "f32"],
        teacher_forcing={"enabled": False},
        capture={"enabled": False},
        exact={"enabled": False},
        serving={"n_tokens": 6, "long_prompt_tokens": 40, **serving},
    )
    config["models"]["tiny"].pop("requantize")
    return config


def record(ws: Workspace, device: str, dequant: str) -> dict:
    return json.loads(
        (ws.root / f"results/serving/tiny/{device}/{dequant}/record.json").read_text()
    )


def cases(rec: dict) -> dict[str, list[dict]]:
    return {c["id"]: c["prompts"] for c in rec["cases"]}


def serving_section(ws: Workspace) -> list[str]:
    """The lines of the report's serving section."""
    summary = (ws.root / "results/summary.md").read_text()
    start = summary.index("### Serving conditions")
    end = summary.find("\n#", start + 1)
    return summary[start : end if end > 0 else None].splitlines()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Workspace:
    ws = Workspace(tmp_path_factory.mktemp("served") / "ws")
    ws.write_config(serving_config(tiny_gguf))
    ws.snakemake()
    return ws


def test_every_case_runs_and_the_repeats_are_bit_identical(served: Workspace) -> None:
    rec = record(served, "cpu", "none")
    assert rec["status"] == "ok", rec.get("error")
    by_case = cases(rec)
    assert list(by_case) == [
        "repeat",
        "process",
        "batch-3",
        "batch-3-split",
        "staggered-3",
        "ubatch-1",
        "ubatch-2",
        "prefix",
        "threads-1",
    ]
    for row in by_case["repeat"] + by_case["process"]:
        assert row["status"] == "ok" and row["fork_step"] is None, row
        assert row["first_differing_step"] is None, row
    assert all(len(rows) == 2 for rows in by_case.values())  # the two needles
    for case, rows in by_case.items():  # every case ran, and compared every step it decoded
        if case not in ("process", "threads-1"):
            assert all(r["status"] == "ok" and r["n_steps"] == len(r["tokens"]) for r in rows)
            assert all(r["decode_s"] > 0 and r["compare_s"] >= 0 for r in rows), rows
    # the device runs one thread: nothing to compare the threads case with
    assert {r["status"] for r in by_case["threads-1"]} == {"n/a"}


def test_a_comparison_that_must_differ_does(served: Workspace) -> None:
    """The prompt computed one token per ubatch (n_ubatch 1) instead of in one: on the tiny
    model's f32 copy the first step's logits differ for every needle (measured), and the
    map says so: the comparison can fail."""
    by_case = cases(record(served, "cpu", "f32"))
    # the batch reaches llama.cpp: three others in one unified cache change the needle's sums
    assert any(r["first_differing_step"] is not None for r in by_case["batch-3"]), by_case
    rows = by_case["ubatch-1"]
    assert [r["first_differing_step"] for r in rows] == [0, 0], rows
    assert all(r["max_abs"] > 0 and r["status"] == "ok" for r in rows), rows
    steps = np.load(served.root / "results/serving/tiny/cpu/f32/serving.npz")["max_abs"]
    ubatch_1 = [c["id"] for c in record(served, "cpu", "f32")["cases"]].index("ubatch-1")
    assert (steps[ubatch_1, :, 0] == [r["max_abs_first_step"] for r in rows]).all()
    map_row = next(line for line in serving_section(served) if line.startswith("| `cpu.f32`"))
    assert "Δ from 0" in map_row and "= (2/2, " in map_row, map_row


def worker_of_the_serving_job() -> int | None:
    """The llama.cpp worker of the only job running a combination stage: the process that
    runs the job's script and whose parent does too (it is forked from it)."""
    stage_jobs = {pid for pid, argv in processes() if "combination_stage" in argv}
    for pid in stage_jobs:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent in stage_jobs:
            return pid
    return None


def test_a_case_killed_keeps_the_cases_before_it_and_the_threads_case_runs(
    workspace: Workspace, tmp_path: Path
) -> None:
    """SIGKILL of the worker in the threads case (a long prompt, one thread against two,
    flash attention): the record is failed and names that case, the report's map shows the
    cases done before it and the crash, and the next invocation runs the stage again whole.
    There the threads case runs: a prompt of 300 tokens, so llama.cpp's KV view is 512
    cells (the used cells padded to 256), where flash attention splits by thread."""
    model = bigger_llama(tmp_path, "q8_0")
    config = serving_config(model, long_prompt_tokens=300)
    config.update(devices={"cpu": {"backend": "cpu", "threads": 2, "flash_attn": True}})
    config["dequant"] = ["none"]
    workspace.write_config(config)
    proc = subprocess.Popen(
        workspace.command(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    progress = workspace.root / "results/serving/tiny/cpu/none"
    killed = None
    while proc.poll() is None and killed is None:
        now = [json.loads(p.read_text() or "{}") for p in progress.glob(".run-*/*/progress.json")]
        if any(p.get("current", "").startswith("case threads-1") for p in now):
            killed = worker_of_the_serving_job()
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and killed is not None, out[-3000:]
    crashed = record(workspace, "cpu", "none")
    assert crashed["status"] == "failed", crashed
    assert "SIGKILL" in crashed["error"]["message"], crashed["error"]
    assert crashed["error"]["message"].endswith(", in case threads-1"), crashed
    done = crashed["error"]["progress"]["done"]  # both needles, in every case before
    assert [len(rows) for rows in done.values()] == [2] * 8, done
    section = serving_section(workspace)
    map_row = next(line for line in section if line.startswith("| `cpu.none`"))
    assert "= (2/2, " in map_row and "crashed" in map_row, map_row
    assert any("`cpu.none` `threads-1`: " in line and "SIGKILL" in line for line in section)

    workspace.snakemake()  # the failed record carries a fresh token: run again
    threads = cases(record(workspace, "cpu", "none"))["threads-1"]
    assert [r["status"] for r in threads] == ["ok", "ok"], threads
    assert all(r["prompt_tokens"] >= 300 for r in threads), threads
    # the prefill is thread-invariant here; decoding one query row over 512 cells or more,
    # flash attention splits the KV range among the threads: the first decoded step differs
    assert [r["first_differing_step"] for r in threads] == [1, 1], threads
    assert any("use_split_kv_path" in line for line in serving_section(workspace))


def test_without_flash_attention_the_thread_count_changes_nothing(
    workspace: Workspace, tmp_path: Path
) -> None:
    """The control of the test above: the same model and long prompts, 1 thread against 2,
    without flash attention: bit-identical at every step, and the report names no split-KV
    path."""
    config = serving_config(bigger_llama(tmp_path, "q8_0"), long_prompt_tokens=300)
    config["serving"]["cases"] = ["threads"]
    config.update(devices={"cpu": {"backend": "cpu", "threads": 2}}, dequant=["none"])
    workspace.write_config(config)
    workspace.snakemake()
    threads = cases(record(workspace, "cpu", "none"))["threads-1"]
    assert [(r["status"], r["first_differing_step"]) for r in threads] == [("ok", None)] * 2
    assert all(r["n_steps"] > 1 and r["prompt_tokens"] >= 300 for r in threads), threads
    assert not any("use_split_kv_path" in line for line in serving_section(workspace))
