"""Render results/summary.md, its page and the machine-readable tables (rule report)."""

from pathlib import Path

from qdiff import jobs
from qdiff.core.io import read_json
from qdiff.core.labels import Combination
from qdiff.core.stages import RUN, STAGES
from qdiff.report import ReportFiles, Results, failed_report, write_report

i, out = snakemake.input, snakemake.output


def read_all(paths: list[str]) -> list[dict]:
    return [read_json(Path(p)) for p in paths]


def results() -> Results:
    """Every enabled stage's records (their inputs are named <stage>_records), and the
    per-model results; a part that is off has no files, and the report says so."""
    records = {s.name: read_all(i[f"{s.name}_records"]) for s in STAGES.values()}
    return Results(
        records={name: rows for name, rows in records.items() if rows},
        pairs=[pair for f in i.pairs for pair in read_json(Path(f))["pairs"]],
        localised=read_all(i.localised) or None,  # None: capture is off
        exact=read_all(i.exact) or None,  # None: the exact reference is off
        against_reference_model=read_all(i.reference_model),
        text=read_all(i.text),
        # none with first_step_logits: top_k: the report says what it cannot draw
        logits={
            Combination.from_record(r): Path(p)
            for r, p in zip(records[RUN.name], i.logits, strict=True)
        }
        if i.logits
        else {},
    )


def body(job: jobs.Job) -> None:
    files = ReportFiles(
        summary=job.out(out.summary),
        html=job.out(out.html),
        pairs_tsv=job.out(out.pairs),
        runs_tsv=job.out(out.runs),
        plot_dir=job.out(out.plots),
        plot_href=Path(out.plots).name,
    )
    write_report(
        results(),
        files,
        reference=snakemake.params.reference,
        writeup_claims=snakemake.params.writeup_claims,
        workers=snakemake.threads,
    )


def failed(job: jobs.Job, error: dict) -> None:
    failed_report(job.out(out.summary), error, job.out(out.html))


jobs.run(snakemake, body, failed, directories=(out.plots,))
