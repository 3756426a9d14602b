"""benchmarks/bench.py end to end on a tiny experiment: every figure is measured and printed
against its target (the figures themselves are the benchmark's to judge, not a test's)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO, tiny_config, tiny_text

FIGURE = re.compile(r"^  (.+?)\s+(\d+\.\d+) .* target ([<>]=) ", re.M)  # a measured line


def run_bench(*args: str) -> str:
    """benchmarks/bench.py's output, run with ``args``; it must succeed."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_benchmark_measures_every_figure(tmp_path: Path, tiny_gguf: Path) -> None:
    config = tmp_path / "experiment.yaml"
    experiment = tiny_config(
        tiny_gguf,
        serving={"n_tokens": 4, "cases": ["repeat", "batch"]},
        # the text the benchmark's experiment folder scores, written where it runs
        text=tiny_text(tmp_path / "bench/experiment"),
    )
    config.write_text(yaml.safe_dump(experiment, sort_keys=False))
    common = ["--config", str(config), "--workdir", str(tmp_path / "bench"), "--cores", "2"]
    out = run_bench(
        *common,
        *("--repeat", "1", "--matrix", "2x2x1x2", "--compare-runs", "3"),
        *("--compare-prompts", "2"),
    )
    figures = FIGURE.findall(out)
    names = [name.strip() for name, _, _ in figures]
    assert names == [
        "serving stage / its decoding",  # over the serving records of 8 jobs
        "text stage / bare scoring, cpu",  # one line per backend
        "exact text / f32 text",
        "pipeline / inference floor",
        "no-op rerun",
        "compare throughput",  # synthetic logits of Gemma's vocabulary
        "compare throughput",  # the experiment's own runs
        "planning, first time",
        "planning",
    ], out
    # how fast this machine is is the benchmark's to judge: a figure need only be a number
    assert all(math.isfinite(float(value)) for _, value, _ in figures), out
    assert re.search(r"serving stage / its decoding .*\[8 jobs: ", out), out  # every serving job
    # 8 combinations x windows 2 and 3 of the text's 3; the runs-only pipeline scores no text
    assert re.search(r"text stage / bare scoring, cpu .*one process, 16 windows", out), out
    assert re.search(r"whole passes \d+\.\d+ / \d+\.\d+\)", out), out
    assert "runs only (run_combination 8, compare_model 2, report 1)" in out
    # the ratio's two factors, from the records the pipeline's own 8 runs wrote
    split = re.search(r"own records \(8 ok run records\): (\d+\.\d+) s .* / its records", out)
    assert split, out
    assert "planning 2x2x1x2: " in out and "Snakemake's own no-op" in out
    # --only text: the experiment (complete, so nothing runs) and the text stage's lines alone
    out = run_bench(*common, "--only", "text")
    assert [name.strip() for name, _, _ in FIGURE.findall(out)] == [
        "text stage / bare scoring, cpu",
        "exact text / f32 text",
    ], out
    assert "  experiment: 0 jobs in " in out, out


def _bench_module():
    """benchmarks/bench.py as a module, for its pure functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench", REPO / "benchmarks/bench.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_perplexity_runs_with_the_devices_settings_and_is_timed_by_its_log() -> None:
    """The options a device's settings give llama-perplexity, and the seconds between the
    log lines that bracket its scoring (lines of a real run of the vendored tool)."""
    from qdiff.core.settings import DeviceSettings

    bench = _bench_module()
    cpu = DeviceSettings(backend="cpu", threads=2)
    assert bench.perplexity_arguments(cpu, 512, "none") == [
        *("-c", "512", "-b", "512", "-ub", "512", "-t", "2", "-tb", "2", "-fa", "off"),
        *("-ctk", "f16", "-ctv", "f16", "-ngl", "0", "-sm", "none", "-dev", "none"),
        *("--no-repack", "--no-op-offload"),
    ]
    cuda = DeviceSettings(backend="cuda", n_batch=2048, flash_attn=True, extra_bufts=True)
    args = bench.perplexity_arguments(cuda, 512, "CUDA0")
    assert args[:6] == ["-c", "512", "-b", "512", "-ub", "512"]  # one window a sequence
    assert args[args.index("-fa") + 1] == "on" and args[args.index("-ngl") + 1] == "999"
    assert args[-2:] == ["CUDA0", "--no-op-offload"]  # repacking on, op offload off
    log = (
        "0.00.625.044 I perplexity: calculating perplexity over 2 chunks, n_ctx=512\n"
        "0.02.075.783 I perplexity: 1.45 seconds per pass - ETA 0.03 minutes\n"
        "[1]27.1,[2]27.9,\n"
        "1.03.593.080 I Final estimate: PPL = 27.9364 +/- 4.21390\n"
    )
    assert math.isclose(bench.scoring_seconds(log), 62.968036)
    assert bench.scoring_seconds(log.partition("[1]")[0]) is None  # it stopped before


def test_a_window_is_timed_without_the_one_off_costs_of_a_pass() -> None:
    """The fastest of each run's timings, the runs in turn, and a window's seconds over
    windows 2 .. n: a pass over n windows less one over the first alone."""
    bench = _bench_module()
    timings = {"one": iter([0.5, 0.3, 0.4]), "four": iter([2.0, 2.4, 1.8])}
    order: list[str] = []

    def timing(name: str) -> float:
        order.append(name)
        return next(timings[name])

    fastest = bench.fastest_of({name: lambda name=name: timing(name) for name in timings})
    assert fastest == {"one": 0.3, "four": 1.8}
    assert order == ["one", "four"] * bench.TEXT_REPEATS  # in turn, not one after the other
    # a pass of 4 windows at 1.8 s whose first alone takes 0.3 s: 0.5 s a window after it
    assert math.isclose(bench.window_seconds(fastest["one"], fastest["four"], 4), 0.5)
