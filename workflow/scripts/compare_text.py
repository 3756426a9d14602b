"""Every combination of one model along the text, against the exact answer, against each
other and, with a reference_model, against its reference pass, with llama-perplexity's
statistics (rule compare_text, qdiff.compare.text)."""

from pathlib import Path

from qdiff import jobs
from qdiff.compare.text import against_reference_model, compare_text
from qdiff.core.io import load_arrays, read_json, write_json

output, model, i = Path(snakemake.output[0]), snakemake.wildcards.model, snakemake.input
labels = snakemake.params.combinations


def ok_arrays(record_path: str, data_path: str) -> tuple[str, dict | None]:
    """A pass's status, and its arrays when it ran."""
    status = read_json(Path(record_path))["status"]
    return status, load_arrays(Path(data_path)) if status == "ok" else None


def body(job: jobs.Job) -> None:
    records = [read_json(Path(r)) for r in i.records]
    passes = {
        label: load_arrays(Path(data))
        for label, record, data in zip(labels, records, i.data, strict=True)
        if record["status"] == "ok"
    }
    first = next((r for r in records if r["status"] == "ok"), None)
    exact_status, exact = (None, None)
    if "exact_record" in i.keys():  # noqa: SIM118
        exact_status, exact = ok_arrays(i.exact_record, i.exact_data)
    result = compare_text(passes, exact, first["teacher"] if first else None)
    if "reference_record" in i.keys():  # noqa: SIM118
        status, reference = ok_arrays(i.reference_record, i.reference_data)
        result["reference_model"] = {
            "model": snakemake.params.reference_model,
            "status": status,
            "rows": against_reference_model(passes, reference) if reference else {},
        }
    summary = {
        "n_windows": first["n_windows"] if first else 0,
        "n_scored": first["n_scored"] if first else 0,
        "n_text_tokens": first["n_text_tokens"] if first else 0,
        "n_ctx": first["generation"]["n_ctx"] if first else None,
        "top_k": first["top_k"] if first else None,
        "teacher": first["teacher"] if first else None,
        "not_run": {
            label: r["status"]
            for label, r in zip(labels, records, strict=True)
            if r["status"] != "ok"
        },
        "exact_status": exact_status,
    }
    head = {"model": model, "status": "ok", "source": dict(snakemake.params.source)}
    write_json(job.out(output), {**head, **summary, **result})


def failed(job: jobs.Job, error: dict) -> None:
    write_json(job.out(output), {"model": model, "status": "failed", "error": error})


jobs.run(snakemake, body, failed)
