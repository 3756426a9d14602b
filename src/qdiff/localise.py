"""Where two combinations part ways: tensor-by-tensor comparison of two captures.

A capture (``qdiff.worker.capture``) holds the named intermediate tensors of one prompt's
forward pass, in graph order, as llama.cpp names them (``attn_norm-3``, ``ffn_out-3``,
``l_out-3``, ``result_output``): the last token position's values. Two captures of the same
model are matched by name and occurrence (a name can repeat, e.g. ``norm-0``).

Per tensor: **max |Δ|**, **NMSE** = Σ(b−a)²/Σa² (as llama.cpp's test-backend-ops) and
**relative error** = max|Δ| / max|a|. Two positions are reported:

- the **first difference**: the first tensor that is not bit-identical;
- the **first divergence**: the first tensor whose NMSE exceeds ``FLOOR_FACTOR`` times the
  NMSE of a *floor pair* at the same tensor. The floor pair differs from the pair only in
  float rounding: the same two devices on the model's ``f32`` copy. Without a floor pair
  (or when the pair is itself the floor), the first difference is the answer.

The op at that tensor is named with its family (matmul with which weight type, attention,
norm, ...), so a user knows which kernel to look at.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.compare import label
from qdiff.io import load_arrays

FLOOR_FACTOR = 10.0
# Bump when the localisation's fields change (a param of the localise rule).
LOCALISE_FORMAT = 1
_LAYER = re.compile(r"-(\d+)$")
_WEIGHT_LAYER = re.compile(r"^blk\.(\d+)\.")
_ATTENTION_NAMES = re.compile(r"^(kq|kqv|__fattn__|fattn)")


def op_family(name: str, op: str, weight: str | None) -> str:
    """A short description of what the op at a tensor computes."""
    if op == "FLASH_ATTN_EXT" or name.startswith("__fattn__"):
        return "attention (flash-attention kernel)"
    if op == "SOFT_MAX" or _ATTENTION_NAMES.match(name):
        kernel = f", with {weight.split()[-1]} KV cache" if weight and "cache" in weight else ""
        return f"attention ({op.lower()}{kernel})"
    if op in ("MUL_MAT", "MUL_MAT_ID"):
        if not weight:
            return "matmul"
        tensor, _, wtype = weight.rpartition(" ")
        return f"matmul with {wtype} weights" + (f" ({tensor})" if name.endswith("(unnamed)") else "")
    if op in ("RMS_NORM", "NORM", "L2_NORM"):
        return "normalisation"
    if op == "MUL" and "norm" in name:
        return "normalisation (scale by weight)"
    if op == "ROPE":
        return "rotary position embedding"
    if op == "ADD":
        return "residual add" if name.startswith(("l_out", "ffn_inp")) else "add"
    if op == "GET_ROWS":
        return "embedding lookup" if name.startswith(("embd", "inp_embd")) else "row selection"
    if op in ("CPY", "CONT", "DUP"):
        return "copy"
    return op.lower()


def layer_of(name: str, weight: str | None = None) -> int | None:
    """The layer of a tensor: from its name ("ffn_out-3"), else from its weight ("blk.3.…")."""
    match = _LAYER.search(name) or _WEIGHT_LAYER.match(weight or "")
    return int(match[1]) if match else None


def _keyed(tensors: list[dict[str, Any]]) -> list[tuple[tuple[str, int], dict[str, Any]]]:
    seen: dict[str, int] = {}
    keyed = []
    for t in tensors:
        n = seen.get(t["name"], 0)
        seen[t["name"]] = n + 1
        keyed.append(((t["name"], n), t))
    return keyed


def _unmatched_before(keyed: list, matched: set) -> dict[tuple[str, int], list[str]]:
    """For each matched tensor, the tensors of the same graph between it and the previous
    matched one that the other graph lacks (e.g. soft_max vs a flash-attention kernel)."""
    before, pending = {}, []
    for key, t in keyed:
        if key in matched:
            before[key], pending = pending, []
        else:
            pending.append(f"{t['name']} ({op_family(t['name'], t['op'], t.get('weight'))})")
    return before


def tensor_rows(
    meta_a: list[dict[str, Any]], data_a: dict[str, np.ndarray],
    meta_b: list[dict[str, Any]], data_b: dict[str, np.ndarray],
) -> list[dict[str, Any]]:
    """Per matched tensor, in a's graph order: the differences between a and b, and the
    tensors only one graph computes just before it (a changed kernel or graph)."""
    keyed_a, keyed_b = _keyed(meta_a), _keyed(meta_b)
    b_by_key = dict(keyed_b)
    matched = {k for k, t in keyed_a if k in b_by_key and b_by_key[k]["kept"] == t["kept"]}
    only_a, only_b = _unmatched_before(keyed_a, matched), _unmatched_before(keyed_b, matched)
    rows = []
    for key, ta in keyed_a:
        if key not in matched:
            continue
        tb = b_by_key[key]
        a = data_a[ta["key"]].astype(np.float64)
        b = data_b[tb["key"]].astype(np.float64)
        if a.shape != b.shape or a.size == 0:
            continue
        delta = np.abs(b - a)
        scale = float(np.abs(a).max())
        rows.append({
            "index": len(rows),
            "name": ta["name"],
            "occurrence": key[1],
            "layer": layer_of(ta["name"], ta.get("weight")),
            "op": ta["op"],
            "op_b": tb["op"],
            "weight": ta.get("weight"),
            "family": op_family(ta["name"], ta["op"], ta.get("weight")),
            "only_a_before": only_a.get(key, []),
            "only_b_before": only_b.get(key, []),
            "identical": bool(np.array_equal(a, b)),
            "max_abs": float(delta.max()),
            "nmse": float((delta**2).sum() / max(float((a**2).sum()), np.finfo(float).tiny)),
            "rel_err": float(delta.max() / scale) if scale > 0 else float(delta.max()),
        })
    return rows


def localise(
    rows: list[dict[str, Any]], floor_rows: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The first differing tensor and the first one above the float-rounding floor."""
    floor = {(r["name"], r["occurrence"]): r["nmse"] for r in floor_rows or []}
    for r in rows:
        r["floor_nmse"] = floor.get((r["name"], r["occurrence"]))
    first_difference = next((r for r in rows if not r["identical"]), None)
    if floor_rows is None:
        first_divergence = first_difference
    else:
        first_divergence = next(
            (r for r in rows if r["floor_nmse"] is not None and r["nmse"] > 0
             and r["nmse"] > FLOOR_FACTOR * r["floor_nmse"]),
            None,
        )
    return {
        "n_tensors": len(rows),
        "first_difference": first_difference,
        "first_divergence": first_divergence,
        "rows": rows,
    }


