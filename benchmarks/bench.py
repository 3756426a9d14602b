"""qdiff's benchmark: what the pipeline costs on this machine beyond inference, as ratios.

    .venv/bin/python benchmarks/bench.py [--cores 4] [--config config/config.yaml]

It runs, in a scratch directory (``--workdir``, default a temporary one):

1. the experiment (``--config``, default the default experiment) through ``snakemake --cores N``
   from nothing, then the no-op rerun (the same command again), beside Snakemake's own no-op
   of a one-rule workflow; and the serving stage's wall time against the decoding of its
   cases (its target: at most 10% more);
2. the same experiment's runs alone (teacher forcing, capture, exact and serving off),
   from a clean results/ with the model files already made, against the *inference floor*: the
   same runs in one bare loop in this process (llama-cpp-python through
   ``qdiff.engine.model.LoadedModel``: load, prompt, greedy decode; no Snakemake, no records,
   no child processes), alternately; each pipeline is also set against the inference its own
   run records give, which splits the ratio into what the pipeline adds around its inference
   and how that inference compares with the floor;
3. the text stage (when the experiment scores a text; ``--only text`` runs the experiment and
   this part alone): its scoring time against the same windows decoded in a bare loop
   (``LoadedModel.score``, no recording; target at most 1.2x), with ``--llama-perplexity BIN``
   against llama.cpp's own tool on the same files and settings (target at most 1.2x), and
   the float64 engine along the text against the f32 copy's scoring (target at most 3x;
   ``--only exact-text --workdir DIR`` reads it from a finished run's records in DIR);
4. comparison throughput: ``qdiff.compare.pairs.compare_model`` on one thread, reading the arrays
   from disk, on synthetic logits of Gemma 3's 262,144-token vocabulary and on the
   experiment's own largest-vocabulary model;
5. planning: ``snakemake --dry-run --quiet rules`` of a generated matrix (tiny real GGUF
   models; default 10 models x 10 devices x 3 dequant x 30 prompts).

It prints each figure beside its target (issue 15's) and says whether it meets it. The
figures are this machine's: run it on the machine you care about.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from math import nan
from pathlib import Path
from statistics import median
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
GEMMA_VOCAB = 262_144
CORES = 4  # snakemake --cores, as the README's quick start runs it
MATRIX = (10, 10, 3, 30)  # models x devices x dequant x prompts of the planned matrix


def snakemake(
    workdir: Path, cores: int, *args: str, snakefile: Path = REPO / "Snakefile"
) -> tuple[float, str]:
    """Wall seconds of one snakemake command in ``workdir``, and its output."""
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile)]
    command += ["--directory", str(workdir), "--cores", str(cores), *args]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"snakemake {' '.join(args)} failed in {workdir}:\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout + proc.stderr


def median_wall(
    workdir: Path, cores: int, times: int, *args: str, snakefile: Path = REPO / "Snakefile"
) -> tuple[float, float, str]:
    """Median and least wall seconds of ``times`` runs of one snakemake command (a shared
    machine's timings scatter), and the last run's output."""
    runs = [snakemake(workdir, cores, *args, snakefile=snakefile) for _ in range(times)]
    seconds = sorted(s for s, _ in runs)
    return seconds[len(seconds) // 2], seconds[0], runs[-1][1]


def job_counts(output: str) -> dict[str, int]:
    """Snakemake's "Job stats" table of a run."""
    if "Job stats:" not in output:
        return {}
    table = output.split("Job stats:")[1].split("\n\n", maxsplit=1)[0]
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}
    return {rule: n for rule, n in counts.items() if rule not in ("all", "total")}


def line(name: str, measured: float, unit: str, target: float, better: str, detail: str) -> None:
    """One figure against its target: ``better`` is "lower" or "higher"."""
    meets = measured <= target if better == "lower" else measured >= target
    bound = "<=" if better == "lower" else ">="
    print(
        f"  {name:<28} {measured:8.2f} {unit:<14} target {bound} {target:g} {unit}: "
        f"{'meets' if meets else 'MISSES'} ({measured / target:.2f}x the target)  [{detail}]"
    )


# ---- 1 and 2: the pipeline against the inference floor ----


def write_config(workdir: Path, config: dict[str, Any]) -> None:
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def experiment_config(path: Path) -> dict[str, Any]:
    """The experiment's config, its relative paths (prompts files, models) made absolute."""
    config = yaml.safe_load(path.read_text())
    if isinstance(config.get("prompts"), str):
        config["prompts"] = str((REPO / config["prompts"]).resolve())
    for spec in config["models"].values():
        if "path" in spec:
            spec["path"] = str((REPO / spec["path"]).resolve())
    return config


def runs_only(config: dict[str, Any]) -> dict[str, Any]:
    return {
        **config,
        "teacher_forcing": {"enabled": False},
        "capture": {"enabled": False},
        "exact": {"enabled": False},
        "serving": {"enabled": False},
        "text": {"enabled": False},  # the floor loop decodes the prompts only
    }


