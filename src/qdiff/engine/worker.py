"""The isolated child process that runs one stage of one combination:
``python -m qdiff.engine.worker SPEC OUT``, or ``main([SPEC, OUT])`` in a child that qdiff.engine.stage
forks (on Linux, ``qdiff.jobs.fork``: the same fresh process, without a new interpreter).

It is the only process that runs inference, so a segfault or abort inside llama.cpp kills
this process alone; the parent (qdiff.engine.stage) records it. On success it writes
``OUT/record.json`` and its stage's data file (qdiff.core.stages); on a handled failure
``OUT/error.json``. llama.cpp's ERROR-level messages go to ``OUT/errors.txt`` as they come.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.core import records
from qdiff.core.forced import (
    DIGEST_ALGORITHM,
    ForcedRecorder,
    digest,
    forced_text,
    same_digest_algorithm,
)
from qdiff.core.io import load_arrays, read_json, save_array, save_arrays, write_json
from qdiff.core.serving import Case
from qdiff.core.settings import DeviceSettings
from qdiff.core.stages import CAPTURE, FORCED, RECORD_FILE, RUN, SERVING, STAGES, TEXT
from qdiff.core.text import LEADING_KEPT, split, windows
from qdiff.engine import provenance, serving
from qdiff.engine.capture import TensorCapture
from qdiff.engine.devices import backend_devices, devices_for_backend, system_info
from qdiff.engine.llamalog import parse_placement, placement_problem
from qdiff.engine.log import LlamaLog, init_backend
from qdiff.engine.model import ContextError, Generation, LoadedModel, ModelLoadError
from qdiff.engine.stage import (
    ERROR_FILE,
    ERRORS_FILE,
    EXIT_ERROR,
    EXIT_MISPLACED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    PROGRESS_FILE,
)

# what a stage's function returns: its record, and its data file's array (.npy) or arrays (.npz)
StageOutput = tuple[dict[str, Any], np.ndarray | dict[str, np.ndarray]]


class WorkerFailure(Exception):
    def __init__(self, kind: str, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.kind = kind
        self.exit_code = exit_code


def _reasons(log: LlamaLog) -> str:
    return "; ".join(log.errors) or "llama.cpp logged no error"


def _load(spec: dict[str, Any], log: LlamaLog) -> tuple[LoadedModel, dict[str, Any]]:
    """Load the combination's model on its device, or raise WorkerFailure saying why not."""
    settings = DeviceSettings.from_config(spec["settings"])
    devices = backend_devices()
    usable = devices_for_backend(settings.backend, devices)
    if not usable:
        found = ", ".join(f"{d.name} ({d.registry})" for d in devices) or "none"
        raise WorkerFailure(
            "unavailable",
            f"this llama-cpp-python build cannot use the {settings.backend} backend here "
            f"(backend devices found: {found}); see docs/gpus-and-clusters.md",
            EXIT_UNAVAILABLE,
        )
    if settings.main_gpu >= len(usable):
        raise WorkerFailure(
            "unavailable",
            f"main_gpu {settings.main_gpu}: this machine has {len(usable)} {settings.backend} "
            f"device(s) ({', '.join(d.name for d in usable)})",
            EXIT_UNAVAILABLE,
        )
    chosen = usable[settings.main_gpu]  # the device this run uses, and proves it used
    model_path = Path(spec["model_path"])
    try:
        loaded = LoadedModel(
            model_path,
            settings,
            spec["generation"]["n_ctx"],
            chosen.handle if settings.on_gpu else None,
        )
    except ModelLoadError:
        raise WorkerFailure(
            "model",
            f"llama.cpp could not load {model_path.name}: {_reasons(log)}. Is it a "
            "complete GGUF file of an architecture this llama.cpp supports?",
        ) from None
    except ContextError:
        raise WorkerFailure(
            "context",
            f"llama.cpp refused a context for device {spec['device']!r} "
            f"(kv_cache_type {settings.kv_cache_type}, flash_attn {settings.flash_attn}, "
            f"n_ctx {spec['generation']['n_ctx']}): {_reasons(log)}. Change the device's "
            "settings in the config.",
        ) from None
    placement = parse_placement(log.text)
    if problem := placement_problem(settings.backend, placement, [chosen.name]):
        loaded.close()
        raise WorkerFailure("misplaced", problem, EXIT_MISPLACED)
    prov = provenance.run_provenance(
        spec, loaded.describe(), system_info(), placement, [chosen], devices
    )
    return loaded, prov


