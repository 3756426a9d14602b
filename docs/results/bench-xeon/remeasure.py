"""Measure bench.py's three closest figures again on a finished benchmark's scratch directory.

    .venv/bin/python docs/results/bench-xeon/remeasure.py /tmp/bench1

It reuses the directory's experiment and its runs-only copy (``bench.py --workdir DIR`` made
both) and calls bench.py's own functions: 3 alternations of the runs-only pipeline and the
inference floor, the comparison of the experiment's largest-vocabulary model in 3 fresh
processes, and the planning of the 10 x 10 x 3 x 30 matrix. remeasure-fd29a0f.log is its
output, right after bench-fd29a0f.log.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench  # benchmarks/ is not a package: found through the path above

workdir = Path(sys.argv[1])
runs = workdir / "runs-only"
pipelines, floors = [], []
for _ in range(3):
    shutil.rmtree(runs / "results", ignore_errors=True)
    seconds, _ = bench.snakemake(runs, 4)
    pipelines.append(seconds)
    floors.append(bench.floor_seconds(runs))
    print(f"pipeline {seconds:.1f} floor {floors[-1]:.1f} ratio {seconds / floors[-1]:.3f}")
print("median ratio", median(p / f for p, f in zip(pipelines, floors, strict=True)))
found = bench.experiment_runs(workdir / "experiment")
assert found, f"no experiment ran in {workdir}"
model, files = found
bench.compare_line(f"{model} again", files, model)
planned = workdir / "remeasure"
shutil.rmtree(planned, ignore_errors=True)
planned.mkdir()
bench.planning(argparse.Namespace(matrix=(10, 10, 3, 30), cores=4), planned)