def gpu_of(settings: Any) -> Any:
    """The backend device a GPU combination loads on (None on the CPU), as its job picks it."""
    from qdiff.engine.devices import backend_devices, devices_for_backend

    if not settings.on_gpu:
        return None
    return devices_for_backend(settings.backend, backend_devices())[settings.main_gpu].handle


def inference_floor(workdir: Path) -> float:
    """Seconds of the experiment's runs in one bare loop: per combination, load the model on
    its device, then prompt and decode every prompt greedily, as the run stage does."""
    os.chdir(workdir)  # the config's model paths are relative to the workflow's directory
    from qdiff.core.config import model_file, validate
    from qdiff.core.settings import DeviceSettings
    from qdiff.core.stages import RUN
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel

    experiment, _ = validate(yaml.safe_load(Path("config/config.yaml").read_text()), Path.cwd())
    log = init_backend(workdir / "floor-errors.txt")  # keep it: llama.cpp calls it
    total = 0.0
    for combo in experiment.all_combinations():
        spec = experiment.spec(RUN, combo)
        settings = DeviceSettings.from_config(spec["settings"])
        generation = spec["generation"]
        start = time.perf_counter()
        path = Path(model_file(combo.model, combo.dequant))
        with LoadedModel(path, settings, generation["n_ctx"], gpu_of(settings)) as loaded:
            for prompt in spec["prompts"]:
                tokens = loaded.prompt_tokens(prompt["text"], generation["chat_template"])
                loaded.generate(tokens, generation["n_tokens"])
        total += time.perf_counter() - start
    del log
    return total


TEXT_REPEATS = 3  # times each run is timed


def fastest_of(runs: dict[Any, Callable[[], float]]) -> dict[Any, float]:
    """The fastest of ``TEXT_REPEATS`` timings of every run (each returns its seconds), the
    runs in turn: on a shared machine noise only adds time."""
    fastest = dict.fromkeys(runs, float("inf"))
    for _ in range(TEXT_REPEATS):
        for key, run in runs.items():
            fastest[key] = min(fastest[key], run())
    return fastest


def window_seconds(first: float, whole: float, n: int) -> float:
    """Seconds a window over windows 2 .. n, from a pass over n windows (``whole``) and one
    over the first alone (``first``): what a longer text costs a window, without the
    one-off costs of a pass (a fresh process's first window; the last window's recording,
    which no scoring hides)."""
    return (whole - first) / (n - 1)


# what _time_windows adds up per backend: seconds of windows 2 .. n each way and how many,
# and of the whole passes
TEXT_TIMINGS = ("bare", "stage", "windows", "bare_pass", "stage_pass", "pass_windows")


def _time_windows(
    loaded: Any, cut: list[list[int]], ids: Any, top_k: int, took: dict[str, float]
) -> None:
    """Score the windows bare and as the stage does (``score_windows``, which on a GPU
    records a window while the next is scored), each way over all of them and over the
    first alone, and add the seconds of windows 2 .. n (``window_seconds``) and of the whole
    passes (``*_pass``) to ``took``."""
    from qdiff.core.forced import ForcedRecorder
    from qdiff.core.text import LEADING_KEPT, split
    from qdiff.engine.worker import score_windows

    recorder = ForcedRecorder(len(cut), len(split(cut[0])[1]), top_k, n_top=LEADING_KEPT)

    def bare(k: int) -> float:
        start = time.perf_counter()
        for window in cut[:k]:
            loaded.score(window, len(split(window)[0]) - 1)
        return time.perf_counter() - start

    def stage(k: int) -> float:
        start = time.perf_counter()
        score_windows(loaded, recorder, cut[:k], ids)
        return time.perf_counter() - start

    n = len(cut)
    ways = {"bare": bare, "stage": stage}
    fastest = fastest_of(
        {(way, k): lambda run=run, k=k: run(k) for way, run in ways.items() for k in (1, n)}
    )
    for way in ways:  # windows 2 .. n: the whole pass less the first window's
        took[way] += fastest[way, n] - fastest[way, 1]
        took[f"{way}_pass"] += fastest[way, n]
    took["windows"] += n - 1
    took["pass_windows"] += n


