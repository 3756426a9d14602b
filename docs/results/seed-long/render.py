"""Render what came back of the H200 run (docs/results/seed-long/README.md) with this
checkout's report code: python docs/results/seed-long/render.py <unpacked h200-results.tgz> <folder>.
The records and the text's statistics came back; the logits stayed on the machine, so no
pair of first steps or teacher-forced passes, and no distance from exact, renders."""

import glob
import sys
from pathlib import Path

from qdiff.core.io import read_json
from qdiff.core.stages import STAGES
from qdiff.report import ReportFiles, Results, write_report

root, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)


def read_all(pattern: str) -> list[dict]:
    return [read_json(Path(p)) for p in sorted(glob.glob(str(root / pattern)))]


records = {s.name: read_all(f"{s.folder}/*/*/*/record.json") for s in STAGES.values()}
files = ReportFiles(
    summary=out / "summary.md",
    html=out / "summary.html",
    pairs_tsv=out / "pairs.tsv",
    runs_tsv=out / "runs.tsv",
    plot_dir=out / "plots",
    plot_href="plots",
)
results = Results(
    records={name: rows for name, rows in records.items() if rows},
    pairs=[],
    text=read_all("results/compare/*.text.json"),
)
write_report(results, files, reference="cpu.f32")
