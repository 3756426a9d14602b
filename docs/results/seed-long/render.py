"""Render what came back of the H200 runs (docs/results/seed-long/README.md) with this
checkout's report code:

    python docs/results/seed-long/render.py <unpacked h200-results.tgz> \
        <unpacked h200-generations.txz> <folder>

The second run (config.yaml) brought back the text's records and statistics; the third
(generations.yaml, the text off) every other stage's records, each model's pairs and its
distances from exact. The logits stayed on the machine, so the plots that read them (the
first steps' logits) do not render."""

import glob
import sys
from pathlib import Path

from qdiff.core.io import read_json
from qdiff.core.stages import STAGES
from qdiff.report import ReportFiles, Results, write_report

text_root, rest_root, out = (Path(a) for a in sys.argv[1:4])
out.mkdir(parents=True, exist_ok=True)


def read_all(root: Path, pattern: str, but: str | None = None) -> list[dict]:
    """The JSON files under ``root`` that match ``pattern``, less those ending in ``but``."""
    paths = sorted(p for p in glob.glob(str(root / pattern)) if not (but and p.endswith(but)))
    return [read_json(Path(p)) for p in paths]


records = {
    s.name: read_all(text_root if s.name == "text" else rest_root, f"{s.folder}/*/*/*/record.json")
    for s in STAGES.values()
}
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
    pairs=[
        p
        for f in read_all(rest_root, "results/compare/*.json", but=".text.json")
        for p in f["pairs"]
    ],
    exact=read_all(rest_root, "results/exact/*/distance.json") or None,
    text=read_all(text_root, "results/compare/*.text.json"),
)
write_report(results, files, reference="cpu.f32")
