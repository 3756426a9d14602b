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
from qdiff.localise import LOCALISE_FORMAT
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


def forced_dir(model, device, dequant):
    return f"results/forced/{model}/{device}/{dequant}"


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
    """On one machine a run claims every core Snakemake may use, so runs never overlap and
    their timings (and OpenMP's spinning threads) are undisturbed; override with
    --set-threads. On a cluster each job gets a node slice of its own: ask for what the
    device uses."""
    threads = EXPERIMENT.devices[wildcards.device].threads
    if workflow.non_local_exec or workflow.remote_exec:
        return threads
    return max(workflow.cores, threads)


def model_mem_mb(wildcards, input):
    """Memory a job that loads (or converts) a GGUF file needs: the file, a copy's worth of
    working space and 2 GB for the runtime and the logits (the `mem_mb` a cluster job asks for).
    """
    return int(2 * input.size_mb + 2000)


def run_env(wildcards):
    """The conda environment of the device's backend (for --sdm conda)."""
    return f"../../envs/{EXPERIMENT.devices[wildcards.device].backend}.yaml"


def run_gpus(wildcards):
    return int(EXPERIMENT.devices[wildcards.device].on_gpu)


def forced_inputs(wildcards):
    """A forced pass needs its model, its own free run (a self-check), the teacher's run
    (the sequences) and, unless it is the teacher, the teacher's forced pass (slice ids).
    """
    teacher = EXPERIMENT.teacher(wildcards.model)
    own = run_dir(wildcards.model, wildcards.device, wildcards.dequant)
    inputs = {
        "model": run_model(wildcards),
        "info": run_model_info(wildcards),
        "own_logits": f"{own}/logits.npy",
        "teacher_run": record_file(teacher.model, teacher.device, teacher.dequant),
    }
    if (wildcards.device, wildcards.dequant) != (teacher.device, teacher.dequant):
        t = forced_dir(teacher.model, teacher.device, teacher.dequant)
        inputs["teacher_record"] = f"{t}/record.json"
        inputs["teacher_data"] = f"{t}/forced.npz"
    return inputs


def forced_spec(wildcards):
    combo = Combination(wildcards.model, wildcards.device, wildcards.dequant)
    return canonical_json(EXPERIMENT.forced_spec(combo))


def forced_retry_token(wildcards):
    return retry_token(
        Path(forced_dir(wildcards.model, wildcards.device, wildcards.dequant))
        / "record.json"
    )


def compare_inputs(wildcards):
    inputs = {}
    for side, device, dequant in (
        ("a", wildcards.dev_a, wildcards.dq_a),
        ("b", wildcards.dev_b, wildcards.dq_b),
    ):
        run = run_dir(wildcards.model, device, dequant)
        inputs[f"record_{side}"] = f"{run}/record.json"
        inputs[f"logits_{side}"] = f"{run}/logits.npy"
        if EXPERIMENT.forcing_enabled:
            forced = forced_dir(wildcards.model, device, dequant)
            inputs[f"forced_record_{side}"] = f"{forced}/record.json"
            inputs[f"forced_{side}"] = f"{forced}/forced.npz"
    return inputs


def all_run_records(wildcards):
    return [
        record_file(c.model, c.device, c.dequant) for c in EXPERIMENT.all_combinations()
    ]


def all_run_logits(wildcards):
    return [
        f"{run_dir(c.model, c.device, c.dequant)}/logits.npy"
        for c in EXPERIMENT.all_combinations()
    ]


def all_forced_records(wildcards):
    if not EXPERIMENT.forcing_enabled:
        return []
    return [
        f"{forced_dir(c.model, c.device, c.dequant)}/record.json"
        for c in EXPERIMENT.all_combinations()
    ]


def all_pair_files(wildcards):
    return [
        pair_file(a, b)
        for model in EXPERIMENT.models
        for a, b in EXPERIMENT.pairs(model)
    ]


def capture_dir(model, device, dequant):
    return f"results/capture/{model}/{device}/{dequant}"


def capture_spec(wildcards):
    combo = Combination(wildcards.model, wildcards.device, wildcards.dequant)
    return canonical_json(EXPERIMENT.capture_spec(combo))


def capture_retry_token(wildcards):
    return retry_token(
        Path(capture_dir(wildcards.model, wildcards.device, wildcards.dequant))
        / "record.json"
    )


def localise_inputs(wildcards):
    """Every capture of the model, and its pair comparisons (to find the largest pair)."""
    combos = EXPERIMENT.combinations(wildcards.model)
    return {
        "records": [
            f"{capture_dir(c.model, c.device, c.dequant)}/record.json" for c in combos
        ],
        "data": [
            f"{capture_dir(c.model, c.device, c.dequant)}/capture.npz" for c in combos
        ],
        "pairs": [pair_file(a, b) for a, b in EXPERIMENT.pairs(wildcards.model)],
    }


def all_localise_files(wildcards):
    if not EXPERIMENT.capture_enabled:
        return []
    return [f"results/localise/{model}.json" for model in EXPERIMENT.models]
