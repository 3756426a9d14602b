# Validation, the run matrix, path helpers and wildcard constraints.
# The config is validated here, at parse time, so a bad key stops the workflow before any job.
import re
from pathlib import Path

from qdiff.config import (
    Combination,
    canonical_json,
    check_duplicate_keys,
    load_experiment,
)
from qdiff.compare import COMPARE_FORMAT
from qdiff.provenance import RECORD_FORMAT, llama_build_id
from qdiff.run import retry_token

check_duplicate_keys(workflow.configfiles)  # YAML would silently keep the last one
EXPERIMENT = load_experiment(config, base_dir=Path.cwd())
LLAMA_BUILD = llama_build_id()  # a rebuilt llama-cpp-python reruns every run
REPORT_FILES = ["results/summary.md", "results/pairs.tsv", "results/runs.tsv"]


def alternation(names):
    """A regex matching exactly one of ``names`` (longest first, so prefixes never win)."""
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


FETCHED = [m.name for m in EXPERIMENT.models.values() if not m.derived]
DERIVED = [m.name for m in EXPERIMENT.models.values() if m.derived]


wildcard_constraints:
    model=alternation(EXPERIMENT.models),
    device=alternation(EXPERIMENT.devices),
    dev_a=alternation(EXPERIMENT.devices),
    dev_b=alternation(EXPERIMENT.devices),
    dequant="none|f32|f16|bf16",
    dq_a="none|f32|f16|bf16",
    dq_b="none|f32|f16|bf16",
    dqcopy="f32|f16|bf16",


def model_file(model, dequant="none"):
    """The GGUF file a combination loads: the model itself or one of its dequantized copies."""
    if dequant == "none":
        return f"resources/models/{model}.gguf"
    return f"resources/models/{model}.dequant-{dequant}.gguf"


def run_dir(model, device, dequant):
    return f"results/runs/{model}/{device}/{dequant}"


def record_file(model, device, dequant):
    return f"results/runs/{model}/{device}/{dequant}/record.json"


def pair_file(a: Combination, b: Combination):
    return f"results/compare/{a.model}/{a.label}__{b.label}.json"


# ---- input and params functions (rules hold no lambdas) ----


def fetch_params(wildcards):
    spec = EXPERIMENT.models[wildcards.model]
    return canonical_json({"source": spec.source, "sha256": spec.sha256})


def parent_model(wildcards):
    return model_file(EXPERIMENT.models[wildcards.model].parent)


def parent_model_info(wildcards):
    return parent_model(wildcards) + ".json"


def requant_type(wildcards):
    return EXPERIMENT.models[wildcards.model].quant


def run_model(wildcards):
    return model_file(wildcards.model, wildcards.dequant)


def run_model_info(wildcards):
    return run_model(wildcards) + ".json"


def run_spec(wildcards):
    combo = Combination(wildcards.model, wildcards.device, wildcards.dequant)
    return canonical_json(EXPERIMENT.run_spec(combo))


def run_retry_token(wildcards):
    """Changes after a failed run, so the next invocation retries it (qdiff.run)."""
    return retry_token(
        Path(record_file(wildcards.model, wildcards.device, wildcards.dequant))
    )


def run_threads(wildcards):
    """A run claims every core Snakemake may use, so runs never overlap and their timings
    (and OpenMP's spinning threads) are undisturbed; override with --set-threads."""
    return max(workflow.cores, EXPERIMENT.devices[wildcards.device].threads)


def run_env(wildcards):
    """The conda environment of the device's backend (for --sdm conda)."""
    return f"../../envs/{EXPERIMENT.devices[wildcards.device].backend}.yaml"


def run_gpus(wildcards):
    return int(EXPERIMENT.devices[wildcards.device].on_gpu)


def compare_inputs(wildcards):
    a = run_dir(wildcards.model, wildcards.dev_a, wildcards.dq_a)
    b = run_dir(wildcards.model, wildcards.dev_b, wildcards.dq_b)
    return {
        "record_a": f"{a}/record.json",
        "logits_a": f"{a}/logits.npy",
        "record_b": f"{b}/record.json",
        "logits_b": f"{b}/logits.npy",
    }


def all_run_records(wildcards):
    return [
        record_file(c.model, c.device, c.dequant) for c in EXPERIMENT.all_combinations()
    ]


def all_run_logits(wildcards):
    return [
        f"{run_dir(c.model, c.device, c.dequant)}/logits.npy"
        for c in EXPERIMENT.all_combinations()
    ]


def all_pair_files(wildcards):
    return [
        pair_file(a, b)
        for model in EXPERIMENT.models
        for a, b in EXPERIMENT.pairs(model)
    ]
