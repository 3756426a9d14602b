"""Per-model sections about the runs themselves: status, placement, timings; the texts."""

from __future__ import annotations

from typing import Any

from qdiff.compare.pairs import label
from qdiff.report.fmt import code, num, table, text
from qdiff.report.view import ModelView


def _weights_in(record: dict[str, Any]) -> str:
    buffers = record.get("provenance", {}).get("placement", {}).get("model_buffers", {})
    return ", ".join(f"{text(k)} {num(v)} MiB" for k, v in buffers.items()) or "–"


def _repeats(record: dict[str, Any]) -> str:
    det = record.get("determinism")
    if det is None:
        return "–"
    if det["bit_identical_logits"] and det["identical_tokens"]:
        return f"{det['repeats']}× bit-identical"
    return f"{det['repeats']}× NOT identical: max |Δ| {num(det['max_abs_between_repeats'])}" + (
        "" if det["identical_tokens"] else ", text differs"
    )


def runs(view: ModelView) -> str:
    rows = []
    repeated = any("determinism" in r for r in view.records)
    for r in view.records:
        timings = r.get("timings", {})
        context = r.get("provenance", {}).get("llama_context", {})
        rows.append(
            {
                "combination": code(label(r)),
                "status": r["status"],
                "backend": r["settings"]["backend"],
                "weights in": _weights_in(r),
                "flash attn (llama.cpp)": text(context.get("flash_attn", "–")),
                "n_ubatch": text(context.get("n_ubatch", "–")),
                "load s": num(timings.get("load_s")),
                "prompt ms": num(timings.get("prompt_ms_mean")),
                "decode ms/token": num(timings.get("decode_ms_per_token")),
                **({"repeated runs": _repeats(r)} if repeated else {}),
            }
        )
    return table(rows)


def texts(view: ModelView) -> str:
    if not view.ok:
        return "_no combination of this model ran_"
    reference = view.ok[0]
    parts = []
    for pid, prompt in view.prompts.items():
        rows = []
        ref = next((p for p in reference["prompts"] if p["id"] == pid), None)
        for r in view.ok:
            run = next((p for p in r["prompts"] if p["id"] == pid), None)
            if run is None:
                continue
            same = ref is not None and run["tokens"] == ref["tokens"]
            rows.append(
                {
                    "combination": code(label(r)),
                    f"vs `{label(reference)}`": "same" if same else "differs",
                    "generated text": text(run["text"]),
                }
            )
        parts.append(f"**{code(pid)}**: {text(prompt)}\n\n{table(rows)}")
    return "\n\n".join(parts)
