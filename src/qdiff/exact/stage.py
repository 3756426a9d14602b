"""The exact stage's supervisor: the float64 engine runs in a child process of its own
(``python -m qdiff.exact.reference``), after its memory is estimated and checked, so that
the kernel's out-of-memory killer ends the child alone and the failure is recorded."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qdiff.core.io import read_json, write_json
from qdiff.core.records import failure_text
from qdiff.exact.reference import ERROR_FILE, UNSUPPORTED, Workload, memory_estimates
from qdiff.jobs import StageError, available_memory, child_outcome, spawn

GIB = 2**30


@dataclass(frozen=True)
class ExactInputs:
    model: Path
    info: dict[str, Any]  # the model file's sidecar
    run: dict[str, Any]  # the teacher's run record (prompts and tokens)
    forced_data: Path | None  # the teacher's forced pass's arrays (its slice ids), if any
    forced: dict[str, Any] | None  # and its record
    top_k: int
    # the rounding sources to emulate (name -> qdiff.exact.roundings.Roundings fields), or
    # None for the exact reference itself
    configs: dict[str, dict[str, Any]] | None = None
    n_top: int = 2  # own leading tokens kept per position (qdiff.core.forced)
    keep_first: bool = True  # each prompt's first step over the vocabulary (not for a text)

    def workload(self) -> Workload:
        """The rows of full-vocabulary logits the child holds at its peak, and the
        sequences it takes through the layers."""
        prompts = self.run["prompts"]
        if self.configs is not None:  # the prompts alone; the first step per prompt and set,
            # and a set's being computed (its product and its soft-capped copy)
            lengths = [len(p["prompt_tokens"]) for p in prompts]
            rows = (len(self.configs) + 2) * len(prompts)
        else:  # the prompts and their forced text; two rows per prompt and one text's
            lengths = [len(p["prompt_tokens"]) + len(p["tokens"]) for p in prompts]
            rows = 2 * len(prompts) + max(lengths, default=0)
        return Workload(rows, max(lengths, default=0), sum(lengths), self._kept_bytes())

    def _kept_bytes(self) -> int:
        """The recorder's arrays, (prompts, longest forced text, ...): float64 logits and
        int32 ids of the slice (the teacher's, whose ids the child also holds) and of the
        leading tokens, an int32 token and 3 values of 8 bytes; none for the emulations."""
        if self.configs is not None:
            return 0
        prompts = self.run["prompts"]
        forced = len(prompts) * max((len(p["tokens"]) for p in prompts), default=0)
        if self.forced_data is None or self.forced is None:
            return forced * (12 * (self.top_k + self.n_top) + 28)
        k = int(self.forced["top_k"])  # the teacher's slice: the recorder keeps its width
        return forced * (12 * (k + self.n_top) + 28 + 4 * k)


def exact_stage(
    inputs: ExactInputs,
    data_out: Path,
    log: Path,
    timeout_s: float,
    max_memory_gib: float | None,
    kind: str = "exact",
) -> dict[str, Any]:
    """Compute the exact reference (or the emulated roundings) into ``data_out``; its
    record's fields: ``status`` ok with
    the reference's figures and its memory estimate, or ``unsupported`` with the reason.
    Raises StageError (the job records it as failed) when an input did not run, the memory
    it needs is more than it may take, or the child fails (its signal, its error).
    ``kind``: the job's (exact, roundings or text), which names its working folders."""
    not_ok = [
        r
        for r in (inputs.info, inputs.run, inputs.forced)
        if r is not None and r.get("status", "ok") != "ok"
    ]
    if not_ok:
        raise StageError(f"no exact reference: {failure_text(not_ok[0])}")
    needed, layer_by_layer = memory_plan(inputs, max_memory_gib)
    with log.open("a") as out:  # before it starts, so a user watching the log knows
        mode = "one layer's weights at a time" if layer_by_layer else "every weight kept"
        out.write(f"qdiff: the float64 engine needs about {needed / GIB:.2f} GiB ({mode})\n")
    prefix = f".{kind}-"  # each kind of exact job's own: a killed job's are removed here
    for stale in data_out.parent.glob(f"{prefix}*"):  # left by a killed job
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=data_out.parent, prefix=prefix) as tmp:
        folder = Path(tmp)
        made = {"record": folder / "record.json", "data": folder / "exact.npz"}
        spec: dict[str, Any] = {
            "model": str(inputs.model),
            "teacher_run": inputs.run,
            "teacher_data": str(inputs.forced_data) if inputs.forced_data else None,
            "top_k": inputs.top_k,
            "n_top": inputs.n_top,
            "keep_first": inputs.keep_first,
            "configs": inputs.configs,
            "layer_by_layer": layer_by_layer,
            **{name: str(path) for name, path in made.items()},
        }
        write_json(folder / "spec.json", spec)
        code = spawn(
            [sys.executable, "-m", "qdiff.exact.reference", str(folder / "spec.json")],
            log,
            timeout_s,
        )
        handled = read_json(folder / ERROR_FILE) if (folder / ERROR_FILE).exists() else None
        if code == UNSUPPORTED and handled is not None:
            return {"status": "unsupported", "reason": handled["message"]}
        if code != 0:
            outcome = child_outcome(code, handled, "the float64 engine", timeout_s)
            raise StageError(
                f"{outcome['message']}; it was estimated to need {needed / GIB:.2f} GiB"
            )
        os.replace(made["data"], data_out)
        record = read_json(made["record"])
    return {"status": "ok", **record, "memory_estimate_mib": round(needed / 2**20, 1)}


def memory_plan(inputs: ExactInputs, max_memory_gib: float | None) -> tuple[int, bool]:
    """The engine's estimate in bytes, and whether it holds one layer's weights in float64
    at a time. The reference takes every sequence through a layer before the next, so it
    reads each weight once: it always does (half the memory, and freed pages reused rather
    than new ones touched). The emulations take the prompts through the layers once per
    set of roundings, so they keep every weight where that fits. Refused (StageError) when
    neither fits."""
    limit, what = (
        (max_memory_gib * GIB, "exact.max_memory_gib") if max_memory_gib else available_memory()
    )
    kept, by_layer = memory_estimates(inputs.model, inputs.workload())
    if inputs.configs is not None and kept <= limit:
        return kept, False
    if by_layer <= limit:
        return by_layer, True
    raise StageError(
        f"the float64 engine needs about {by_layer / GIB:.2f} GiB for "
        f"{inputs.info.get('file', inputs.model.name)} layer by layer ({kept / GIB:.2f} GiB "
        f"with every weight kept), and {what} allows {max(limit, 0) / GIB:.2f} GiB: free "
        "memory, set exact.max_memory_gib if this machine can give more than qdiff sees, "
        "or set exact.enabled: false"
    )
