"""Render this folder's report from the H200's records with this checkout's report code:
python rerender.py <unpacked serving-results.tgz> <output folder>. The records are the
machine's; only the report's wording and tables are this checkout's."""

import glob
import sys
from pathlib import Path

from qdiff.core.io import read_json
from qdiff.report import ReportFiles, Results, write_report


def load(pattern: str) -> list[dict]:
    return [read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/{pattern}"))]


root, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
write_report(
    Results(
        records={
            "run": load("runs/*/*/*/record.json"),
            "serving": load("serving/*/*/*/record.json"),
        },
        pairs=[pair for f in load("compare/*.json") for pair in f["pairs"]],
        localised=None,  # capture was off
        exact=None,  # the exact reference was off
        against_reference_model=[],
        logits={},  # the logits did not come back: no plots
    ),
    ReportFiles(
        summary=out / "summary.md",
        html=out / "summary.html",
        pairs_tsv=out / "pairs.tsv",
        runs_tsv=out / "runs.tsv",
        plot_dir=out / "plots",
        plot_href="plots",
    ),
    reference="cpu.f32",
)
