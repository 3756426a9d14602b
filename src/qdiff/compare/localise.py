"""Where two combinations part ways: tensor-by-tensor comparison of two captures.

A capture (``qdiff.engine.worker.capture``) holds the named intermediate tensors of one prompt's
forward pass, in graph order, as llama.cpp names them (``attn_norm-3``, ``ffn_out-3``,
``l_out-3``, ``result_output``): the last token position's values. Two captures of the same
model are matched by name and occurrence (a name can repeat, e.g. ``norm-0``).

Per tensor: **max |Δ|**, **NMSE** = Σ(b−a)²/Σa² (as llama.cpp's test-backend-ops) and
**relative error** = max|Δ| / max|a|. Two positions are reported:

- the **first difference**: the first tensor that is not bit-identical;
- the **first divergence**: the first tensor whose NMSE exceeds ``FLOOR_FACTOR`` times the
  NMSE of a *floor pair* at the same tensor. The floor pair differs from the pair only in
  float rounding: the same two devices on the model's ``f32`` copy. Without a floor pair
  (or when the pair is itself the floor) no divergence is named, only the first difference;
  with one, how firm the choice is (``robustness``) is reported beside it.

Nothing compared is never "identical": a pair whose captures share no tensor (e.g. a
``capture.tensors`` pattern that matches nothing) reports that it compared nothing.

The op at that tensor is named with its family (matmul with which weight type, attention,
norm, ...), so a user knows which kernel to look at.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.compare.pairs import headline
from qdiff.core.io import load_arrays
from qdiff.core.labels import Combination, Pair
from qdiff.core.records import failure_text

FLOOR_FACTOR = 10.0
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
        return f"matmul with {wtype} weights" + (
            f" ({tensor})" if name.endswith("(unnamed)") else ""
        )
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
    before: dict[tuple[str, int], list[str]] = {}
    pending: list[str] = []
    for key, t in keyed:
        if key in matched:
            before[key], pending = pending, []
        else:
            pending.append(f"{t['name']} ({op_family(t['name'], t['op'], t.get('weight'))})")
    return before


def tensor_rows(
    meta_a: list[dict[str, Any]],
    data_a: dict[str, np.ndarray],
    meta_b: list[dict[str, Any]],
    data_b: dict[str, np.ndarray],
) -> list[dict[str, Any]]:
    """Per matched tensor, in a's graph order: the differences between a and b, and the
    tensors only one graph computes just before it (a changed kernel or graph)."""
    keyed_a, keyed_b = _keyed(meta_a), _keyed(meta_b)
    b_by_key = dict(keyed_b)
    matched = {k for k, t in keyed_a if k in b_by_key and b_by_key[k]["kept"] == t["kept"]}
    only_a, only_b = _unmatched_before(keyed_a, matched), _unmatched_before(keyed_b, matched)
    rows: list[dict[str, Any]] = []
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
        rows.append(
            {
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
            }
        )
    return rows


def _ratio(row: dict[str, Any]) -> float | None:
    """NMSE over the floor's NMSE at one tensor (inf where the floor is bit-identical)."""
    floor = row.get("floor_nmse")
    if floor is None or row["nmse"] == 0:
        return None
    return float("inf") if floor == 0 else row["nmse"] / floor


def _json_ratio(ratio: float | None) -> dict[str, Any]:
    """A ratio as JSON: infinite (the floor is bit-identical there) is said, not written."""
    infinite = ratio is not None and ratio == float("inf")
    return {"ratio": None if infinite else ratio, "floor_identical": infinite}


