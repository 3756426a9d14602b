"""The isolated child process that runs one combination: ``python -m qdiff.worker SPEC OUT``.

It is the only process that runs inference, so a segfault or abort inside llama.cpp
kills this process alone; the parent (qdiff.run) records it. On success it writes
``OUT/record.json`` and ``OUT/logits.npy``; on a handled failure ``OUT/error.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from qdiff import engine, provenance
from qdiff.io import read_json, save_array, write_json
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


def run(spec: dict[str, Any], out: Path, log: engine.LlamaLog) -> None:
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
    generation = spec["generation"]
    model_path = Path(spec["model_path"])
    try:
        loaded = engine.LoadedModel(model_path, settings, generation["n_ctx"])
    except engine.ModelLoadError as exc:
        reasons = "; ".join(error_lines(log.text)) or "no reason in the llama.cpp log"
        raise WorkerFailure(
            "model", f"{exc.args[0].split(':')[0]}: {reasons}. Is {model_path.name} a "
            "complete GGUF file of an architecture this llama.cpp supports?"
        ) from None
    with loaded:
        placement = parse_placement(log.text)
        names = [d.name for d in usable]
        if problem := placement_problem(settings.backend, placement, names):
            raise WorkerFailure("misplaced", problem, EXIT_MISPLACED)
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
        record = provenance.success_record(
            spec, results, loaded, placement, usable, devices
        )
    save_array(out / "logits.npy", np.stack([g.first_logits for _, g in results]))
    write_json(out / "record.json", record)


def main(argv: list[str]) -> int:
    spec_path, out = Path(argv[0]), Path(argv[1])
    spec = read_json(spec_path)
    log = engine.init_backend()
    try:
        run(spec, out, log)
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
