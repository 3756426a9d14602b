"""Compare every pair of one model's combinations, in bulk (rule compare_model)."""

from pathlib import Path

from qdiff import jobs
from qdiff.compare.pairs import PairCache, RunFiles, compare_model, failed_pair
from qdiff.core.io import write_json
from qdiff.core.labels import Combination, Pair

output, model, i = Path(snakemake.output[0]), snakemake.wildcards.model, snakemake.input
combos = [Combination.parse(model, c) for c in snakemake.params.combinations]
pairs = [Pair.parse(model, a, b) for a, b in snakemake.params.pairs]
forcing = bool(i.forced_records)
files = {
    combo: RunFiles(
        Path(i.records[k]),
        Path(i.logits[k]) if i.logits else None,  # none with first_step_logits: top_k
        Path(i.forced_records[k]) if forcing else None,
        Path(i.forced[k]) if forcing else None,
    )
    for k, combo in enumerate(combos)
}


def write(job: jobs.Job, results: list) -> None:
    write_json(job.out(output), {"model": model, "pairs": results})


def body(job: jobs.Job) -> None:
    cache = PairCache.of_model(model, snakemake.params.code)
    write(job, compare_model(pairs, files, cache, say=jobs.console))
    cache.save()


def failed(job: jobs.Job, error: dict) -> None:
    write(job, [failed_pair(pair, error) for pair in pairs])


jobs.run(snakemake, body, failed)
