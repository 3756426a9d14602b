"""Re-render the H200 report from its records with this checkout's report code:
python rerender.py <unpacked results root> <output folder>."""

import glob
import sys
from pathlib import Path

from qdiff.io import read_json

from qdiff.report import write_report


def load(pattern: str) -> list[dict]:
    return [read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/{pattern}"))]


root, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
write_report(
    records=load("runs/*/*/*/record.json"),
    # one file per pair (the archive's layout), or per model with its pairs (qdiff now)
    pairs=load("compare/*/*.json") + [p for f in load("compare/*.json") for p in f["pairs"]],
    forced=load("forced/*/*/*/record.json"),
    localised=load("localise/*.json"),
    exact=load("exact/*/distance.json"),
    against_reference_model=[],
    summary_path=out / "summary.md",
    pairs_tsv=out / "pairs.tsv",
    runs_tsv=out / "runs.tsv",
    plot_dir=out / "plots",
    plot_href="plots",
    writeup_claims=True,
    reference="cpu.f32",
    logits={},
    html_path=out / "summary.html",
)