def text_interleaved(workdir: Path) -> dict[str, dict[str, float]]:
    """The text stage's recording against bare scoring, in one process on one loaded model:
    per combination of the experiment, its windows scored bare (``LoadedModel.score``) and
    as the stage scores and records them (``score_windows``, at its teacher's slice ids from the
    experiment's results), in turn (``_time_windows``). Per backend: seconds of windows 2 ..
    n of each way and how many (``windows``), and of whole passes (``*_pass``,
    ``pass_windows``)."""
    os.chdir(workdir)
    from qdiff.core.config import model_file, validate
    from qdiff.core.io import load_arrays
    from qdiff.core.labels import Combination
    from qdiff.core.settings import DeviceSettings
    from qdiff.core.stages import TEXT
    from qdiff.core.text import windows
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel

    experiment, _ = validate(yaml.safe_load(Path("config/config.yaml").read_text()), Path.cwd())
    log = init_backend(workdir / "text-floor-errors.txt")
    took: dict[str, dict[str, float]] = {}  # by backend
    for combo in experiment.all_combinations():
        spec = experiment.spec(TEXT, combo)
        settings = DeviceSettings.from_config(spec["settings"])
        teacher = Combination.parse(combo.model, spec["text"]["teacher"])
        ids = None if teacher == combo else load_arrays(Path(TEXT.data(teacher)))["slice_ids"]
        text = Path(spec["text"]["file"]).read_text()
        with LoadedModel(
            Path(model_file(combo.model, combo.dequant)),
            settings,
            spec["text"]["n_ctx"],
            gpu_of(settings),
        ) as loaded:
            cut = windows(
                loaded.tokenize(text, parse_special=False),
                spec["text"]["n_ctx"],
                spec["text"]["windows"],
                loaded.bos_added(),
            )
            top_k = ids.shape[-1] if ids is not None else min(spec["text"]["top_k"], loaded.n_vocab)
            if len(cut) < 2:
                sys.exit("the text stage's benchmark needs text.windows of 2 or more")
            zero = dict.fromkeys(TEXT_TIMINGS, 0.0)
            _time_windows(loaded, cut, ids, top_k, took.setdefault(settings.backend, zero))
    del log
    return took


# llama-perplexity's log lines that bracket its scoring of the windows (--log-timestamps
# stamps them "minutes.seconds.ms.us"): what lies between them is the tool's own work on the
# windows, neither the model's loading nor the text's tokenizing
_PERPLEXITY_STAMP = re.compile(
    r"(\d+)\.(\d+)\.(\d+)\.(\d+) I (?:perplexity: calculating perplexity over|Final estimate)"
)


def perplexity_arguments(settings: Any, n_ctx: int, device: str) -> list[str]:
    """llama-perplexity's options for a qdiff device's settings, as qdiff.engine.model sets
    the text stage's context (one window a sequence; ``device``: the ggml device's name, or
    "none" on the CPU)."""
    args = [
        *("-c", str(n_ctx), "-b", str(min(settings.n_batch, n_ctx))),
        *("-ub", str(min(settings.n_ubatch, settings.n_batch, n_ctx))),
        *("-t", str(settings.threads), "-tb", str(settings.threads)),
        *("-fa", "on" if settings.flash_attn else "off"),
        *("-ctk", settings.kv_cache_type, "-ctv", settings.kv_cache_type),
        *("-ngl", "999" if settings.on_gpu else "0", "-sm", "none"),
        *("-dev", device),
    ]
    if not settings.extra_bufts:
        args.append("--no-repack")
    if not (settings.on_gpu and settings.op_offload):
        args.append("--no-op-offload")
    return args


def scoring_seconds(log: str) -> float | None:
    """The seconds between the two lines of a llama-perplexity log (run with --log-prefix
    --log-timestamps) that bracket its scoring, or None where the log lacks either."""
    stamps = [
        int(m) * 60 + int(s) + int(ms) / 1e3 + int(us) / 1e6
        for m, s, ms, us in _PERPLEXITY_STAMP.findall(log)
    ]
    return stamps[1] - stamps[0] if len(stamps) == 2 else None


def perplexity_seconds(binary: str, model: str, text: str, args: list[str], chunks: int) -> float:
    """Seconds llama-perplexity takes over the first ``chunks`` windows of the text, by its
    own log's time stamps."""
    command = [binary, "-m", model, "-f", text, *args, "--chunks", str(chunks)]
    proc = subprocess.run(
        [*command, "--log-prefix", "--log-timestamps"], capture_output=True, text=True
    )
    seconds = scoring_seconds(proc.stdout + proc.stderr)
    if proc.returncode != 0 or seconds is None:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


def perplexity_window_seconds(
    binary: str, model: str, text: str, args: list[str], n: int
) -> tuple[float, float, float]:
    """llama-perplexity's seconds a window over windows 2 .. n of the text
    (``window_seconds``: a run over n windows less one over the first alone, the fastest of
    ``TEXT_REPEATS`` each, in turn), and those two fastest runs' seconds."""
    fastest = fastest_of(
        {k: lambda k=k: perplexity_seconds(binary, model, text, args, k) for k in (1, n)}
    )
    return window_seconds(fastest[1], fastest[n], n), fastest[1], fastest[n]