def _brief(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {
        "index": row["index"],
        "name": row["name"],
        "family": row["family"],
        **_json_ratio(_ratio(row)),
    }


def robustness(rows: list[dict[str, Any]], divergence: dict[str, Any]) -> dict[str, Any]:
    """How firm the first divergence is: its ratio to the floor against the threshold, the
    next tensor above the threshold, the tensor with the largest ratio, and the share of
    later tensors that stay above the threshold."""
    after = [r for r in rows if r["index"] > divergence["index"] and _ratio(r) is not None]
    above = [r for r in after if _ratio(r) > FLOOR_FACTOR]  # type: ignore[operator]
    ratio = _ratio(divergence)
    rated = [(x, r) for r in rows if (x := _ratio(r)) is not None]
    largest = max(rated, key=lambda x: x[0])[1] if rated else None
    return {
        **_json_ratio(ratio),
        # below 3x the threshold a choice of threshold could move the answer
        "marginal": ratio is not None and ratio < 3 * FLOOR_FACTOR,
        "next_above": _brief(above[0]) if above else None,
        "largest": _brief(largest),
        "later_above": len(above),
        "later_compared": len(after),
    }


def localise(rows: list[dict[str, Any]], floor_rows: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The first differing tensor and, against a floor pair, the first one above the
    float-rounding floor. Without a floor no divergence is named; with nothing compared
    nothing is claimed (``compared`` is 0)."""
    floor = {(r["name"], r["occurrence"]): r["nmse"] for r in floor_rows or []}
    for r in rows:
        r["floor_nmse"] = floor.get((r["name"], r["occurrence"]))
    first_difference = next((r for r in rows if not r["identical"]), None)
    first_divergence = None
    if floor_rows is not None:
        first_divergence = next(
            (
                r
                for r in rows
                if r["floor_nmse"] is not None
                and r["nmse"] > 0
                and r["nmse"] > FLOOR_FACTOR * r["floor_nmse"]
            ),
            None,
        )
    return {
        "n_tensors": len(rows),
        "n_with_floor": sum(r["floor_nmse"] is not None for r in rows),
        "first_difference": first_difference,
        "first_divergence": first_divergence,
        "robustness": robustness(rows, first_divergence) if first_divergence else None,
        "rows": rows,
    }


def around(
    rows: list[dict[str, Any]], index: int, before: int = 4, after: int = 4
) -> list[dict[str, Any]]:
    """The tensors just before and after ``index`` in graph order."""
    return rows[max(0, index - before) : index + after + 1]


def floor_pair(pair: Pair) -> Pair | None:
    """The pair that differs from ``pair`` only in float rounding: the same two devices on
    the f32 copy. None when the devices are the same or ``pair`` is that pair already."""
    if pair.same_device:
        return None
    floor = Pair(pair.a.with_dequant("f32"), pair.b.with_dequant("f32"))
    return None if floor == pair else floor


def choose_pairs(results: list[dict[str, Any]], configured: list[Pair]) -> list[tuple[Pair, str]]:
    """The model's largest pair that asks the device-and-settings question (the same weights
    file on two devices; a pair whose weights differ parts at the embedding table and says
    nothing) and the configured pairs."""
    same_file = [r for r in results if (p := Pair.from_result(r)).same_file and not p.same_device]
    measured = [r for r in same_file if r["status"] == "ok"]
    chosen: list[tuple[Pair, str]] = []
    if measured:
        top = max(measured, key=headline)
        chosen.append(
            (Pair.from_result(top), "largest first-step max |Δ| between two devices on one file")
        )
    elif same_file:  # none was compared: still say what the captures show, or why not
        chosen.append(
            (Pair.from_result(same_file[0]), "two devices on one file; no comparison of them ran")
        )
    for pair in configured:
        if {pair.a, pair.b} not in [{p.a, p.b} for p, _ in chosen]:
            chosen.append((pair, "named in config.capture.pairs"))
    return chosen


def localise_model(
    model: str,
    captures: list[tuple[dict[str, Any], Path]],
    pairs: list[dict[str, Any]],
    configured: list[tuple[str, str]],
) -> dict[str, Any]:
    """Localise the model's chosen pairs (``choose_pairs``) on every captured prompt."""
    ok = {Combination.from_record(r): (r, path) for r, path in captures if r["status"] == "ok"}
    failed = {
        Combination.from_record(r).label: {
            "status": r["status"],
            "kind": r.get("error", {}).get("kind"),
            "reason": failure_text(r),
        }
        for r, _ in captures
        if r["status"] != "ok"
    }
    captured = _Captures(ok)
    results = []
    for pair, why in choose_pairs(pairs, [Pair.parse(model, a, b) for a, b in configured]):
        entry: dict[str, Any] = {"a": pair.a.label, "b": pair.b.label, "why": why}
        missing = [c for c in (pair.a, pair.b) if c not in ok]
        if missing:
            entry["status"] = "n/a"
            entry["reason"] = "; ".join(
                f"{c.label}: {failed[c.label]['reason'] if c.label in failed else 'not captured'}"
                for c in missing
            )
        else:
            entry.update(captured.localise(pair))
        results.append(entry)
    return {"model": model, "floor_factor": FLOOR_FACTOR, "pairs": results, "not_captured": failed}


class _Captures:
    """A model's ok captures, each file read once, however many pairs it is in."""

    def __init__(self, ok: dict[Combination, tuple[dict[str, Any], Path]]) -> None:
        self.ok = ok
        self.data: dict[Combination, dict[str, np.ndarray]] = {}

    def arrays(self, combo: Combination) -> dict[str, np.ndarray]:
        if combo not in self.data:
            self.data[combo] = load_arrays(self.ok[combo][1])
        return self.data[combo]

    def rows(self, pair: Pair, i: int) -> list[dict[str, Any]]:
        """Prompt ``i``'s tensors of the pair, compared (``tensor_rows``)."""
        pa, pb = (self.ok[c][0]["prompts"][i] for c in (pair.a, pair.b))
        return tensor_rows(pa["tensors"], self.arrays(pair.a), pb["tensors"], self.arrays(pair.b))

    def localise(self, pair: Pair) -> dict[str, Any]:
        """The pair on every prompt both captured, against its floor pair where both of
        that ran."""
        floor = floor_pair(pair)
        if floor and not (floor.a in self.ok and floor.b in self.ok):
            floor = None
        prompts = []
        rec_a, rec_b = self.ok[pair.a][0], self.ok[pair.b][0]
        for i, (pa, pb) in enumerate(zip(rec_a["prompts"], rec_b["prompts"], strict=False)):
            changed = [
                c.label
                for c, p in ((pair.a, pa), (pair.b, pb))
                if not p["logits_identical_with_capture"]
            ]
            floor_rows = self.rows(floor, i) if floor else None
            prompts.append(
                {
                    "prompt": pa["id"],
                    "capture_changed_logits": changed,
                    **localise(self.rows(pair, i), floor_rows),
                }
            )
        return {"status": "ok", "floor": list(floor.labels) if floor else None, "prompts": prompts}
