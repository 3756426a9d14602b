# Validation, the matrix, every target, path helpers and wildcard constraints.
# The config is checked here, at parse time, so a bad key stops the workflow before any job.
import functools
import json
import re
from pathlib import Path

from qdiff.core import secrets
from qdiff.core.config import (
    canonical_json,
    check_config_files,
    model_file,
    model_info_file,
    validate,
)
from qdiff.core.hashcache import HashCache
from qdiff.core.labels import (
    DEQUANT_COPIES,
    DEQUANT_MODES,
    PLOT_PATTERN,
    Combination,
    Pair,
)
from qdiff.core.stages import CAPTURE, FORCED, RECORD_FILE, RUN, SERVING, STAGES, TEXT
from qdiff.core.text import LEADING_KEPT
from qdiff.engine.probe import check_strict_devices
from qdiff.engine.provenance import llama_build_id
from qdiff.engine.stage import retry_token
from qdiff.core.roundings import plan as rounding_plan
from qdiff.jobs import skip_exit_collection
from qdiff.sources import fingerprint, made_file_problem
from qdiff.workflow import (
    code_digests,
    end_scheduler_timers,
    hold_workflow_lock,
    signature_once,
)

skip_exit_collection()  # Snakemake's heap: 0.3 s of garbage collection at exit on the EPYC
check_config_files(workflow.configfiles)  # duplicate keys, templates
# Before Snakemake stores, prints or pickles any of the config: hide what qdiff may not show
# (qdiff.core.secrets). The jobs that need a hidden value ask this process for it.
secrets.serve(secrets.scrub_config(config))
EXPERIMENT, VALIDATED = validate(config, base_dir=Path.cwd())
# scripts read runtime knobs (timeouts, stall limits) from the config, with their defaults
config.clear()
config.update(VALIDATED)
ON_THIS_MACHINE = not (workflow.remote_exec or workflow.non_local_exec)
# strict_devices: a missing backend is named before any job runs (onstart below), and by a
# dry run; --report, --unlock and the like, which run no job, work on any machine
if EXPERIMENT.strict_devices and ON_THIS_MACHINE and workflow.output_settings.dryrun:
    check_strict_devices(EXPERIMENT)
HASHES = HashCache()
LLAMA_BUILD = llama_build_id(HASHES)  # a rebuilt llama-cpp-python reruns every stage
# each script's qdiff code, a param of its rules: changed code reruns what it made
CODE = code_digests(sorted(Path(workflow.current_basedir, "../scripts").glob("*.py")))
REPORT_FILES = [
    "results/summary.md",
    "results/pairs.tsv",
    "results/runs.tsv",
    "results/summary.html",
]
ENABLED_STAGES = [s for s in STAGES.values() if EXPERIMENT.stage_enabled(s)]


# Just before the first job: qdiff's own lock on this directory (qdiff.workflow), and a
# missing backend named (strict_devices)
onstart:
    if workflow.is_main_process:
        hold_workflow_lock()
        if EXPERIMENT.strict_devices and ON_THIS_MACHINE:
            check_strict_devices(EXPERIMENT)


# Snakemake waits for its scheduler's last timer at exit: a second per run (qdiff.workflow)
onsuccess:
    end_scheduler_timers()


onerror:
    end_scheduler_timers()


def alternation(names):
    """A regex matching exactly one of ``names`` (longest first, so prefixes never win)."""
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


FETCHED = [m.name for m in EXPERIMENT.models.values() if not m.derived]
DERIVED = [m.name for m in EXPERIMENT.models.values() if m.derived]


wildcard_constraints:
    model=alternation(EXPERIMENT.models),
    device=alternation(EXPERIMENT.devices),
    dequant=alternation(DEQUANT_MODES),
    dqcopy=alternation(DEQUANT_COPIES),


# ---- what the workflow makes ----


def compare_file(model):
    return f"results/compare/{model}.json"


def text_compare_file(model):
    return f"results/compare/{model}.text.json"


def localise_file(model):
    return f"results/localise/{model}.json"


