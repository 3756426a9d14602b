"""Compare two combinations of one model (rule compare_pair)."""

from pathlib import Path

from qdiff import jobs
from qdiff.compare import compare_files, failed_pair
from qdiff.io import write_json
from qdiff.labels import Combination, Pair

output, w, i = Path(snakemake.output[0]), snakemake.wildcards, snakemake.input
pair = Pair(Combination(w.model, w.dev_a, w.dq_a), Combination(w.model, w.dev_b, w.dq_b))


def body(job: jobs.Job) -> None:
    forced = (
        (Path(i.forced_record_a), Path(i.forced_a), Path(i.forced_record_b), Path(i.forced_b))
        if "forced_a" in i.keys()  # noqa: SIM118 - a Namedlist: `in` looks at values
        else None
    )
    result = compare_files(
        Path(i.record_a), Path(i.logits_a), Path(i.record_b), Path(i.logits_b), forced
    )
    write_json(job.out(output), result)


def failed(job: jobs.Job, error: dict) -> None:
    write_json(job.out(output), failed_pair(pair, error))


jobs.run(snakemake, body, failed)