def perplexity_interleaved(workdir: Path, binary: str) -> dict[str, dict[str, float]]:
    """llama-perplexity (``binary``) on each text combination's file and device settings,
    its windows 2 .. n (n: the config's text.windows; ``perplexity_window_seconds``), as
    ``text_interleaved`` times the stage's. Per backend: seconds and windows timed."""
    os.chdir(workdir)
    from qdiff.core.config import model_file, validate
    from qdiff.core.settings import DeviceSettings
    from qdiff.core.stages import TEXT
    from qdiff.engine.devices import backend_devices, devices_for_backend

    experiment, _ = validate(yaml.safe_load(Path("config/config.yaml").read_text()), Path.cwd())
    took: dict[str, dict[str, float]] = {}  # by backend
    for combo in experiment.all_combinations():
        spec = experiment.spec(TEXT, combo)
        settings = DeviceSettings.from_config(spec["settings"])
        found = devices_for_backend(settings.backend, backend_devices())
        device = found[settings.main_gpu].name if settings.on_gpu else "none"
        args = perplexity_arguments(settings, spec["text"]["n_ctx"], device)
        n = spec["text"]["windows"]
        model, text = model_file(combo.model, combo.dequant), spec["text"]["file"]
        _, first, whole = perplexity_window_seconds(binary, model, text, args, n)
        mine = took.setdefault(settings.backend, {"seconds": 0.0, "windows": 0.0})
        mine["seconds"] += whole - first
        mine["windows"] += n - 1
    return took


def perplexity_against_stage(
    workdir: Path, binary: Path, stage: dict[str, dict[str, float]]
) -> None:
    """The text stage's windows (``stage``: text_interleaved's) against llama-perplexity's
    own, per window, per backend."""
    tool = json.loads(" ".join(child("_perplexity", str(workdir), str(binary))))
    for backend, took in tool.items():
        ours = stage[backend]["stage"] / stage[backend]["windows"]
        theirs = took["seconds"] / took["windows"]
        line(
            f"text stage / llama-perplexity, {backend}",
            ours / theirs,
            "x",
            1.20,
            "lower",
            f"seconds a window: {ours:.4f} scored and recorded by the stage, {theirs:.4f} by "
            f"llama-perplexity ({took['windows']:.0f} windows of the same files and settings, "
            f"each way's first window's time subtracted, the fastest of {TEXT_REPEATS} runs "
            f"each; the stage's whole passes {pass_window(stage[backend], 'stage'):.4f} s a "
            "window)",
        )


def pass_window(took: dict[str, float], way: str) -> float:
    """One way's seconds a window over its whole passes (``_time_windows``)."""
    return took[f"{way}_pass"] / took["pass_windows"]


def ok_text_records(workdir: Path) -> list[dict[str, Any]]:
    from qdiff.core.stages import TEXT

    records = [json.loads(p.read_text()) for p in (workdir / TEXT.folder).rglob("record.json")]
    return [r for r in records if r["status"] == "ok"]


def text_stage(workdir: Path, perplexity: Path | None) -> None:
    """The text stage's scoring against the bare loop, and the exact engine along the text
    against the f32 copies' scoring (each model's exact job over its f32 combinations' mean);
    with ``perplexity`` (a llama-perplexity binary), the stage against that tool too."""
    ok = ok_text_records(workdir)
    if not ok:
        print("  text stage: no ok text record (is text enabled in the config?)")
        return
    by_backend = json.loads(" ".join(child("_text_interleaved", str(workdir))))
    for backend, took in by_backend.items():
        bare, stage, n = took["bare"], took["stage"], took["windows"]
        line(
            f"text stage / bare scoring, {backend}",
            stage / bare,
            "x",
            1.20,
            "lower",
            f"one process, {n:.0f} windows of its combinations (each combination's first "
            f"window's time subtracted), a combination's passes timed {TEXT_REPEATS} times "
            f"each way in turn, the fastest kept: {stage:.3f} s scored and recorded, "
            f"{bare:.3f} s scored bare ({stage / n:.4f} / {bare / n:.4f} s a window; whole "
            f"passes {pass_window(took, 'stage'):.4f} / {pass_window(took, 'bare'):.4f})",
        )
    if perplexity is not None:
        perplexity_against_stage(workdir, perplexity, by_backend)
    exact_text(workdir, ok)


