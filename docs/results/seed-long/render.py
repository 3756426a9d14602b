"""Render what came back of the H200 run (docs/results/seed-long/README.md) with this
checkout's report code: python docs/results/seed-long/render.py <unpacked h200-records.tgz> <folder>.
Only the runs' records came back whole, so only the free-running generations render."""

import glob
import sys
from pathlib import Path

from qdiff.core.io import read_json
from qdiff.report import ReportFiles, Results, write_report

root, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
runs = [read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/runs/*/*/*/record.json"))]
files = ReportFiles(
    summary=out / "summary.md",
    html=out / "summary.html",
    pairs_tsv=out / "pairs.tsv",
    runs_tsv=out / "runs.tsv",
    plot_dir=out / "plots",
    plot_href="plots",
)
write_report(Results(records={"run": runs}, pairs=[]), files, reference="cpu.f32")
