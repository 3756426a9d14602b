"""Render results/summary.md and the machine-readable tables (rule report)."""

from pathlib import Path

from qdiff.io import read_json
from qdiff.jobs import log_to
from qdiff.report import write_report

log_to(snakemake.log[0])
write_report(
    records=[read_json(Path(p)) for p in snakemake.input.records],
    pairs=[read_json(Path(p)) for p in snakemake.input.pairs],
    forced=[read_json(Path(p)) for p in snakemake.input.forced],
    # None when capture is off (config.capture.enabled): the report says so
    localised=[read_json(Path(p)) for p in snakemake.input.localised] or None,
    summary_path=Path(snakemake.output.summary),
    pairs_tsv=Path(snakemake.output.pairs),
    runs_tsv=Path(snakemake.output.runs),
    reference=snakemake.params.reference,
    # "model/device.dequant" -> logits file (results/runs/{model}/{device}/{dequant}/logits.npy)
    logits={
        "{}/{}.{}".format(*Path(p).parts[-4:-1]): Path(p) for p in snakemake.input.logits
    },
)