def exact_text(workdir: Path, ok: list[dict[str, Any]]) -> None:
    """The exact engine along the text against the f32 copies' scoring on the CPU it runs on,
    from the records of a finished run (``ok``: its ok text records): each model's float64
    forward passes over the mean of its CPU f32 combinations' scoring, and all models
    together. Neither side's one-off cost counts: the scoring's seconds leave out the
    model's load, the passes' leave out the weights' dequantization (their record's
    ``dequantize_s``); the ratio with it is given beside."""
    exact = f32 = dequantized = 0.0
    per_model = []
    for path in sorted((workdir / "results/exact").glob("*/text.json")):
        record = json.loads(path.read_text())
        model = path.parent.name
        own = [
            r["timings"]["seconds"]
            for r in ok
            if r["model"] == model and r["dequant"] == "f32" and r["settings"]["backend"] == "cpu"
        ]
        if record["status"] == "ok" and own:
            timings, scoring = record["timings"], sum(own) / len(own)
            if "dequantize_s" not in timings:
                sys.exit(f"{path} has no dequantize_s: a record of an older qdiff, run it again")
            once = timings["dequantize_s"]
            forward = timings["forward_s"] - once
            exact, f32, dequantized = exact + forward, f32 + scoring, dequantized + once
            per_model.append(
                f"{model} {forward / scoring:.2f}x ({forward:.1f} s / {scoring:.1f} s; "
                f"{(forward + once) / scoring:.2f}x with {once:.1f} s of dequantization)"
            )
    if not f32:
        print("  exact text: no ok exact text record with a CPU f32 text record beside it")
        return
    line(
        "exact text / f32 text",
        exact / f32,
        "x",
        3.0,
        "lower",
        f"{exact:.1f} s of float64 forward passes, {f32:.1f} s of CPU f32 scoring, neither "
        f"side's one-off cost: {(exact + dequantized) / f32:.2f}x with the weights' "
        f"{dequantized:.1f} s of dequantization, as the scoring's leaves out the model's "
        "load; " + "; ".join(per_model),
    )


def exact_text_of_a_run(args: argparse.Namespace, workdir: Path) -> None:
    """``--only exact-text``: the exact engine's ratio from a finished run's records in
    ``--workdir`` (e.g. config/long.yaml's, whose text is every window), nothing run."""
    print("exact engine along the text, from the records in", workdir)
    exact_text(workdir, ok_text_records(workdir))


