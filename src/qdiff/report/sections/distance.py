"""How far every combination is from the exact answer of the model's weights (qdiff.exact)."""

from __future__ import annotations

from typing import Any

from qdiff.report.fmt import cell, code, count, num, table
from qdiff.report.view import ModelView

LEGEND = (
    "The exact answer is the model's own definition computed in float64 from the GGUF's "
    "weights (dequantized exactly as llama.cpp does), with no fp16 table, no KV-cache "
    "rounding and no summation order of any backend (`src/qdiff/exact.py`). Every "
    "combination is measured against it: at the first step over the full vocabulary (KL is "
    "KL(exact ‖ combination)), and along the teacher's text at every forced position over "
    "the logits teacher forcing keeps. ★ marks the combination closest to exact (smallest "
    "first-step max \\|Δ\\|). An f16 copy's distance includes the rounding of its weights."
)


def _forced_cells(row: dict[str, Any]) -> dict[str, str]:
    f = row.get("forced")
    if f is None:
        return {}
    if f.get("status") != "ok":
        return {"along the text": f"n/a: {cell(f.get('reason', ''))}"}
    return {
        "forced max \\|Δ\\| median": num(f["max_abs_median"]),
        "forced max \\|Δ\\|": num(f["max_abs"]),
        "forced KL mean": num(f["kl_mean"]),
        "forced top-1": count(f["top1_agree"], f["n_positions"]),
    }


def exact_distance(view: ModelView) -> str:
    d = view.exact
    if d is None:
        return "_The exact reference is off (`exact.enabled`)._"
    if d["status"] != "ok":
        return f"_No exact reference: {cell(d.get('reason', d['status']))}._"
    exact = d["exact"]
    rows = []
    ok = sorted(
        (r for r in d["rows"] if r["status"] == "ok"), key=lambda r: r["first_step"]["max_abs"]
    )
    for r in ok + [r for r in d["rows"] if r["status"] != "ok"]:
        name = code(r["combination"]) + (" ★" if r["combination"] == d["closest"] else "")
        if r["status"] != "ok":
            rows.append({"combination": name, "max \\|Δ\\|": f"n/a: {cell(r['reason'])}"})
            continue
        s = r["first_step"]
        rows.append(
            {
                "combination": name,
                "max \\|Δ\\|": num(s["max_abs"]),
                "RMS": num(s["rms"]),
                "NMSE": num(s["nmse"]),
                "KL mean": num(s["kl_mean"]),
                "top-1": count(s["top1_agree"], r["n_prompts"]),
                **_forced_cells(r),
            }
        )
    timings = exact["timings"]
    head = (
        f"{LEGEND}\n\nExact reference of `{exact['model_file']['file']}` ({exact['architecture']}, "
        f"along `{exact['teacher']}`'s text: {len(exact['prompt_ids'])} prompts, "
        f"{exact['n_positions']} positions): {timings['total_s']:.1f} s, peak memory "
        f"{exact['peak_rss_mib']:.0f} MiB."
    )
    return head + "\n\n" + table(rows)
