"""Re-render the H200 report from its records with this checkout's report code."""
import glob, sys
from pathlib import Path
from qdiff.io import read_json
from qdiff.report import write_report
root = Path(sys.argv[1]); out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
records = [read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/runs/*/*/*/record.json"))]
write_report(
    records=records,
    pairs=[read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/compare/*/*.json"))],
    forced=[read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/forced/*/*/*/record.json"))],
    localised=[read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/localise/*.json"))],
    exact=[read_json(Path(p)) for p in sorted(glob.glob(f"{root}/results/exact/*/distance.json"))],
    against_reference_model=[],
    summary_path=out / "summary.md", pairs_tsv=out / "pairs.tsv", runs_tsv=out / "runs.tsv",
    plot_dir=out / "plots", plot_href="plots", writeup_claims=True, reference="cpu.f32", logits={},
)