def all_targets(wildcards):
    """Every file the experiment consists of. All of them, not only the report: Snakemake
    would otherwise not recreate a deleted intermediate result whose consumers are done.
    """
    targets = list(REPORT_FILES)
    for combo in EXPERIMENT.all_combinations():
        for stage in ENABLED_STAGES:
            targets += [stage.record(combo)]
            targets += [stage.data(combo)] if EXPERIMENT.keeps_data(stage) else []
    targets += [compare_file(m) for m in EXPERIMENT.run_models]
    if EXPERIMENT.capture_enabled:
        targets += [localise_file(m) for m in EXPERIMENT.run_models]
    if EXPERIMENT.text_enabled:
        targets += [text_compare_file(m) for m in EXPERIMENT.run_models]
    targets += [
        reference_model_file(m) for m in EXPERIMENT.measured_against_reference_model()
    ]
    if EXPERIMENT.exact_enabled:
        for model in EXPERIMENT.run_models:
            emulated = emulates_roundings(model)
            names = [
                n
                for n in EXACT_FILES
                if (emulated or n not in ROUNDINGS_FILES)
                and (EXPERIMENT.text_enabled or n not in TEXT_FILES)
            ]
            targets += [exact_file(model, name) for name in names]
    return targets


# ---- input, params and resource functions (rules hold no lambdas) ----
# Large files (models, arrays) are ancient(): their timestamps never rerun anything. Content
# flows through the small JSON beside each of them (a model's sidecar, a stage's record),
# whose checksum Snakemake compares when its timestamp changes. Every ancient input comes
# with that JSON as a plain input: Snakemake does not rerun a job whose only link to a
# rerunning job is ancient files. The functions of the per-combination rules, which
# planning calls for every combination, are @signature_once (qdiff.workflow).


def combo_of(wildcards):
    return Combination(wildcards.model, wildcards.device, wildcards.dequant)


