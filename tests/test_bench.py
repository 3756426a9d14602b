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


def test_the_benchmark_measures_every_figure(tmp_path: Path, tiny_gguf: Path) -> None:
    config = tmp_path / "experiment.yaml"
    experiment = tiny_config(
        tiny_gguf,
        serving={"n_tokens": 4, "cases": ["repeat", "batch"]},
        # the text the benchmark's experiment folder scores, written where it runs
        text=tiny_text(tmp_path / "bench/experiment"),
    )
    config.write_text(yaml.safe_dump(experiment, sort_keys=False))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/bench.py"),
            "--config",
            str(config),
            "--workdir",
            str(tmp_path / "bench"),
            "--cores",
            "2",
            "--repeat",
            "1",
            "--matrix",
            "2x2x1x2",
            "--compare-runs",
            "3",
            "--compare-prompts",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    figures = re.findall(r"^  (.+?)\s+(\d+\.\d+) .* target ([<>]=) ", out, re.M)
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
    # 8 combinations x the text's 3 windows; the runs-only pipeline scores no text
    assert re.search(r"text stage / bare scoring, cpu .*one process, 24 windows", out), out
    assert "runs only (run_combination 8, compare_model 2, report 1)" in out
    # the ratio's two factors, from the records the pipeline's own 8 runs wrote
    split = re.search(r"own records \(8 ok run records\): (\d+\.\d+) s .* / its records", out)
    assert split, out
    assert "planning 2x2x1x2: " in out and "Snakemake's own no-op" in out
