"""The exact answer of one model's weights, in float64, along the teacher's text
(rule exact_reference)."""

from pathlib import Path

from qdiff import jobs, records
from qdiff.exact import UnsupportedArchitectureError, reference
from qdiff.io import load_arrays, read_json, save_arrays, write_json
from qdiff.labels import Combination
from qdiff.provenance import machine

i, out, model = snakemake.input, snakemake.output, snakemake.wildcards.model
head = {"qdiff_record": records.RECORD_FORMAT, "stage": "exact", "model": model}


def body(job: jobs.Job) -> None:
    info, run = read_json(Path(i.info)), read_json(Path(i.teacher_run))
    forced = read_json(Path(i.teacher_record)) if "teacher_record" in i.keys() else None  # noqa: SIM118
    not_ok = [r for r in (info, run, forced) if r is not None and r.get("status", "ok") != "ok"]
    if not_ok:
        raise jobs.StageError(f"no exact reference: {records.failure_text(not_ok[0])}")
    slices = load_arrays(Path(i.teacher_data))["slice_ids"] if forced is not None else None
    try:
        record, arrays = reference(Path(i.model), run, slices, snakemake.params.top_k)
    except UnsupportedArchitectureError as exc:
        write_json(
            job.out(out.record),
            {
                **head,
                "status": "unsupported",
                "reason": str(exc),
                "run_token": snakemake.params.retry_token,
            },
        )
        return
    save_arrays(job.out(out.data), arrays)
    write_json(
        job.out(out.record),
        {
            **head,
            "status": "ok",
            "teacher": Combination.from_record(run).label,
            **record,
            "model_file": info,
            "provenance": machine(),
            "run_token": snakemake.params.retry_token,
        },
    )


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    write_json(
        job.out(out.record),
        {**head, "status": "failed", "error": error, "run_token": records.fresh_token()},
    )


jobs.run(snakemake, body, failed)