def child(*args: str, env: dict[str, str] | None = None) -> list[str]:
    """The last line of this script run with ``args`` in a fresh process, split."""
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, cwd=REPO, env=env
    )
    if proc.returncode != 0:
        sys.exit(f"bench.py {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout.splitlines()[-1].split()


def floor_seconds(workdir: Path) -> float:
    """``inference_floor`` in a fresh process, as a job's would be."""
    return float(child("_floor", str(workdir))[0])


def recorded_inference(workdir: Path) -> tuple[float, int]:
    """Seconds of inference the experiment's run records give (model load, prompts and
    decode steps, as the worker timed them): what the floor measures, inside the jobs; and
    how many ok run records they come from."""
    from qdiff.core.stages import RUN

    total, n_records = 0.0, 0
    for path in (workdir / RUN.folder).rglob("record.json"):
        record = json.loads(path.read_text())
        if record["status"] != "ok":
            continue
        n_records += 1
        total += record["timings"]["load_s"]
        for prompt in record["prompts"]:
            steps = max(len(prompt["tokens"]) - 1, 0)  # the first token comes from the prompt
            total += (prompt["prompt_ms"] + (prompt["decode_ms_per_token"] or 0) * steps) / 1000
    return total, n_records


def serving_overhead(workdir: Path) -> None:
    """The serving stage against the decoding it exists for: each job's wall time over the
    seconds its references and cases decoded (contexts, prefills, greedy steps, as the
    worker timed them); the rest is qdiff's: the process, one model load, tokenizing, the
    step-by-step comparisons and the record."""
    from qdiff.core.stages import SERVING

    wall = decoding = comparing = 0.0
    records = [json.loads(p.read_text()) for p in (workdir / SERVING.folder).rglob("record.json")]
    ok = [r for r in records if r["status"] == "ok"]
    for record in ok:
        rows = [row for case in record["cases"] for row in case["prompts"]]
        wall += record["timings"]["stage_wall_s"]
        decoding += record["timings"]["references_s"] + sum(r.get("decode_s", 0) for r in rows)
        comparing += sum(r.get("compare_s", 0) for r in rows)
    if not ok:
        print("  serving stage: no ok serving record (is serving enabled in the config?)")
        return
    line(
        "serving stage / its decoding",
        wall / decoding,
        "x",
        1.10,
        "lower",
        f"{len(ok)} jobs: {wall:.1f} s of stage wall time, {decoding:.1f} s decoding, "
        f"{comparing:.1f} s comparing",
    )


def stage_seconds(workdir: Path) -> dict[str, float]:
    """Job wall seconds per stage: the per-combination stages' from their ok records (each
    times its own stage, qdiff.engine.stage.job_usage), the others' from their benchmark files."""
    from qdiff.core.stages import STAGES

    totals: dict[str, float] = {}
    for stage in STAGES.values():
        for path in (workdir / stage.folder).rglob("record.json"):
            seconds = json.loads(path.read_text())["timings"].get("stage_wall_s", 0.0)
            totals[stage.name] = totals.get(stage.name, 0.0) + seconds
    for tsv in (workdir / "results/benchmarks").rglob("*.tsv"):
        rule = tsv.relative_to(workdir / "results/benchmarks").parts[0]
        seconds = float(tsv.read_text().splitlines()[1].split("\t")[0])
        totals[rule] = totals.get(rule, 0.0) + seconds
    return totals


def pipeline_against_floor(runs: Path, cores: int, repeat: int) -> None:
    """The experiment in ``runs`` (its model files made) from a clean results/, then its
    inference floor, ``repeat`` times alternately, so that a shared machine's slow spells
    fall on both; prints the times and the ratio."""
    pipelines, recorded, floors = [], [], []
    for _ in range(repeat):
        shutil.rmtree(runs / "results", ignore_errors=True)
        seconds, out = snakemake(runs, cores)
        pipelines.append(seconds)
        inference, n_records = recorded_inference(runs)
        recorded.append(inference)
        floors.append(floor_seconds(runs))
    ran = job_counts(out)
    print(
        f"  runs only ({', '.join(f'{k} {v}' for k, v in ran.items())}): pipeline "
        f"{', '.join(f'{s:.1f}' for s in pipelines)} s, floor {', '.join(f'{s:.1f}' for s in floors)} s"
    )
    # the ratio in two factors: what the pipeline adds around its inference, and how its
    # inference (as its records time it) compares with the floor's, measured minutes apart
    # (a tiny model's inference can round to nothing: three decimals, and no ratio over 0)
    around = median([p / r for p, r in zip(pipelines, recorded, strict=True) if r > 0] or [nan])
    inside = median([r / f for r, f in zip(recorded, floors, strict=True) if f > 0] or [nan])
    print(
        f"  the pipelines' own records ({n_records} ok run records): "
        f"{', '.join(f'{s:.3f}' for s in recorded)} s of inference; pipeline / its records "
        f"{around:.2f}x (Snakemake, process starts, comparisons, report), its records / "
        f"floor {inside:.2f}x (medians)"
    )
    # each pipeline over the floor measured right after it: a shared machine's drift over
    # minutes cancels in a pair, so the median of the pairs is the figure
    ratios = sorted(p / f for p, f in zip(pipelines, floors, strict=True))
    line(
        "pipeline / inference floor",
        median(ratios),
        "x",
        1.15,
        "lower",
        f"median of {repeat} alternations: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"least over least {min(pipelines) / min(floors):.2f}",
    )


def experiment(args: argparse.Namespace, workdir: Path) -> tuple[Path, float, str]:
    """The experiment of ``--config`` run in ``workdir``/experiment: its folder, and the
    seconds and output of its snakemake command."""
    from qdiff.core.text import DEFAULT_TEXT

    full = workdir / "experiment"
    write_config(full, experiment_config(args.config))
    texts = full / DEFAULT_TEXT.parent  # the default text's folder, which ./setup fills
    if not texts.exists():
        texts.parent.mkdir(parents=True, exist_ok=True)
        texts.symlink_to(REPO / DEFAULT_TEXT.parent)
    print(f"experiment: {args.config} in {full}", flush=True)
    first, out = snakemake(full, args.cores)
    return full, first, out


def text_only(args: argparse.Namespace, workdir: Path) -> None:
    """``--only text``: the experiment, then the text stage's lines alone."""
    full, first, out = experiment(args, workdir)
    print(f"  experiment: {sum(job_counts(out).values())} jobs in {first:.1f} s")
    text_stage(full, args.llama_perplexity)


def pipeline(args: argparse.Namespace, workdir: Path) -> None:
    full, first, out = experiment(args, workdir)
    counts = job_counts(out)
    noop, noop_min, out = median_wall(full, args.cores, 5)
    assert "Nothing to be done" in out, "the rerun of a complete experiment planned jobs"
    stages = stage_seconds(full)
    print(
        f"  full experiment: {sum(counts.values())} jobs in {first:.1f} s;"
        " job seconds by stage (per-combination stages as their records time them): "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1]))
    )

    serving_overhead(full)
    text_stage(full, args.llama_perplexity)

    runs = workdir / "runs-only"
    shutil.copytree(full / "resources", runs / "resources", copy_function=os.link)
    write_config(runs, runs_only(experiment_config(args.config)))
    snakemake(runs, args.cores, "--dry-run")  # the first parse hashes the model files
    pipeline_against_floor(runs, args.cores, args.repeat)
    line("no-op rerun", noop, "s", 2.0, "lower", f"median of 5; least {noop_min:.2f} s")
    # Snakemake's own start-up, the part of a no-op rerun that is not qdiff's
    empty = workdir / "one-rule"
    empty.mkdir(exist_ok=True)
    (empty / "Snakefile").write_text('rule a:\n    output: "a"\n    shell: "touch {output}"\n')
    snakemake(empty, args.cores, snakefile=empty / "Snakefile")
    own, own_min, _ = median_wall(empty, args.cores, 5, snakefile=empty / "Snakefile")
    print(
        f"  Snakemake's own no-op (a one-rule workflow): {own:.2f} s, median of 5; "
        f"least {own_min:.2f} s"
    )


# ---- 3: comparison throughput ----


