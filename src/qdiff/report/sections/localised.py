"""Where a model's pairs part, op by op (qdiff.compare.localise)."""

from __future__ import annotations

from typing import Any

from qdiff.compare.localise import around
from qdiff.core.labels import Pair
from qdiff.report import figures
from qdiff.report.fmt import code, num, table, text
from qdiff.report.view import ModelView


def _where(r: dict[str, Any]) -> str:
    where = f"layer {r['layer']}" if r["layer"] is not None else "outside the layers"
    said = f"{code(r['name'])} (tensor #{r['index']}, {text(r['op'])}: {r['family']}, {where})"
    if r["only_a_before"] or r["only_b_before"]:
        said += (
            ", right after ops the two graphs compute differently (a only: "
            + (", ".join(map(text, r["only_a_before"])) or "none")
            + "; b only: "
            + (", ".join(map(text, r["only_b_before"])) or "none")
            + ")"
        )
    return said


def _ratio_text(brief: dict[str, Any]) -> str:
    return (
        "the floor bit-identical there"
        if brief["floor_identical"]
        else f"{brief['ratio']:.3g}× the floor"
    )


def _divergence(q: dict[str, Any], factor: float) -> str:
    d, first, firm = q["first_divergence"], q["first_difference"], q["robustness"]
    ratio = (
        f", {firm['ratio']:.3g}× the floor's {num(d['floor_nmse'])}"
        if firm["ratio"] is not None
        else ", where the floor pair is bit-identical"
    )
    said = (
        f"First divergence at {_where(d)}: NMSE {num(d['nmse'])}{ratio}, max \\|Δ\\| "
        f"{num(d['max_abs'])}, relative error {num(d['rel_err'])}."
    )
    if firm["marginal"]:
        said += f" **It only just crosses the {factor:g}× threshold**, so treat this position as approximate."
    later = f"{firm['later_above']} of the {firm['later_compared']} later tensors stay above the threshold"
    nxt = firm["next_above"]
    said += (
        (
            f" Next above the threshold: {code(nxt['name'])} (#{nxt['index']}, {_ratio_text(nxt)}); "
            if nxt
            else " No later tensor is above the threshold; "
        )
        + later
        + "."
    )
    largest = firm["largest"]
    if largest and largest["index"] != d["index"]:
        said += f" Largest ratio: {code(largest['name'])} (#{largest['index']}, {_ratio_text(largest)})."
    if first["index"] != d["index"]:
        said += f" First difference at all: {_where(first)}."
    return said


def _finding(q: dict[str, Any], floor: list[str] | None, factor: float) -> str:
    """What one prompt's localisation says, and no more than its numbers."""
    n, first = q["n_tensors"], q["first_difference"]
    if n == 0:
        return (
            "**Nothing was compared**: the two captures share no tensor (`capture.tensors` "
            "matched none, or every match was skipped), so this says nothing about where "
            "the pair parts."
        )
    if first is None:
        return f"All {n} compared tensors are bit-identical: the pair does not part in this pass."
    if floor is None:
        return (
            f"First difference at {_where(first)}. No floor pair (the same devices on the "
            "f32 copy), so no divergence from float rounding is named."
        )
    if q["n_with_floor"] == 0:
        return (
            f"First difference at {_where(first)}. The floor pair shares none of these "
            "tensors, so no divergence from float rounding is named."
        )
    if q["first_divergence"] is None:
        return (
            f"First difference at {_where(first)}, but none of the {q['n_with_floor']} "
            f"tensors compared with the floor rises above {factor:g}× it: float rounding alone."
        )
    return _divergence(q, factor)


def section(view: ModelView) -> str:
    """Where the chosen pairs part, op by op (the capture stage's section)."""
    loc = view.localised
    if loc is None:
        return "_Tensor capture is off (`capture.enabled`)._"
    if loc.get("status") == "failed":
        return f"_Localisation failed: {text(loc['reason'])}._"
    factor = loc["floor_factor"]
    out = [
        "Each combination's forward pass over the prompt was captured op by op through "
        "llama.cpp's eval callback (last token position of every named tensor). Pairs are "
        "chosen among those that ran the same weights file on two devices (a pair whose "
        "weights differ parts at the embedding table and says nothing), plus "
        "`capture.pairs`. **First difference**: the first tensor that is not bit-identical. "
        f"**First divergence**: the first whose NMSE exceeds {factor:g}× the NMSE of the floor "
        "pair at the same tensor; the floor pair is the same two devices on the f32 copy, which "
        "differ only in float rounding. Without a floor pair no divergence is named."
    ]
    if not loc["pairs"]:
        out.append("_No pair to localise: no two devices both ran one file of this model._")
    for entry in loc["pairs"]:
        head = f"**{code(entry['a'])} vs {code(entry['b'])}** ({text(entry['why'])})"
        if entry["status"] != "ok":
            out.append(f"{head}: not localised: {text(entry['reason'])}.")
            continue
        for q in entry["prompts"]:
            out += _prompt_parts(view, entry, q, head, factor)
    return "\n\n".join(out)


def _prompt_parts(
    view: ModelView, entry: dict[str, Any], q: dict[str, Any], head: str, factor: float
) -> list[str]:
    """One pair's localisation on one prompt: what it found, the tensors around the
    divergence, and its plot by depth."""
    floor = entry["floor"]
    changed = q["capture_changed_logits"]
    said = [
        f"{head}, prompt {code(q['prompt'])}, {q['n_tensors']} tensors compared, floor: "
        + (f"{code(floor[0])} vs {code(floor[1])}." if floor else "none."),
        _finding(q, floor, factor),
        "Capturing left both combinations' logits bit-identical."
        if not changed
        else f"**Capturing changed the logits of {', '.join(map(code, changed))}**: observing "
        "the graph split it differently on that backend, so this localisation describes the "
        "observed computation, not exactly the uncaptured one.",
    ]
    parts = [" ".join(said)]
    mark = q["first_divergence"] or q["first_difference"]
    if mark is not None:
        parts.append(table([_tensor_row(r) for r in around(q["rows"], mark["index"])]))
    stem = Pair.parse(view.model, entry["a"], entry["b"]).stem
    path = view.plot("depth", f"{stem}.{q['prompt']}")
    if path is not None and q["rows"]:
        divergence = q["first_divergence"]
        figures.depth_profile(
            q["rows"],
            f"{floor[0]} vs {floor[1]}" if floor else None,
            divergence["index"] if divergence else None,
            path,
            f"{entry['a']} vs {entry['b']}, prompt {q['prompt']}",
        )
        parts.append(view.link(path, "difference by depth"))
    return parts


def _tensor_row(r: dict[str, Any]) -> dict[str, str]:
    return {
        "#": str(r["index"]),
        "tensor": code(r["name"]),
        "op": r["family"],
        "max \\|Δ\\|": num(r["max_abs"]),
        "NMSE": num(r["nmse"]),
        "floor NMSE": num(r.get("floor_nmse")),
    }