def _prompt_record(prompt: dict[str, Any], gen: Generation) -> dict[str, Any]:
    return {
        "id": prompt["id"],
        "prompt_text": prompt["text"],
        "n_prompt_tokens": len(gen.prompt_tokens),
        "prompt_tokens": gen.prompt_tokens,
        "tokens": gen.tokens,
        "text": gen.text,
        "stopped_at_eog": gen.stopped_at_eog,
        "top1_probs": gen.top1_probs,
        # bit-identity of the first step without its logits (first_step_logits: top_k), and
        # the forced pass's self-check
        "first_logits_digest": digest(gen.first_logits),
        "prompt_ms": round(1000 * gen.prompt_seconds, 3),
        "decode_ms_per_token": (
            round(1000 * float(np.mean(gen.decode_seconds)), 3) if gen.decode_seconds else None
        ),
    }


def _too_long(prompt: dict[str, Any], n_prompt: int, n_more: int, n_ctx: int) -> dict[str, Any]:
    """A prompt the context cannot hold with ``n_more`` tokens after it: left out, named."""
    return {
        "id": prompt["id"],
        "n_prompt_tokens": n_prompt,
        "reason": f"prompt {prompt['id']!r} has {n_prompt} tokens: with {n_more} more it needs "
        f"generation.n_ctx of at least {n_prompt + n_more}, and n_ctx is {n_ctx}; raise "
        "n_ctx or shorten the prompt",
    }


def _fitting(
    loaded: LoadedModel, prompts: list[dict[str, Any]], n_more: int, chat: Any
) -> tuple[list[tuple[dict[str, Any], list[int]]], list[dict[str, Any]]]:
    """(prompt, its tokens) of every prompt that fits the context with ``n_more`` tokens
    after it, and the prompts that do not (each named with why). A stage that fits none
    fails; one that fits some runs those, and its record lists the rest."""
    fitting, skipped = [], []
    for prompt in prompts:
        tokens = loaded.prompt_tokens(prompt["text"], chat)
        if len(tokens) + n_more > loaded.n_ctx:
            skipped.append(_too_long(prompt, len(tokens), n_more, loaded.n_ctx))
        else:
            fitting.append((prompt, tokens))
    if prompts and not fitting:
        raise WorkerFailure("prompts", "; ".join(s["reason"] for s in skipped))
    return fitting, skipped


def generate(spec: dict[str, Any], log: LlamaLog) -> StageOutput:
    """Greedy generation from every prompt: the record and the first-step logits (which
    the parent keeps or drops, qdiff.core.config's ``first_step_logits``)."""
    generation = spec["generation"]
    loaded, prov = _load(spec, log)
    results: list[tuple[dict[str, Any], Generation]] = []
    with loaded:
        fitting, skipped = _fitting(
            loaded, spec["prompts"], generation["n_tokens"], generation["chat_template"]
        )
        for i, (prompt, tokens) in enumerate(fitting):
            gen = loaded.generate(tokens, generation["n_tokens"])
            results.append((prompt, gen))
            print(
                f"[qdiff] prompt {prompt['id']} ({i + 1}/{len(fitting)}): "
                f"{len(gen.tokens)} tokens, {1000 * np.mean(gen.decode_seconds or [0]):.1f} ms/token",
                file=sys.stderr,
                flush=True,
            )
        load_s = loaded.load_seconds
    decode = [s for _, g in results for s in g.decode_seconds]
    record = {
        **records.record_head(spec, "ok", RUN.name),
        "prompts": [_prompt_record(p, g) for p, g in results],
        "digest_algorithm": DIGEST_ALGORITHM,  # of each prompt's first_logits_digest
        "skipped_prompts": skipped,
        "timings": {
            "load_s": round(load_s, 4),
            "prompt_ms_mean": round(
                1000 * float(np.mean([g.prompt_seconds for _, g in results])), 3
            )
            if results
            else None,
            "decode_ms_per_token": round(1000 * float(np.mean(decode)), 3) if decode else None,
        },
        "provenance": prov,
    }
    return record, np.stack([g.first_logits for _, g in results])


