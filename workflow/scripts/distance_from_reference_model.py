"""Every combination of one model against the reference model's reference run and exact
answer (rule distance_from_reference_model)."""

from pathlib import Path

from qdiff import jobs
from qdiff.compare.distance import against_reference_model
from qdiff.core import records
from qdiff.core.io import load_array, load_arrays, read_json, write_json
from qdiff.core.labels import Combination

i, output, model = snakemake.input, Path(snakemake.output[0]), snakemake.wildcards.model
head = {"model": model, "reference_model": snakemake.params.reference}


def body(job: jobs.Job) -> None:
    reference = read_json(Path(i.reference_record))
    ref_logits = load_array(Path(i.reference_logits)) if reference["status"] == "ok" else None
    exact = None
    if "exact_record" in i.keys() and read_json(Path(i.exact_record))["status"] == "ok":  # noqa: SIM118
        exact = load_arrays(Path(i.exact_data))["first_logits"]
    rows = []
    for rec, logits in zip(i.records, i.logits, strict=True):
        record = read_json(Path(rec))
        run = load_array(Path(logits)) if record["status"] == "ok" else None
        rows.append(against_reference_model(reference, ref_logits, exact, record, run))
    write_json(
        job.out(output),
        {
            **head,
            "status": "ok",
            "reference": Combination.from_record(reference).label,
            "has_exact": exact is not None,
            "rows": rows,
        },
    )


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    write_json(
        job.out(output), {**head, "status": "failed", "reason": error["message"], "rows": []}
    )


jobs.run(snakemake, body, failed)