def synthetic_model(folder: Path, runs: int, prompts: int, vocab: int) -> dict[str, Any]:
    """Records and logits of ``runs`` runs of one model, as the run stage writes them."""
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.normal(scale=3.0, size=(prompts, vocab)).astype(np.float32)
    files = {}
    for r in range(runs):
        device = f"dev{r}"
        out = folder / device
        out.mkdir(parents=True, exist_ok=True)
        logits = base + rng.normal(scale=0.05, size=base.shape).astype(np.float32)
        np.save(out / "logits.npy", logits)
        record = {
            "model": "synthetic",
            "device": device,
            "dequant": "none",
            "status": "ok",
            "settings": {"backend": "cpu", "threads": r},
            "prompts": [
                {"id": f"p{k}", "tokens": [1, 2, 3], "text": "", "n_prompt_tokens": 4}
                for k in range(prompts)
            ],
        }
        (out / "record.json").write_text(json.dumps(record))
        files[f"{device}.none"] = {
            "record": str(out / "record.json"),
            "logits": str(out / "logits.npy"),
        }
    return files


def throughput(files: dict[str, dict[str, str]], model: str) -> tuple[int, float]:
    """(prompt-pairs, seconds) of comparing every pair of ``files`` (label -> paths)."""
    from qdiff.compare.pairs import RunFiles, compare_model
    from qdiff.core.labels import Combination, Pair

    runs = {
        Combination.parse(model, label): RunFiles(
            Path(f["record"]),
            Path(f["logits"]) if "logits" in f else None,  # first_step_logits: top_k
            Path(f["forced_record"]) if "forced_record" in f else None,
            Path(f["forced"]) if "forced" in f else None,
        )
        for label, f in files.items()
    }
    pairs = [Pair(a, b) for a, b in itertools.combinations(runs, 2)]
    start = time.perf_counter()
    results = compare_model(pairs, runs)
    seconds = time.perf_counter() - start
    assert all(r["status"] == "ok" for r in results), [r.get("reason") for r in results]
    return sum(r["summary"]["n_prompts"] for r in results), seconds


def compare_in_child(files: dict[str, dict[str, str]], model: str) -> tuple[int, float]:
    """``throughput`` in a fresh process with one thread for numpy and its BLAS."""
    one_thread = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    n, seconds = child(
        "_compare", json.dumps(files), model, env={**os.environ, **dict.fromkeys(one_thread, "1")}
    )
    return int(n), float(seconds)


def experiment_runs(experiment: Path) -> tuple[str, dict[str, dict[str, str]]] | None:
    """The experiment's model with the largest data files (the largest vocabulary), and
    its runs' files, or None when the experiment has not run here."""
    from qdiff.core.config import validate
    from qdiff.core.stages import FORCED, RUN

    if not (experiment / RUN.folder).is_dir():
        return None
    config = yaml.safe_load((experiment / "config/config.yaml").read_text())
    runs, _ = validate(config, experiment)

    measured = RUN if runs.keeps_data(RUN) else FORCED  # first_step_logits: top_k keeps none

    def data_bytes(model: str) -> int:
        return max((experiment / measured.data(c)).stat().st_size for c in runs.combinations(model))

    model = max(runs.run_models, key=data_bytes)
    files = {}
    for combo in runs.combinations(model):
        entry = {"record": RUN.record(combo)}
        if runs.keeps_data(RUN):
            entry["logits"] = RUN.data(combo)
        if runs.forcing_enabled:
            entry |= {"forced_record": FORCED.record(combo), "forced": FORCED.data(combo)}
        files[combo.label] = {key: str(experiment / path) for key, path in entry.items()}
    return model, files


def compare(args: argparse.Namespace, workdir: Path) -> None:
    synthetic = workdir / "synthetic"
    files = synthetic_model(synthetic, args.compare_runs, args.compare_prompts, GEMMA_VOCAB)
    shape = f"{args.compare_runs} runs x {args.compare_prompts} prompts x {GEMMA_VOCAB:,} logits"
    compare_line(f"synthetic, {shape}", files, "synthetic")
    shutil.rmtree(synthetic)
    found = experiment_runs(workdir / "experiment")  # the pipeline part's, if it ran
    if found:
        model, files = found
        compare_line(f"{model}, its {len(files)} runs with teacher forcing", files, model)


COMPARE_PROCESSES = 5  # a small model's comparison lasts a fraction of a second: a burst
# of a shared machine's neighbours can halve one sample, so the median needs several


def compare_line(what: str, files: dict[str, dict[str, str]], model: str) -> None:
    """Prompt-pairs per second of ``COMPARE_PROCESSES`` fresh processes, one thread each:
    the median."""
    rates = sorted(
        n / seconds
        for n, seconds in (compare_in_child(files, model) for _ in range(COMPARE_PROCESSES))
    )
    print(f"  compare {what}, one thread: {', '.join(f'{r:.0f}' for r in rates)} prompt-pairs/s")
    line(
        "compare throughput",
        median(rates),
        "pairs/s/core",
        500,
        "higher",
        f"prompt-pairs; median of {COMPARE_PROCESSES}",
    )