def _teacher(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray] | None]:
    """The teacher's run record and, on every other combination, the teacher's own forced
    arrays (whose slice ids everyone uses); WorkerFailure when the teacher did not run."""
    inputs, teacher = spec["inputs"], spec["forcing"]["teacher"]
    run = forced_text(read_json(Path(inputs["teacher_run"])), spec["forcing"].get("n_tokens"))
    forced = read_json(Path(inputs["teacher_record"])) if "teacher_record" in inputs else None
    for what, rec in (("run", run), ("teacher-forced pass", forced)):
        if rec is not None and rec["status"] != "ok":
            raise WorkerFailure(
                "teacher",
                f"the teacher {teacher}'s {what} is {rec['status']} "
                f"({records.failure_text(rec)}), so there is no sequence to force",
                EXIT_UNAVAILABLE,
            )
    return run, load_arrays(Path(inputs["teacher_data"])) if forced is not None else None


def force(spec: dict[str, Any], log: LlamaLog) -> StageOutput:
    """Teacher forcing (qdiff.compare.forced): every prompt fed the teacher's greedy output."""
    run, teacher = _teacher(spec)
    sequences = {p["id"]: p["tokens"] for p in run["prompts"]}
    # this combination's free run: its first steps' digests, for the self-check
    own_run = read_json(Path(spec["inputs"]["own_run"]))
    try:
        same_digest_algorithm(own_run, {"digest_algorithm": DIGEST_ALGORITHM})
    except ValueError as exc:
        raise WorkerFailure("inputs", f"{spec['inputs']['own_run']}: {exc}") from None
    own_first = {p["id"]: p["first_logits_digest"] for p in own_run["prompts"]}
    # the prompts the teacher ran (one it had to leave out, too long, every combination does)
    prompts = [p for p in spec["prompts"] if p["id"] in sequences]
    max_len = max((len(sequences[p["id"]]) for p in prompts), default=0)
    loaded, prov = _load(spec, log)
    top_k = (
        teacher["slice_ids"].shape[-1] if teacher else min(spec["forcing"]["top_k"], loaded.n_vocab)
    )
    recorder = ForcedRecorder(len(prompts), max_len, top_k)
    seconds, positions, first_step_same = 0.0, 0, 0
    with loaded:
        for p, prompt in enumerate(prompts):
            tokens = loaded.prompt_tokens(prompt["text"], spec["generation"]["chat_template"])
            forced = sequences[prompt["id"]]
            recorder.begin_prompt(p, len(tokens), forced)

            def keep(t: int, logits: np.ndarray, p: int = p) -> None:
                recorder.add(p, t, logits, teacher["slice_ids"][p, t] if teacher else None)

            seconds += loaded.force(tokens, forced, keep)
            positions += len(forced)
            if forced and prompt["id"] in own_first:
                first_step_same += int(recorder.arrays["digest"][p, 0] == own_first[prompt["id"]])
        arrays = recorder.arrays
        leading = np.unique(arrays["top_ids"][arrays["top_ids"] >= 0])
        pieces = {int(t): loaded.detokenize([int(t)]) for t in leading}  # for the report
        load_s = loaded.load_seconds
    own_choice = arrays["top_ids"][..., 0] == arrays["tokens"]
    record = {
        **records.record_head(spec, "ok", FORCED.name),
        "teacher": spec["forcing"]["teacher"],
        "forced_tokens": spec["forcing"].get("n_tokens"),  # of each teacher text; None: all
        "top_k": int(top_k),
        "prompt_ids": [p["id"] for p in prompts],
        "n_positions": positions,
        # equal to n_positions on the teacher itself: forcing follows generation's path
        "agrees_with_teacher_tokens": int(own_choice[arrays["tokens"] >= 0].sum()),
        # forced position 0 vs this combination's own free run: the same computation
        "first_step_identical_to_free_run": first_step_same,
        "pieces": pieces,
        "timings": {
            "load_s": round(load_s, 4),
            "forced_ms_per_token": round(1000 * seconds / max(positions, 1), 3),
        },
        "provenance": prov,
    }
    return record, arrays


def capture(spec: dict[str, Any], log: LlamaLog) -> StageOutput:
    """Tensor capture (qdiff.compare.localise): the named intermediate tensors of each capture
    prompt's forward pass, read through llama.cpp's eval callback (``_capture_prompt``)."""
    settings = spec["capture"]
    chosen = [p for p in spec["prompts"] if p["id"] in settings["prompts"]]
    capturer = TensorCapture(settings["tensors"])
    arrays: dict[str, np.ndarray] = {}
    prompts = []
    loaded, prov = _load(spec, log)
    with loaded:
        # one token more than the prompt: the shapes-only pass
        fitting, skipped = _fitting(loaded, chosen, 1, spec["generation"]["chat_template"])
        for i, (prompt, tokens) in enumerate(fitting):
            prompts.append(_capture_prompt(loaded, capturer, prompt["id"], tokens, f"p{i}", arrays))
        load_s = loaded.load_seconds
    record = {
        **records.record_head(spec, "ok", CAPTURE.name),
        "capture": settings,
        "prompts": prompts,
        "skipped_prompts": skipped,
        "timings": {"load_s": round(load_s, 4)},
        "provenance": prov,
    }
    return record, arrays


