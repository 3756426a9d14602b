"""Measure bench.py's three closest figures again on a finished benchmark's scratch directory.

    .venv/bin/python docs/results/bench-xeon/remeasure.py /tmp/bench1

It reuses the directory's experiment and its runs-only copy (``bench.py --workdir DIR`` made
both) and calls bench.py's own functions: ``--repeat`` alternations of the runs-only
pipeline and the inference floor, the comparison of the experiment's largest-vocabulary model
in fresh processes (as many as bench.py takes), and the planning of the 10 x 10 x 3 x 30
matrix. remeasure-fd29a0f.log is the output of its first version (3 comparison processes,
its own copy of the alternation loop), right after bench-fd29a0f.log.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench  # benchmarks/ is not a package: found through the path above

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("workdir", type=Path, help="a finished `bench.py --workdir` directory")
parser.add_argument("--repeat", type=int, default=3, help="alternations (default 3)")
args = parser.parse_args()
bench.pipeline_against_floor(args.workdir / "runs-only", bench.CORES, args.repeat)
found = bench.experiment_runs(args.workdir / "experiment")
assert found, f"no experiment ran in {args.workdir}"
model, files = found
bench.compare_line(f"{model} again", files, model)
planned = args.workdir / "remeasure"
shutil.rmtree(planned, ignore_errors=True)
planned.mkdir()
bench.planning(argparse.Namespace(matrix=bench.MATRIX, cores=bench.CORES), planned)