def read_json_or_none(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def fetch_params(wildcards):
    """What the fetched file's content depends on (qdiff.sources.fingerprint)."""
    content = fingerprint(EXPERIMENT.models[wildcards.model], HASHES)
    HASHES.save()
    return canonical_json(content)


# A job's retry_token param (qdiff.engine.stage.retry_token), worked out once per invocation: Snakemake
# asks for params again after it has removed the outputs of a job it is about to run, and
# the token must be the one it compared and stores.
token_of = functools.cache(retry_token)


@functools.cache
def made_model_token(model, copy):
    """The fetch's or derivation's retry_token: its sidecar's (a failed one is retried), or,
    when the file's bytes are not those its sidecar records or the pin names, a token that
    says so, and the file is made again (qdiff.sources.made_file_problem)."""
    info = model_info_file(model, copy)
    pin = EXPERIMENT.models[model].sha256 if copy == "none" else None
    problem = made_file_problem(
        Path(model_file(model, copy)), read_json_or_none(info), pin, HASHES
    )
    HASHES.save()
    return f"remake: {problem}" if problem else token_of(info)


def model_retry_token(wildcards):
    """A function of the wildcards only: Snakemake leaves params that read output out of
    its rerun check."""
    return made_model_token(
        wildcards.model, dict(wildcards.items()).get("dqcopy", "none")
    )


def parent_model(wildcards):
    return ancient(model_file(EXPERIMENT.models[wildcards.model].parent))


def parent_model_info(wildcards):
    return model_info_file(EXPERIMENT.models[wildcards.model].parent)


def requant_type(wildcards):
    return EXPERIMENT.models[wildcards.model].quant


@signature_once
def combination_inputs(wildcards):
    """What every stage of a combination loads: its model file and the file's sidecar."""
    return {
        "model": ancient(model_file(wildcards.model, wildcards.dequant)),
        "info": model_info_file(wildcards.model, wildcards.dequant),
    }


@signature_once
def forced_inputs(wildcards):
    """A forced pass also needs its own free run's record (a self-check against its
    first-step digests), the teacher's run (the sequences) and, unless it is the teacher,
    the teacher's forced pass (slice ids)."""
    combo = combo_of(wildcards)
    teacher = EXPERIMENT.teacher(combo.model)
    inputs = {
        **combination_inputs(wildcards),
        "own_run": RUN.record(combo),
        "teacher_run": RUN.record(teacher),
    }
    if combo != teacher:
        inputs["teacher_record"] = FORCED.record(teacher)
        inputs["teacher_data"] = ancient(FORCED.data(teacher))
    return inputs


@signature_once
def text_inputs(wildcards):
    """A text job reads the text and, unless it is the teacher, the teacher's text pass
    (its windows and the token ids every text pass keeps)."""
    combo = combo_of(wildcards)
    teacher = EXPERIMENT.teacher(combo.model)
    inputs = {**combination_inputs(wildcards), "text": EXPERIMENT.text["file"]}
    if combo != teacher:
        inputs["teacher_record"] = TEXT.record(teacher)
        inputs["teacher_data"] = ancient(TEXT.data(teacher))
    return inputs


@signature_once
def serving_inputs(wildcards):
    """A serving job also reads its own run's record: the reference in another process."""
    return {**combination_inputs(wildcards), "own_run": RUN.record(combo_of(wildcards))}


def stage_spec(stage):
    """The params function of a stage's spec: exactly the combination's slice of the config."""

    @signature_once
    def spec(wildcards):
        return canonical_json(EXPERIMENT.spec(stage, combo_of(wildcards)))

    return spec


def stage_retry_token(stage):
    @signature_once
    def token(wildcards):
        return token_of(stage.record(combo_of(wildcards)))

    return token


def kept_outputs(outputs):
    """Outputs that a job keeps when they were made of its very inputs (qdiff.jobs, reuse):
    update() asks Snakemake to leave them in place when the job runs."""
    return {name: update(path) for name, path in outputs.items()}


def stage_outputs(stage):
    """A per-combination rule's outputs: its record and, where it keeps one, its data file."""
    outputs = {"record": stage.record_pattern}
    if EXPERIMENT.keeps_data(stage):
        outputs["data"] = stage.data_pattern
    return kept_outputs(outputs)


def data_files(stage, combos):
    """A stage's data files of ``combos`` (none where it keeps none), as inputs."""
    if not EXPERIMENT.keeps_data(stage):
        return []
    return [ancient(stage.data(c)) for c in combos]


def stage_resources(stage):
    """A per-combination job's resources: a GPU for GPU devices, memory from the model's
    size (what a cluster job asks for), and the stage's runtime (minutes, SLURM)."""
    return {"gpu": run_gpus, "mem_mb": model_mem_mb, "runtime": stage.runtime_min}


def given_cores():
    """--cores, or 1 where the command gives none: --report and --summary plan jobs, and
    ask for their threads, but run none (workflow.cores raises there)."""
    return workflow.global_resources["_cores"].value or 1


@signature_once
def run_threads(wildcards):
    """On one machine a job claims every core Snakemake may use, so inference never
    overlaps and its timings (and OpenMP's spinning threads) are undisturbed; override with
    --set-threads. On a cluster each job gets a node slice of its own: ask for what the
    device uses."""
    threads = EXPERIMENT.devices[wildcards.device].threads
    if not ON_THIS_MACHINE:
        return threads
    return max(given_cores(), threads)


def size_mb(files):
    """The files' size in MiB, one stat each (Snakemake's input.size_mb cost 1.5 ms a job,
    about 40 times more, and planning asks for every job). Before a file exists this raises
    FileNotFoundError, which Snakemake turns into a value it asks for again once it does.
    """
    return sum(Path(f).stat().st_size for f in files) / 2**20


def gguf_mb(input):
    return size_mb(f for f in input if f.endswith(".gguf"))


@signature_once
def model_mem_mb(wildcards, input):
    """Memory a job that loads (or converts) a GGUF file needs: the file, a copy's worth of
    working space and 2 GB for the runtime and the logits (the `mem_mb` a cluster job asks for).
    """
    return int(2 * gguf_mb(input) + 2000)


@signature_once
def run_env(wildcards):
    """The conda environment of the device's backend (for --sdm conda)."""
    return f"../../envs/{EXPERIMENT.devices[wildcards.device].backend}.yaml"


@signature_once
def run_gpus(wildcards):
    return int(EXPERIMENT.devices[wildcards.device].on_gpu)


def compare_inputs(wildcards):
    """Every combination's run (and forced pass) of the model, in ``combination_labels``
    order."""
    combos = EXPERIMENT.combinations(wildcards.model)
    forcing = EXPERIMENT.forcing_enabled
    return {
        "records": [RUN.record(c) for c in combos],
        "logits": data_files(RUN, combos),
        "forced_records": [FORCED.record(c) for c in combos] if forcing else [],
        "forced": [ancient(FORCED.data(c)) for c in combos] if forcing else [],
    }


def combination_labels(wildcards):
    return [c.label for c in EXPERIMENT.combinations(wildcards.model)]


def pair_labels(wildcards):
    return [list(p.labels) for p in EXPERIMENT.pairs(wildcards.model)]


def compare_mem_mb(wildcards, input):
    """The arrays it reads (the logits' pages count against a cluster job's memory, and the
    forced passes' slices are kept with their probabilities, 4x their size) and 2 GB for
    one prompt's prepared logits of every run and the results."""
    return int(3 * size_mb(input) + 2000)


def localise_inputs(wildcards):
    """Every capture of the model, and its pair comparisons (to choose the pair)."""
    combos = EXPERIMENT.combinations(wildcards.model)
    return {
        "records": [CAPTURE.record(c) for c in combos],
        "data": [ancient(CAPTURE.data(c)) for c in combos],
        "pairs": compare_file(wildcards.model),
    }


# A model's exact-reference files: its record and data (qdiff.exact), and how far every
# combination is from it (qdiff.compare.distance)
EXACT_FILES = {
    "record": RECORD_FILE,
    "data": "exact.npz",
    "distance": "distance.json",
}
# and the engine with llama.cpp's rounding sources switched on (qdiff.exact.roundings), for
# the combinations whose sources it follows
ROUNDINGS_FILES = {
    "roundings_record": "roundings.json",
    "roundings_data": "roundings.npz",
}
# and the exact answer along the configured text (qdiff.core.text)
TEXT_FILES = {"text_record": "text.json", "text_data": "text.npz"}
EXACT_FILES.update(ROUNDINGS_FILES)
EXACT_FILES.update(TEXT_FILES)


def exact_file(model, name):
    return f"results/exact/{model}/{EXACT_FILES[name]}"


def exact_inputs(wildcards):
    """The model's own file and the teacher's text: its run (prompt and generated tokens)
    and, with teacher forcing, its forced pass (the token ids every forced pass keeps).
    """
    teacher = EXPERIMENT.teacher(wildcards.model)
    inputs = {
        "model": ancient(model_file(wildcards.model)),
        "info": model_info_file(wildcards.model),
        "teacher_run": RUN.record(teacher),
    }
    if EXPERIMENT.forcing_enabled:
        inputs["teacher_record"] = FORCED.record(teacher)
        inputs["teacher_data"] = ancient(FORCED.data(teacher))
    return inputs


@functools.cache
def roundings_of(model):
    """The rounding sources of each combination of ``model``, and the engine's sets of
    switches that measure them (qdiff.exact.roundings.plan)."""
    return rounding_plan(
        {
            c.label: (EXPERIMENT.devices[c.device].as_dict(), c.dequant)
            for c in EXPERIMENT.combinations(model)
        }
    )


def emulates_roundings(model):
    return bool(roundings_of(model)[0])


def rounding_configs(wildcards):
    return canonical_json(roundings_of(wildcards.model)[0])


def roundings_retry_token(wildcards):
    return token_of(exact_file(wildcards.model, "roundings_record"))


def roundings_inputs(wildcards):
    """The model's own file and the prompts' tokens (the teacher's run)."""
    inputs = exact_inputs(wildcards)
    return {name: inputs[name] for name in ("model", "info", "teacher_run")}


def exact_text_inputs(wildcards):
    """The model's own file and the teacher's text pass (its windows and token ids)."""
    teacher = EXPERIMENT.teacher(wildcards.model)
    return {
        "model": ancient(model_file(wildcards.model)),
        "info": model_info_file(wildcards.model),
        "text_record": TEXT.record(teacher),
        "text_data": ancient(TEXT.data(teacher)),
    }


def exact_text_retry_token(wildcards):
    return token_of(exact_file(wildcards.model, "text_record"))


def text_compare_inputs(wildcards):
    """Every combination's text pass, in ``combination_labels`` order, and the exact one."""
    combos = EXPERIMENT.combinations(wildcards.model)
    inputs = {
        "records": [TEXT.record(c) for c in combos],
        "data": [ancient(TEXT.data(c)) for c in combos],
    }
    if EXPERIMENT.exact_enabled:
        inputs["exact_record"] = exact_file(wildcards.model, "text_record")
        inputs["exact_data"] = ancient(exact_file(wildcards.model, "text_data"))
    if wildcards.model in EXPERIMENT.measured_against_reference_model():
        reference = Combination.parse(EXPERIMENT.reference_model, EXPERIMENT.reference)
        inputs["reference_record"] = TEXT.record(reference)
        inputs["reference_data"] = ancient(TEXT.data(reference))
    return inputs


def exact_threads(wildcards):
    """numpy's BLAS uses every core it may: claim them all on one machine."""
    return max(given_cores(), 1) if ON_THIS_MACHINE else 2


def report_threads(wildcards):
    """The report renders its models side by side: one process per model, up to every core
    on one machine (it is the last job there), or 4 on a cluster."""
    return max(
        1, min(len(EXPERIMENT.run_models), given_cores() if ON_THIS_MACHINE else 4)
    )


def exact_mem_mb(wildcards, input):
    """float64 weights take up to 16x a 4-bit file, plus the logits and working space."""
    return int(20 * gguf_mb(input) + 2000)


def exact_retry_token(wildcards):
    return token_of(exact_file(wildcards.model, "record"))


def distance_inputs(wildcards):
    """The exact reference and every combination's run (and forced pass) of the model."""
    combos = EXPERIMENT.combinations(wildcards.model)
    inputs = {
        "exact_record": exact_file(wildcards.model, "record"),
        "exact_data": ancient(exact_file(wildcards.model, "data")),
        "records": [RUN.record(c) for c in combos],
        "logits": data_files(RUN, combos),
    }
    if emulates_roundings(wildcards.model):
        inputs["roundings_record"] = exact_file(wildcards.model, "roundings_record")
        inputs["roundings_data"] = ancient(
            exact_file(wildcards.model, "roundings_data")
        )
        if EXPERIMENT.serving_enabled:  # the sensitivity floor: another n_ubatch
            inputs["serving_records"] = [SERVING.record(c) for c in combos]
    if EXPERIMENT.forcing_enabled:
        inputs["forced_records"] = [FORCED.record(c) for c in combos]
        inputs["forced_data"] = [ancient(FORCED.data(c)) for c in combos]
    return inputs


def reference_model_file(model):
    return f"results/reference/{model}.json"


def reference_model_inputs(wildcards):
    """The reference model's reference run (and exact answer), and this model's runs."""
    reference = Combination.parse(EXPERIMENT.reference_model, EXPERIMENT.reference)
    combos = EXPERIMENT.combinations(wildcards.model)
    inputs = {
        "reference_record": RUN.record(reference),
        "reference_logits": ancient(RUN.data(reference)),
        "records": [RUN.record(c) for c in combos],
        "logits": [ancient(RUN.data(c)) for c in combos],
    }
    if EXPERIMENT.exact_enabled:
        inputs["exact_record"] = exact_file(reference.model, "record")
        inputs["exact_data"] = ancient(exact_file(reference.model, "data"))
    return inputs


def report_inputs(wildcards):
    """Every enabled stage's records (``<stage>_records``; qdiff.core.stages), the runs'
    first-step logits where they keep them, and each model's comparisons and results."""
    combos = EXPERIMENT.all_combinations()
    records = {
        f"{stage.name}_records": (
            [stage.record(c) for c in combos] if stage in ENABLED_STAGES else []
        )
        for stage in STAGES.values()
    }
    return {
        **records,
        "logits": data_files(RUN, combos),
        "pairs": [compare_file(m) for m in EXPERIMENT.run_models],
        "localised": (
            [localise_file(m) for m in EXPERIMENT.run_models]
            if EXPERIMENT.capture_enabled
            else []
        ),
        "exact": (
            [exact_file(m, "distance") for m in EXPERIMENT.run_models]
            if EXPERIMENT.exact_enabled
            else []
        ),
        "reference_model": [
            reference_model_file(m)
            for m in EXPERIMENT.measured_against_reference_model()
        ],
        "text": (
            [text_compare_file(m) for m in EXPERIMENT.run_models]
            if EXPERIMENT.text_enabled
            else []
        ),
    }