def _capture_prompt(
    loaded: LoadedModel,
    capturer: TensorCapture,
    prompt_id: str,
    tokens: list[int],
    prefix_key: str,
    arrays: dict[str, np.ndarray],
) -> dict[str, Any]:
    """One prompt's capture: a plain pass (the logits to check against), a shapes-only pass
    over one more token (so each tensor's token axis comes from the graph,
    qdiff.engine.capture), and the captured pass; its tensors go into ``arrays`` under
    ``<prefix_key>.t<k>``, and what happened into the returned row. A difference between the
    plain and captured logits is recorded.

    llama.cpp computes a prompt longer than the device's ``n_ubatch`` as several graphs; the
    one captured is the last, which holds the last token (the earlier ones are decoded with
    the capture idle, as the same ubatches)."""
    plain, plain_s = loaded.prefill(tokens)
    loaded.set_eval_callback(capturer.callback)
    last = loaded.last_ubatch(len(tokens))
    prefix, tail = tokens[:-last], tokens[-last:]
    # the shapes-only pass: one token more, or where the last ubatch is full, one less
    grows = loaded.last_ubatch(len(tokens) + 1) == last + 1
    probe = [*tail, tail[-1]] if grows else tail[:-1]
    if probe:
        _decode_idle(loaded, capturer, prefix)
        capturer.probe(len(probe) - last)
        loaded.extend(probe)
    _decode_idle(loaded, capturer, prefix)
    capturer.start(last, probed=bool(probe))
    observed, captured_s = loaded.extend(tail)
    loaded.set_eval_callback(None)
    if capturer.error is not None:
        raise capturer.error
    tensors = [
        _kept_tensor(t, f"{prefix_key}.t{k}", arrays) for k, t in enumerate(capturer.tensors)
    ]
    print(
        f"[qdiff] captured {len(tensors)} tensors of prompt {prompt_id}",
        file=sys.stderr,
        flush=True,
    )
    return {
        "id": prompt_id,
        "n_prompt_tokens": len(tokens),
        "n_captured_tokens": last,  # the last ubatch's (see above)
        "tensors": tensors,
        # capturing must not change what it observes
        "logits_identical_with_capture": bool(np.array_equal(plain, observed)),
        "logits_max_abs_with_capture": float(np.abs(plain - observed).max()),
        "prefill_ms": round(1000 * plain_s, 3),
        "prefill_ms_captured": round(1000 * captured_s, 3),
    }


