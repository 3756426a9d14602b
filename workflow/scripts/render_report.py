"""Render results/summary.md and the machine-readable tables (rule report)."""

from pathlib import Path

from qdiff import jobs
from qdiff.core.io import read_json
from qdiff.core.labels import Combination
from qdiff.report import failed_report, write_report

out = snakemake.output


def body(job: jobs.Job) -> None:
    records = [read_json(Path(p)) for p in snakemake.input.records]
    write_report(
        records=records,
        pairs=[pair for f in snakemake.input.pairs for pair in read_json(Path(f))["pairs"]],
        forced=[read_json(Path(p)) for p in snakemake.input.forced],
        # None when capture is off (config.capture.enabled): the report says so
        localised=[read_json(Path(p)) for p in snakemake.input.localised] or None,
        # None when the exact reference is off (config.exact.enabled)
        exact=[read_json(Path(p)) for p in snakemake.input.exact] or None,
        against_reference_model=[read_json(Path(p)) for p in snakemake.input.reference_model],
        summary_path=job.out(out.summary),
        pairs_tsv=job.out(out.pairs),
        runs_tsv=job.out(out.runs),
        html_path=job.out(out.html),
        plot_dir=job.out(out.plots),
        plot_href=Path(out.plots).name,
        writeup_claims=snakemake.params.writeup_claims,
        workers=snakemake.threads,
        reference=snakemake.params.reference,
        # none with first_step_logits: top_k: the report says what it cannot draw
        logits={
            Combination.from_record(r): Path(p)
            for r, p in zip(records, snakemake.input.logits, strict=True)
        }
        if snakemake.input.logits
        else {},
    )


def failed(job: jobs.Job, error: dict) -> None:
    failed_report(job.out(out.summary), error, job.out(out.html))


jobs.run(snakemake, body, failed, directories=(out.plots,))
