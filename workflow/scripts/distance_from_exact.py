"""How far each combination of one model is from the exact answer (rule distance_from_exact)."""

from pathlib import Path

from qdiff import jobs
from qdiff.compare.budget import combination_budget
from qdiff.compare.distance import closest, distance
from qdiff.compare.forced import with_probabilities
from qdiff.core import records
from qdiff.core.io import load_array, load_arrays, read_json, write_json

i, output, model = snakemake.input, Path(snakemake.output[0]), snakemake.wildcards.model


def body(job: jobs.Job) -> None:
    exact = read_json(Path(i.exact_record))
    if exact["status"] != "ok":
        write_json(
            job.out(output),
            {
                "model": model,
                "status": exact["status"],
                "reason": records.failure_text(exact),
                "rows": [],
            },
        )
        return
    arrays = with_probabilities(load_arrays(Path(i.exact_data)))  # once for every row
    names = i.keys()  # a Namedlist: `in` looks at its values
    forced = "forced_records" in names
    roundings = (
        (read_json(Path(i.roundings_record)), load_arrays(Path(i.roundings_data)))
        if "roundings_record" in names
        else None
    )
    rows = []
    # no logits with first_step_logits: top_k: first steps come from the forced passes
    logits_files = i.logits or [None] * len(i.records)
    for k, (rec, logits) in enumerate(zip(i.records, logits_files, strict=True)):
        record = read_json(Path(rec))
        pass_ = None
        if forced:
            forced_record = read_json(Path(i.forced_records[k]))
            ok = forced_record["status"] == "ok"
            pass_ = (forced_record, load_arrays(Path(i.forced_data[k])) if ok else {})
        run_logits = load_array(Path(logits)) if logits and record["status"] == "ok" else None
        row = distance(arrays, exact["prompt_ids"], record, run_logits, pass_)
        if roundings is not None and row["status"] == "ok" and run_logits is not None:
            serving = read_json(Path(i.serving_records[k])) if "serving_records" in names else None
            first = arrays["first_logits"]
            row["budget"] = combination_budget(record, run_logits, serving, roundings, first)
        rows.append(row)
    write_json(
        job.out(output),
        {"model": model, "status": "ok", "exact": exact, "closest": closest(rows), "rows": rows},
    )


def failed(job: jobs.Job, error: records.ErrorInfo) -> None:
    write_json(
        job.out(output),
        {"model": model, "status": "failed", "reason": error["message"], "rows": []},
    )


jobs.run(snakemake, body, failed)