# ---- 4: planning a large matrix ----


def planning(args: argparse.Namespace, workdir: Path) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from tinymodel import write_tiny_llama

    n_models, n_devices, n_dequant, n_prompts = args.matrix
    big = workdir / "matrix"
    (big / "models").mkdir(parents=True)
    config = {
        "models": {
            f"m{i}": {"path": str(write_tiny_llama(big / f"models/m{i}.gguf", seed=i))}
            for i in range(n_models)
        },
        "devices": {
            f"cpu{j}": {"backend": "cpu", "threads": 1 + j % 2, "n_batch": 64 * (1 + j)}
            for j in range(n_devices)
        },
        "dequant": ["none", "f32", "f16"][:n_dequant],
        "prompts": [{"id": f"p{k}", "text": f"Prompt number {k}"} for k in range(n_prompts)],
    }
    write_config(big, config)
    plan = ("--dry-run", "--quiet", "rules")  # the job counts, not each job's details
    cold, out = snakemake(big, args.cores, *plan)
    warm, warm_min, out = median_wall(big, args.cores, 3, *plan)
    jobs = job_counts(out)
    total = sum(jobs.values())
    shape = "x".join(map(str, args.matrix))
    print(f"  planning {shape}: {total} jobs ({', '.join(f'{k} {v}' for k, v in jobs.items())})")
    line("planning, first time", cold, "s", 5.0, "lower", "hashes the models")
    line("planning", warm, "s", 5.0, "lower", f"median of 3; least {warm_min:.2f} s")


def executor_plugins() -> str:
    """The installed executor plugins: they are part of every ``snakemake`` call's start."""
    from importlib.metadata import distributions

    prefix = "snakemake-executor-plugin-"
    names = {d.metadata["Name"].lower().replace("_", "-") for d in distributions()}
    return (
        ", ".join(sorted(n.removeprefix(prefix) for n in names if n.startswith(prefix))) or "none"
    )


# the parts that run in a fresh process (``child``): what each prints, from its arguments
CHILDREN: dict[str, Callable[[list[str]], str]] = {
    "_floor": lambda a: str(inference_floor(Path(a[0]))),
    "_text_interleaved": lambda a: json.dumps(text_interleaved(Path(a[0]))),
    "_perplexity": lambda a: json.dumps(perplexity_interleaved(Path(a[0]), a[1])),
    "_compare": lambda a: " ".join(map(str, throughput(json.loads(a[0]), a[1]))),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=CORES)
    parser.add_argument("--config", type=Path, default=REPO / "config/config.yaml")
    parser.add_argument("--workdir", type=Path, help="keep everything here (default: temporary)")
    parser.add_argument(
        "--matrix",
        type=lambda s: tuple(int(x) for x in s.split("x")),
        default=MATRIX,
        help="models x devices x dequant x prompts of the planned matrix "
        f"(default {'x'.join(map(str, MATRIX))})",
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="pipeline and floor runs, alternately (default 5)"
    )
    parser.add_argument(
        "--llama-perplexity",
        type=Path,
        help="a llama-perplexity built from the llama.cpp that llama-cpp-python vendors "
        "(docs/results/perplexity/validate.sh builds one): the text stage is timed against it",
    )
    parser.add_argument("--compare-runs", type=int, default=30)
    parser.add_argument("--compare-prompts", type=int, default=8)
    parser.add_argument(
        "--only",
        choices=("pipeline", "text", "compare", "planning", "exact-text"),
        action="append",
        help="run only these parts (repeatable); text: the experiment and the text stage's "
        "lines; exact-text reads the records of a finished run in --workdir",
    )
    args = parser.parse_args()
    args.config = args.config.resolve()
    if args.llama_perplexity:
        args.llama_perplexity = args.llama_perplexity.resolve()
    return args


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in CHILDREN:
        print(CHILDREN[sys.argv[1]](sys.argv[2:]))
        return
    args = parse_args()
    parts = args.only or ["pipeline", "compare", "planning"]
    if "exact-text" in parts and not args.workdir:
        sys.exit("--only exact-text reads a finished run's records: give its --workdir")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="qdiff-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    from qdiff.engine.provenance import machine

    print(f"qdiff benchmark on {json.dumps(machine())}")
    print(f"Snakemake's executor plugins, each imported at every start: {executor_plugins()}")
    print(f"snakemake --cores {args.cores}; scratch directory {workdir}")
    for part in parts:
        parts_by_name = {
            "pipeline": pipeline,
            "text": text_only,
            "compare": compare,
            "planning": planning,
            "exact-text": exact_text_of_a_run,
        }
        parts_by_name[part](args, workdir)
    if not args.workdir:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
