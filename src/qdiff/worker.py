"""The isolated child process that runs one combination: ``python -m qdiff.worker SPEC OUT``.

It is the only process that runs inference, so a segfault or abort inside llama.cpp
kills this process alone; the parent (qdiff.run) records it. On success it writes
``OUT/record.json`` and the mode's data file (``qdiff.run.DATA_FILES``: first-step
``logits.npy`` of a generation, ``forced.npz`` of a teacher-forced pass); on a handled
failure ``OUT/error.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from qdiff import engine, provenance
from qdiff import forcing as forcing_lib
from qdiff.io import load_array, load_arrays, read_json, save_array, save_arrays, write_json
from qdiff.llamalog import error_lines, parse_placement, placement_problem
from qdiff.run import EXIT_ERROR, EXIT_MISPLACED, EXIT_OK, EXIT_UNAVAILABLE
from qdiff.settings import DeviceSettings


class WorkerFailure(Exception):
    def __init__(self, kind: str, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.kind = kind
        self.exit_code = exit_code


def _prompt_tokens(model: engine.LoadedModel, text: str, chat: bool | str) -> list[int]:
    if chat is False:
        return model.tokenize(text, parse_special=False)
    wrapped = model.apply_chat_template(text, chat if isinstance(chat, str) else None)
    return model.tokenize(wrapped, parse_special=True)


def _load(
    spec: dict[str, Any], log: engine.LlamaLog
) -> tuple[engine.LoadedModel, dict[str, Any]]:
    """Load the combination's model on its device, or raise WorkerFailure saying why not."""
    settings = DeviceSettings.from_config(spec["settings"])
    devices = engine.backend_devices()
    usable = engine.devices_for_backend(settings.backend, devices)
    if not usable:
        found = ", ".join(f"{d.name} ({d.registry})" for d in devices) or "none"
        raise WorkerFailure(
            "unavailable",
            f"this llama-cpp-python build cannot use the {settings.backend} backend here "
            f"(backend devices found: {found}); see README 'GPU backends'",
            EXIT_UNAVAILABLE,
        )
    model_path = Path(spec["model_path"])
    try:
        loaded = engine.LoadedModel(model_path, settings, spec["generation"]["n_ctx"])
    except engine.ModelLoadError as exc:
        reasons = "; ".join(error_lines(log.text)) or "no reason in the llama.cpp log"
        raise WorkerFailure(
            "model", f"{exc.args[0].split(':')[0]}: {reasons}. Is {model_path.name} a "
            "complete GGUF file of an architecture this llama.cpp supports?"
        ) from None
    placement = parse_placement(log.text)
    if problem := placement_problem(settings.backend, placement, [d.name for d in usable]):
        loaded.close()
        raise WorkerFailure("misplaced", problem, EXIT_MISPLACED)
    return loaded, provenance.run_provenance(spec, loaded, placement, usable, devices)


def generate(spec: dict[str, Any], out: Path, log: engine.LlamaLog) -> None:
    """Greedy generation from every prompt: record.json and first-step logits.npy."""
    generation = spec["generation"]
    loaded, prov = _load(spec, log)
    with loaded:
        results = []
        for prompt in spec["prompts"]:
            tokens = _prompt_tokens(loaded, prompt["text"], generation["chat_template"])
            gen = loaded.generate(tokens, generation["n_tokens"])
            results.append((prompt, gen))
            print(
                f"[qdiff] prompt {prompt['id']}: {len(gen.tokens)} tokens, "
                f"{1000 * np.mean(gen.decode_seconds or [0]):.1f} ms/token",
                file=sys.stderr,
                flush=True,
            )
        record = provenance.success_record(spec, results, loaded, prov)
    save_array(out / "logits.npy", np.stack([g.first_logits for _, g in results]))
    write_json(out / "record.json", record)