def _kept_tensor(t: Any, key: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """A captured tensor's values into ``arrays[key]``; what it is, for the record."""
    arrays[key] = t.values
    return {
        "key": key,
        **{f: getattr(t, f) for f in ("name", "op", "type", "ne", "weight", "kept")},
    }


def _decode_idle(loaded: LoadedModel, capturer: TensorCapture, tokens: list[int]) -> None:
    """An empty cache, then ``tokens`` decoded with the capture reading nothing."""
    capturer.idle()
    loaded.clear()
    if tokens:
        loaded.extend(tokens)


def serve(spec: dict[str, Any], log: LlamaLog) -> StageOutput:
    """Serving conditions (qdiff.engine.serving): each needle decoded alone (the reference),
    then every case for every needle, compared step by step. A case that fails is recorded
    as failed and the others run; before each case, what is done so far goes to the
    progress file, so that a crash names the case it happened in and keeps the cases
    before it whole."""
    settings = spec["serving"]
    device = DeviceSettings.from_config(spec["settings"])
    cases = [Case(**{k: v for k, v in c.items() if k != "label"}) for c in settings["cases"]]
    own_run = read_json(Path(spec["inputs"]["own_run"]))
    loaded, prov = _load(spec, log)
    rows: dict[str, list[dict[str, Any]]] = {}
    with loaded:
        needles = serving.needles(loaded, spec, max(c.others for c in cases))
        start = time.perf_counter()
        alone = {pid: serving.reference(loaded, device, n) for pid, n in needles.items()}
        references_s = time.perf_counter() - start
        for case in cases:
            _progress(spec, rows, case)
            rows[case.id] = []
            for pid, needle in needles.items():
                row = serving.serve_case(loaded, device, case, needle, alone[pid], own_run, pid)
                rows[case.id].append(row)
                _report_case(case, row)
        load_s = loaded.load_seconds
    arrays = serving.step_arrays(cases, rows, len(needles), settings["n_tokens"])
    record = {
        **records.record_head(spec, "ok", SERVING.name),
        "serving": {k: v for k, v in settings.items() if k != "cases"},
        "cases": [{**c.as_dict(), "prompts": rows[c.id]} for c in cases],
        # each case row has its decode_s (contexts, prefills, decoding) and compare_s
        "timings": {"load_s": round(load_s, 4), "references_s": round(references_s, 4)},
        "provenance": prov,
    }
    return record, arrays


def _report_case(case: Case, row: dict[str, Any]) -> None:
    if row["status"] != "ok":
        said = f"{row['status']}: {row['reason']}"
    elif row.get("first_differing_step") is None and row.get("fork_step") is None:
        said = f"bit-identical over {row['n_steps']} steps"
    else:
        said = f"differs from step {row['first_differing_step']}, fork {row['fork_step']}"
    print(f"[qdiff] serving {case.id} {row['id']}: {said}", file=sys.stderr, flush=True)


def _progress(spec: dict[str, Any], rows: dict[str, list[dict[str, Any]]], current: Case) -> None:
    """What is done, and what runs now: read by the supervisor if this process dies."""
    if "progress_file" in spec:
        progress = {"current": f"case {current.id}", "done": rows, "serving": spec["serving"]}
        write_json(Path(spec["progress_file"]), progress)


def read_text(path: Path, sha256: str) -> str:
    """The configured text, checked against its sha256; WorkerFailure when it is not that text."""
    import hashlib

    data = path.read_bytes()
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise WorkerFailure(
            "text",
            f"{path} has sha256 {found}, not the configured text.sha256 {sha256}: "
            "fetch it again (./setup fetches the default text) or correct text.sha256",
        )
    # llama-perplexity's -f drops one trailing newline (common/arg.cpp)
    return data.decode("utf-8", errors="replace").removesuffix("\n")


def _teacher_windows(spec: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The teacher's text arrays (its windows and slice ids), or None on the teacher."""
    inputs = spec["inputs"]
    if "teacher_record" not in inputs:
        return None
    record = read_json(Path(inputs["teacher_record"]))
    if record["status"] != "ok":
        raise WorkerFailure(
            "teacher",
            f"the teacher {spec['text']['teacher']}'s text stage is {record['status']} "
            f"({records.failure_text(record)}), so there are no token ids to keep",
            EXIT_UNAVAILABLE,
        )
    return load_arrays(Path(inputs["teacher_data"]))


def score_windows(
    loaded: LoadedModel,
    recorder: ForcedRecorder,
    cut: list[list[int]],
    slice_ids: np.ndarray | None,
    scored: Callable[[int], None] = lambda w: None,
    overlap: bool | None = None,
) -> None:
    """Score every window of the text and record its scored positions (``slice_ids``: the
    teacher's, a window each, or None on the teacher itself); ``scored(w)`` after each
    window's scoring. With ``overlap`` (default: on a GPU) the CPU records a window while the
    GPU scores the next (at most two windows' logits held), so the recording's cost hides
    behind the scoring; on the CPU the two would share its cores, so each window is recorded
    before the next is scored."""
    overlap = loaded.device.on_gpu if overlap is None else overlap
    turns = 1 + overlap  # windows whose logits are held at once: one recorded, one scored
    with ExitStack() as held, ThreadPoolExecutor(1) as recording:
        if cut and len(cut[0]) <= loaded.device.n_batch:
            # a window is one batch: its logits are read in llama.cpp's output buffer, as
            # llama-perplexity reads them, and a second context scores the next window
            where: list[dict[str, Any]] = [{"context": None}] + [
                {"context": held.enter_context(loaded.spare_context())} for _ in range(1, turns)
            ]
        else:
            # copied out batch by batch into buffers used again: fresh ones would cost their
            # page faults window after window (a window's rows: its head's last position onward)
            n_rows = len(cut[0]) - len(split(cut[0])[0]) + 1 if cut else 0
            where = [{"out": np.empty((n_rows, loaded.n_vocab), np.float32)} for _ in range(turns)]
        pending: Future[None] | None = None
        for w, window in enumerate(cut):
            head, forced = split(window)
            # the whole window, its last position's logits too, as llama-perplexity asks for
            # them: the same batch and output sizes, so the same kernels
            logits = loaded.score(window, len(head) - 1, **where[w % turns])
            logits = logits[: len(forced)]
            scored(w)
            if pending is not None:
                pending.result()
            recorder.begin_prompt(w, len(head), forced)
            ids = None if slice_ids is None else slice_ids[w]
            pending = recording.submit(recorder.add_rows, w, logits, ids)
            if not overlap:
                pending.result()
        if pending is not None:
            pending.result()


def score_text(spec: dict[str, Any], log: LlamaLog) -> StageOutput:
    """The text stage (qdiff.core.text): the text's windows scored as llama-perplexity
    scores them, every scored position kept as a teacher-forced one is, at the teacher's
    token ids."""
    settings = spec["text"]
    text = read_text(Path(spec["inputs"]["text"]), settings["sha256"])
    teacher = _teacher_windows(spec)
    loaded, prov = _load(spec, log)
    with loaded:
        tokens = loaded.tokenize(text, parse_special=False)
        cut = windows(tokens, settings["n_ctx"], settings["windows"], loaded.bos_added())
        if not cut:
            raise WorkerFailure(
                "text",
                f"the text is {len(tokens)} tokens, less than one window of "
                f"text.n_ctx = {settings['n_ctx']}: lower text.n_ctx or give a longer text",
            )
        if teacher is not None and not np.array_equal(teacher["window_tokens"], cut):
            raise WorkerFailure(
                "tokenizer",
                f"this file tokenizes the text otherwise than the teacher "
                f"{settings['teacher']}: the two score different tokens",
            )
        top_k = (
            teacher["slice_ids"].shape[-1] if teacher else min(settings["top_k"], loaded.n_vocab)
        )
        recorder = ForcedRecorder(len(cut), len(split(cut[0])[1]), top_k, n_top=LEADING_KEPT)
        start = time.perf_counter()
        score_windows(
            loaded,
            recorder,
            cut,
            teacher["slice_ids"] if teacher else None,
            lambda w: print(
                f"[qdiff] text: window {w + 1} of {len(cut)} scored", file=sys.stderr, flush=True
            ),
        )
        seconds = time.perf_counter() - start
        load_s = loaded.load_seconds
    n_scored = int(recorder.arrays["lengths"].sum())
    record = {
        **records.record_head(spec, "ok", TEXT.name),
        "teacher": settings["teacher"],
        "top_k": int(top_k),
        "n_text_tokens": len(tokens),
        "n_windows": len(cut),
        "n_scored": n_scored,
        "timings": {
            "load_s": round(load_s, 4),
            "seconds": round(seconds, 3),
            "tokens_per_s": round(len(cut) * settings["n_ctx"] / max(seconds, 1e-9), 1),
        },
        "provenance": prov,
    }
    return record, {**recorder.arrays, "window_tokens": np.array(cut, np.int32)}


# what each stage of qdiff.core.stages runs (tests/test_stages.py: one function a stage)
STAGE_FUNCTIONS: dict[str, Callable[[dict[str, Any], LlamaLog], StageOutput]] = {
    RUN.name: generate,
    FORCED.name: force,
    CAPTURE.name: capture,
    SERVING.name: serve,
    TEXT.name: score_text,
}


def main(argv: list[str]) -> int:
    spec_path, out = Path(argv[0]), Path(argv[1])
    spec = {**read_json(spec_path), "progress_file": str(out / PROGRESS_FILE)}
    stage = STAGES[spec["stage"]]  # an unknown stage fails here, loudly
    log = init_backend(out / ERRORS_FILE)
    try:
        record, data = STAGE_FUNCTIONS[stage.name](spec, log)
        if isinstance(data, np.ndarray):
            save_array(out / stage.data_file, data)
        else:
            save_arrays(out / stage.data_file, data)
        write_json(out / RECORD_FILE, record)
        return EXIT_OK
    except WorkerFailure as exc:
        write_json(out / ERROR_FILE, {"kind": exc.kind, "message": str(exc)})
        return exc.exit_code
    except Exception as exc:  # any other error in this run: report it, do not hide it
        write_json(out / ERROR_FILE, {"kind": "error", "message": f"{type(exc).__name__}: {exc}"})
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
