"""Re-render the H200 report from its records with this checkout's report code:
python docs/results/seed/rerender.py <unpacked results root> <output folder>.

The archive holds records only (no logits): the per-token histogram is not drawn, and its
distances from exact predate per-prompt values and the error budget, so the report says
less of them than a fresh run would (no ranking over prompts, no budget)."""

import glob
import sys
from pathlib import Path

from qdiff.core.io import read_json
from qdiff.report import ReportFiles, Results, write_report


def load(pattern: str) -> list[dict]:
    return [read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/{pattern}"))]


root, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
results = Results(
    records={"run": load("runs/*/*/*/record.json"), "forced": load("forced/*/*/*/record.json")},
    # one file per pair (the archive's layout), or per model with its pairs (qdiff now)
    pairs=load("compare/*/*.json") + [p for f in load("compare/*.json") for p in f["pairs"]],
    localised=load("localise/*.json"),
    exact=load("exact/*/distance.json"),
    against_reference_model=[],
    logits={},
)
files = ReportFiles(
    summary=out / "summary.md",
    html=out / "summary.html",
    pairs_tsv=out / "pairs.tsv",
    runs_tsv=out / "runs.tsv",
    plot_dir=out / "plots",
    plot_href="plots",
)
write_report(results, files, reference="cpu.f32", writeup_claims=True)
