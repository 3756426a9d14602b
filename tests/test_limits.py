"""Limits met for real: a full disk (a small tmpfs), a download with no end, the exact stage
killed (SIGKILL, as the kernel's out-of-memory killer ends it), run layer by layer within a
real cgroup memory limit and refused below it, a prompt longer than the context. Each fails its own job with a message
that says what to do, and the report still renders.

The disk and memory limits need root (mount, cgroups), as CI has; without it these tests
fail and say so, never skip."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import REPO, Workspace, bigger_llama, processes, tiny_config
from modelserver import serving

pytestmark = pytest.mark.workflow
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


def needs_root(what: str) -> None:
    assert os.geteuid() == 0, f"{what} needs root (as CI runs): run the tests as root"


@contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``folder``: a disk that really fills up."""
    needs_root("mounting a small tmpfs")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def record(ws: Workspace, path: str) -> dict:
    return json.loads((ws.root / path).read_text())


def test_an_endless_download_and_a_full_disk_fail_their_own_jobs(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    """A server that sends a GGUF header and then zeros for ever, with no Content-Length, is
    cut at download.max_gib; an f32 copy that does not fit on the disk fails as a full disk,
    not as a bad source. Neither leaves a partial file; both leave a failure sidecar."""
    config = tiny_config(tiny_gguf, dequant=["none", "f32"], download={"max_gib": 0.001})
    with serving(tiny_gguf.read_bytes()) as server:
        config["models"] = {
            "local": {"path": str(tiny_gguf)},  # 1.7 MB, and as much again for its f32 copy
            "endless": {"url": f"{server.base}/forever.gguf", "sha256": "0" * 64},
        }
        workspace.write_config(config)
        with small_disk(workspace.root / "resources", "3m") as disk:
            workspace.snakemake()
            leftovers = [p.name for p in (disk / "models").iterdir() if "part" in p.name]
            endless = record(workspace, "resources/models/endless.gguf.json")
            copy = record(workspace, "resources/models/local.dequant-f32.gguf.json")
    assert leftovers == []
    assert endless["status"] == "failed" and re.search(
        r"forever\.gguf is longer than download\.max_gib \(0\.001 GiB: \d+ bytes received\)",
        endless["error"]["message"],
    ), endless["error"]["message"]
    assert copy["status"] == "failed", copy
    assert "no space left on the disk that holds resources/models" in copy["error"]["message"]
    assert "Is the source a complete GGUF file" not in copy["error"]["message"]
    summary = (workspace.root / "results/summary.md").read_text()
    assert "no space left on the disk that holds resources/models" in summary
    assert record(workspace, "results/runs/local/cpu/none/record.json")["status"] == "ok"


def test_a_download_that_fills_the_disk_fails_as_a_full_disk(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    """A download with no end under a large download.max_gib, onto a 2 MiB disk: it stops
    at the full disk and says so, as final (no retry), leaves no partial file, and the
    report renders."""
    config = tiny_config(tiny_gguf, dequant=["none"], download={"max_gib": 100})
    with serving(tiny_gguf.read_bytes()) as server:
        config["models"] = {"endless": {"url": f"{server.base}/forever.gguf", "sha256": "0" * 64}}
        workspace.write_config(config)
        with small_disk(workspace.root / "resources", "2m") as disk:
            proc = workspace.snakemake()
            leftovers = [p.name for p in (disk / "models").iterdir() if "part" in p.name]
            endless = record(workspace, "resources/models/endless.gguf.json")
    assert leftovers == []
    message = endless["error"]["message"]
    assert endless["status"] == "failed" and message.startswith(
        "no space left on the disk that holds resources/models"
    ), message
    assert "retrying in" not in proc.stdout + proc.stderr  # a full disk is not worth a retry
    assert "no space left on the disk" in (workspace.root / "results/summary.md").read_text()


def exact_only(model: Path, **extra: object) -> dict:
    config = tiny_config(
        model,
        devices={"cpu": {"backend": "cpu", "threads": 1}},
        dequant=["none"],
        teacher_forcing={"enabled": False},
        capture={"enabled": False},
        **extra,
    )
    config["models"]["tiny"].pop("requantize")
    return config


def _run_killing_the_engine(workspace: Workspace, job_folder: str) -> None:
    """The workflow, with the float64 engine's child killed by SIGKILL as soon as it runs
    in ``job_folder`` (".exact-": the exact reference; ".roundings-": the emulations)."""
    proc = subprocess.Popen(
        workspace.command(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed = None
    while proc.poll() is None and killed is None:
        killed = next(
            (
                pid
                for pid, argv in processes()
                if "-m\0qdiff.exact.reference\0" in argv and f"/{job_folder}" in argv
            ),
            None,
        )
        if killed is not None:
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and killed is not None, out[-3000:]


KILLED = (
    r"the float64 engine was killed by SIGKILL \(most often the kernel's out-of-memory "
    r"killer\); it was estimated to need 0\.\d\d GiB"
)


def test_an_exact_stage_killed_is_recorded_and_retried(
    workspace: Workspace, tmp_path: Path
) -> None:
    """The float64 engine's process killed by SIGKILL while it runs, as the kernel's
    out-of-memory killer ends a process: its supervisor records the signal and the memory
    it was estimated to need, the report renders, and the next invocation retries it."""
    workspace.write_config(exact_only(bigger_llama(tmp_path, "q8_0")))
    _run_killing_the_engine(workspace, ".exact-")
    exact = record(workspace, "results/exact/tiny/record.json")
    assert exact["status"] == "failed", exact
    assert re.search(KILLED, exact["error"]["message"]), exact["error"]["message"]
    summary = (workspace.root / "results/summary.md").read_text()
    assert "No exact reference: the float64 engine was killed by SIGKILL" in summary
    # and it is a row of the report's failure table, like any stage's failure
    assert any(
        "`exact reference`" in line and "killed by SIGKILL" in line
        for line in summary.splitlines()
        if line.startswith("| `tiny`")
    ), summary
    workspace.snakemake()  # retried: the failed record carries a fresh token
    assert record(workspace, "results/exact/tiny/record.json")["status"] == "ok"


def test_the_emulations_killed_cost_only_the_error_budget(
    workspace: Workspace, tmp_path: Path
) -> None:
    """The same for the error budget's emulations: recorded, the exact distances still
    there, the budget a row of the failure table, retried next time."""
    workspace.write_config(exact_only(bigger_llama(tmp_path, "q8_0")))
    _run_killing_the_engine(workspace, ".roundings-")
    emulated = record(workspace, "results/exact/tiny/roundings.json")
    assert emulated["status"] == "failed" and re.search(KILLED, emulated["error"]["message"])
    (row,) = record(workspace, "results/exact/tiny/distance.json")["rows"]
    assert row["status"] == "ok" and row["budget"]["status"] == "failed", row
    summary = (workspace.root / "results/summary.md").read_text()
    assert any(
        "| `cpu.none` | error budget | failed" in line and "killed by SIGKILL" in line
        for line in summary.splitlines()
        if line.startswith("| `tiny`")
    ), summary
    workspace.snakemake()
    assert record(workspace, "results/exact/tiny/roundings.json")["status"] == "ok"


def test_an_exact_stage_beyond_the_cgroups_memory_runs_layer_by_layer_within_it(
    workspace: Workspace, tmp_path: Path
) -> None:
    """The workflow in a real cgroup with a 900 MB memory limit: the float64 engine's
    estimate for a 68 M-parameter model with every weight kept (about 0.87 GiB) is more
    than the cgroup leaves beside Snakemake, so the emulations, which keep every weight
    where they can, hold one layer's weights at a time (about 0.49 GiB) as the reference
    always does; both say so in their logs before they start and stay within the limit
    instead of being killed."""
    needs_root("a cgroup with a memory limit")
    assert CGROUP_MEMORY.is_dir(), "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    workspace.write_config(exact_only(bigger_llama(tmp_path, "q8_0")))
    group = CGROUP_MEMORY / f"qdiff-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(900 * 2**20))
        proc = subprocess.run(
            [*workspace.command(), "--cores", "1"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
    finally:
        group.rmdir()
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, log_name in (("record", "tiny"), ("roundings", "tiny.roundings")):
        exact = record(workspace, f"results/exact/tiny/{name}.json")
        assert exact["status"] == "ok" and exact["layer_by_layer"], exact
        assert exact["peak_rss_mib"] <= exact["memory_estimate_mib"] < 900, exact
        log = (workspace.root / f"results/logs/exact/{log_name}.log").read_text()
        assert re.search(r"needs about 0\.\d\d GiB \(one layer's weights at a time\)", log)


def test_an_exact_stage_beyond_its_memory_limit_is_refused_before_it_starts(
    workspace: Workspace, tmp_path: Path
) -> None:
    """Below even the layer-by-layer estimate (exact.max_memory_gib 0.3 for that model),
    the stage is refused with a message that names both estimates and the limit, instead
    of being killed; the run and the report are there."""
    config = exact_only(bigger_llama(tmp_path, "q8_0"))
    config["exact"] = {**config.get("exact", {}), "max_memory_gib": 0.3}
    workspace.write_config(config)
    workspace.snakemake()
    exact = record(workspace, "results/exact/tiny/record.json")
    assert exact["status"] == "failed", exact
    message = exact["error"]["message"]
    assert re.search(
        r"the float64 engine needs about 0\.\d\d GiB for tiny\.gguf layer by layer \(0\.\d\d "
        r"GiB with every weight kept\), and exact\.max_memory_gib allows 0\.30 GiB: free "
        r"memory, set exact\.max_memory_gib",
        message,
    ), message
    assert record(workspace, "results/runs/tiny/cpu/none/record.json")["status"] == "ok"
    assert (
        "No exact reference: the float64 engine needs about"
        in (workspace.root / "results/summary.md").read_text()
    )


def test_a_prompt_longer_than_the_context_is_named_and_the_others_run(
    workspace: Workspace, tiny_gguf: Path
) -> None:
    """A prompt that does not fit generation.n_ctx is left out of the runs, which keep the
    others, and named in the report; a capture of that prompt alone fails, naming it."""
    long_text = " ".join(["the mountain is a river"] * 40)
    config = tiny_config(
        tiny_gguf,
        dequant=["none"],
        prompts=[{"id": "short", "text": "What is Rust?"}, {"id": "long", "text": long_text}],
        generation={"n_tokens": 8, "n_ctx": 64},
        capture={"prompts": ["long"]},
    )
    config["models"]["tiny"].pop("requantize")
    workspace.write_config(config)
    workspace.snakemake()
    run = record(workspace, "results/runs/tiny/cpu/none/record.json")
    assert run["status"] == "ok" and [p["id"] for p in run["prompts"]] == ["short"]
    (skipped,) = run["skipped_prompts"]
    assert skipped["id"] == "long" and re.fullmatch(
        r"prompt 'long' has \d+ tokens: with 8 more it needs generation.n_ctx of at least "
        r"\d+, and n_ctx is 64; raise n_ctx or shorten the prompt",
        skipped["reason"],
    )
    capture = record(workspace, "results/capture/tiny/cpu/none/record.json")
    assert capture["status"] == "failed" and "prompt 'long' has" in capture["error"]["message"]
    forced = record(workspace, "results/forced/tiny/cpu-fa/none/record.json")
    assert forced["status"] == "ok" and forced["prompt_ids"] == ["short"]
    summary = (workspace.root / "results/summary.md").read_text()
    assert re.search(
        r"\| `tiny` +\| `prompt long` +\| run +\| left out +\| prompt 'long' has", summary
    )