def around(rows: list[dict[str, Any]], index: int, before: int = 4, after: int = 4) -> list[dict[str, Any]]:
    """The tensors just before and after ``index`` in graph order."""
    return rows[max(0, index - before): index + after + 1]


def floor_pair(a: str, b: str) -> tuple[str, str] | None:
    """The pair that differs from (a, b) only in float rounding: the same two devices on
    the f32 copy. None when the devices are the same or (a, b) is that pair already."""
    dev_a, dev_b = a.rpartition(".")[0], b.rpartition(".")[0]
    floor = (f"{dev_a}.f32", f"{dev_b}.f32")
    if dev_a == dev_b or floor == (a, b):
        return None
    return floor


def localise_model(
    captures: list[tuple[dict[str, Any], Path]],
    pairs: list[dict[str, Any]],
    configured: list[tuple[str, str]],
) -> dict[str, Any]:
    """Localise the model's largest pair and the configured pairs, on every captured prompt."""
    ok = {label(r): (r, path) for r, path in captures if r["status"] == "ok"}
    model = captures[0][0]["model"] if captures else None
    failed = {label(r): r.get("error", {}).get("message", r["status"])
              for r, _ in captures if r["status"] != "ok"}
    measured = [p for p in pairs if p["status"] == "ok" and p["a"] in ok and p["b"] in ok]
    chosen: list[tuple[str, str, str]] = []
    if measured:
        top = max(measured, key=lambda p: p["summary"]["max_abs"])
        chosen.append((top["a"], top["b"], "largest first-step max |Δ|"))
    for a, b in configured:
        if {a, b} not in [{x, y} for x, y, _ in chosen]:
            chosen.append((a, b, "named in config.capture.pairs"))
    data: dict[str, dict[str, np.ndarray]] = {}

    def arrays(combo: str) -> dict[str, np.ndarray]:
        if combo not in data:  # each capture file is read once
            data[combo] = load_arrays(ok[combo][1])
        return data[combo]

    results = []
    for a, b, why in chosen:
        entry: dict[str, Any] = {"a": a, "b": b, "why": why}
        missing = [x for x in (a, b) if x not in ok]
        if missing:
            entry["status"] = "n/a"
            entry["reason"] = "; ".join(f"{x}: {failed.get(x, 'not captured')}" for x in missing)
            results.append(entry)
            continue
        floor = floor_pair(a, b)
        if floor and not all(x in ok for x in floor):
            floor = None
        entry.update(status="ok", floor=list(floor) if floor else None, prompts=[])
        rec_a, rec_b = ok[a][0], ok[b][0]
        for i, (pa, pb) in enumerate(zip(rec_a["prompts"], rec_b["prompts"])):
            rows = tensor_rows(pa["tensors"], arrays(a), pb["tensors"], arrays(b))
            floor_rows = None
            if floor:
                fa, fb = ok[floor[0]][0]["prompts"][i], ok[floor[1]][0]["prompts"][i]
                floor_rows = tensor_rows(fa["tensors"], arrays(floor[0]), fb["tensors"], arrays(floor[1]))
            entry["prompts"].append({
                "prompt": pa["id"],
                "capture_changed_logits": [
                    x for x, p in ((a, pa), (b, pb)) if not p["logits_identical_with_capture"]
                ],
                **localise(rows, floor_rows),
            })
        results.append(entry)
    return {"model": model, "floor_factor": FLOOR_FACTOR, "pairs": results,
            "not_captured": failed}