def force(spec: dict[str, Any], out: Path, log: engine.LlamaLog) -> None:
    """Teacher forcing (qdiff.forcing): every prompt fed the teacher's greedy output."""
    forcing = spec["forcing"]
    sequences = forcing["sequences"]  # prompt id -> the teacher's generated tokens
    teacher = load_arrays(Path(forcing["teacher_data"])) if forcing["teacher_data"] else None
    own_first = load_array(Path(forcing["own_logits"]))  # this combination's free run
    prompts = spec["prompts"]
    max_len = max((len(sequences[p["id"]]) for p in prompts), default=0)
    loaded, prov = _load(spec, log)
    top_k = teacher["slice_ids"].shape[-1] if teacher else min(forcing["top_k"], loaded.n_vocab)
    recorder = forcing_lib.ForcedRecorder(len(prompts), max_len, top_k)
    seconds, positions, first_step_same = 0.0, 0, 0
    with loaded:
        for p, prompt in enumerate(prompts):
            tokens = _prompt_tokens(loaded, prompt["text"], spec["generation"]["chat_template"])
            forced = sequences[prompt["id"]]
            recorder.begin_prompt(p, len(tokens), forced)

            def record(t: int, logits: np.ndarray, p: int = p) -> None:
                recorder.add(p, t, logits, teacher["slice_ids"][p, t] if teacher else None)

            seconds += loaded.force(tokens, forced, record)
            positions += len(forced)
            if own_first.shape[0] == len(prompts) and forced:
                first_step_same += int(
                    recorder.arrays["digest"][p, 0] == forcing_lib.digest(own_first[p])
                )
        arrays = recorder.arrays
        leading = np.unique(arrays["top_ids"][arrays["top_ids"] >= 0])
        pieces = {int(t): loaded.detokenize([int(t)]) for t in leading}  # for the report
    own_choice = arrays["top_ids"][..., 0] == arrays["tokens"]
    record = {
        **provenance.record_head(spec, "ok"),
        "teacher": forcing["teacher"],
        "top_k": int(top_k),
        "prompt_ids": [p["id"] for p in prompts],
        "n_positions": positions,
        # equal to n_positions on the teacher itself: forcing follows generation's path
        "agrees_with_teacher_tokens": int(own_choice[arrays["tokens"] >= 0].sum()),
        # forced position 0 vs this combination's own free run: the same computation
        "first_step_identical_to_free_run": first_step_same,
        "pieces": pieces,
        "timings": {
            "load_s": round(loaded.load_seconds, 4),
            "forced_ms_per_token": round(1000 * seconds / max(positions, 1), 3),
        },
        "provenance": prov,
    }
    save_arrays(out / "forced.npz", arrays)
    write_json(out / "record.json", record)


def capture(spec: dict[str, Any], out: Path, log: engine.LlamaLog) -> None:
    """Tensor capture (qdiff.localise): the named intermediate tensors of each capture
    prompt's forward pass, read through llama.cpp's eval callback. The pass runs once
    without and once with the callback; a difference in the logits is recorded."""
    settings = spec["capture"]
    texts = {p["id"]: p["text"] for p in spec["prompts"]}
    capturer = engine.TensorCapture(settings["tensors"])
    arrays: dict[str, np.ndarray] = {}
    prompts = []
    loaded, prov = _load(spec, log)
    with loaded:
        for i, prompt_id in enumerate(settings["prompts"]):
            tokens = _prompt_tokens(loaded, texts[prompt_id], spec["generation"]["chat_template"])
            plain, plain_s = loaded.prefill(tokens)
            loaded.set_eval_callback(capturer.callback)
            capturer.start(len(tokens))
            observed, captured_s = loaded.prefill(tokens)
            loaded.set_eval_callback(None)
            if capturer.error is not None:
                raise capturer.error
            tensors = []
            for k, t in enumerate(capturer.tensors):
                arrays[f"p{i}.t{k}"] = t.values
                tensors.append({
                    "key": f"p{i}.t{k}", "name": t.name, "op": t.op, "type": t.type,
                    "ne": t.ne, "weight": t.weight, "kept": t.kept,
                })
            prompts.append({
                "id": prompt_id,
                "n_prompt_tokens": len(tokens),
                "tensors": tensors,
                # capturing must not change what it observes
                "logits_identical_with_capture": bool(np.array_equal(plain, observed)),
                "logits_max_abs_with_capture": float(np.abs(plain - observed).max()),
                "prefill_ms": round(1000 * plain_s, 3),
                "prefill_ms_captured": round(1000 * captured_s, 3),
            })
            print(f"[qdiff] captured {len(tensors)} tensors of prompt {prompt_id}",
                  file=sys.stderr, flush=True)
    record = {
        **provenance.record_head(spec, "ok"),
        "capture": settings,
        "prompts": prompts,
        "timings": {"load_s": round(loaded.load_seconds, 4)},
        "provenance": prov,
    }
    save_arrays(out / "capture.npz", arrays)
    write_json(out / "record.json", record)


MODES = {"generate": generate, "force": force, "capture": capture}


def main(argv: list[str]) -> int:
    spec_path, out = Path(argv[0]), Path(argv[1])
    spec = read_json(spec_path)
    log = engine.init_backend()
    try:
        MODES[spec.get("mode", "generate")](spec, out, log)
        return EXIT_OK
    except WorkerFailure as exc:
        write_json(out / "error.json", {"kind": exc.kind, "message": str(exc)})
        return exc.exit_code
    except Exception as exc:  # any other error in this run: report it, do not hide it
        write_json(
            out / "error.json", {"kind": "error", "message": f"{type(exc).__name__}: {exc}"}
        )
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
