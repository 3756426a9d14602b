"""How far every combination is from the exact answer of the model's weights (qdiff.exact)."""

from __future__ import annotations

from typing import Any

from qdiff.report.fmt import code, count, num, table, text
from qdiff.report.view import ModelView


def legend(view: ModelView) -> str:
    return (
        "The exact answer is the model's own definition computed in float64 from the GGUF's "
        "weights (dequantized exactly as llama.cpp does), with no fp16 table, no KV-cache "
        "rounding and no summation order of any backend (`src/qdiff/exact/`). Every "
        f"combination is measured against it: at the first step {view.first_step_tokens}, with KL as "
        "KL(exact ‖ combination), and along the teacher's text at every forced position over "
        "the logits teacher forcing keeps. ★ marks the combination closest to exact (smallest "
        "first-step max \\|Δ\\|). An f16 copy's distance includes the rounding of its weights."
    )


def _forced_cells(row: dict[str, Any]) -> dict[str, str]:
    f = row.get("forced")
    if f is None:
        return {}
    if f.get("status") != "ok":
        return {"along the text": f"n/a: {text(f.get('reason', ''))}"}
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
        return f"_No exact reference: {text(d.get('reason', d['status']))}._"
    exact = d["exact"]
    rows = []
    ok = sorted(
        (r for r in d["rows"] if r["status"] == "ok"), key=lambda r: r["first_step"]["max_abs"]
    )
    for r in ok + [r for r in d["rows"] if r["status"] != "ok"]:
        name = code(r["combination"]) + (" ★" if r["combination"] == d["closest"] else "")
        if r["status"] != "ok":
            rows.append({"combination": name, "max \\|Δ\\|": f"n/a: {text(r['reason'])}"})
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
        f"{legend(view)}\n\nExact reference of {code(exact['model_file']['file'])} "
        f"({text(exact['architecture'])}, along {code(exact['teacher'])}'s text: {len(exact['prompt_ids'])} prompts, "
        f"{exact['n_positions']} positions): {timings['total_s']:.1f} s, peak memory "
        f"{exact['peak_rss_mib']:.0f} MiB."
    )
    return head + "\n\n" + table(rows)


def reference_model_distance(view: ModelView) -> str:
    d = view.reference_model
    if d is None:
        if view.is_reference_model:
            return "_This is the reference model: the other models are measured against it._"
        return "_No reference model (`reference_model:` in the config)._"
    if d["status"] != "ok":
        return f"_Not measured: {text(d.get('reason', d['status']))}._"
    ok = sorted((r for r in d["rows"] if r["status"] == "ok"), key=lambda r: r["kl_mean"])
    rows = []
    for r in ok + [r for r in d["rows"] if r["status"] != "ok"]:
        if r["status"] != "ok":
            rows.append(
                {"combination": code(r["combination"]), "KL mean": f"n/a: {text(r['reason'])}"}
            )
            continue
        exact = r.get("vs_exact")
        rows.append(
            {
                "combination": code(r["combination"]),
                "KL mean": num(r["kl_mean"]),
                "KL median": num(r["kl_median"]),
                "KL p99": num(r["kl_p99"]),
                "KL max": num(r["kl_max"]),
                "same top token": count(r["same_top"], r["n_prompts"]),
                "RMS Δp": num(r["rms_dp"]),
                "max \\|Δ\\|": num(r["max_abs"]),
                **(
                    {
                        "vs its exact: max \\|Δ\\|": num(exact["max_abs"]),
                        "KL": num(exact["kl_mean"]),
                        "same top": count(exact["same_top"], r["n_prompts"]),
                    }
                    if exact
                    else {}
                ),
            }
        )
    return (
        f"Every combination of this model against `{d['reference_model']}`'s `{d['reference']}` "
        "run, over the full vocabulary at the first step, as llama-perplexity --kl-divergence "
        "reports a quantized model against its original: KL(reference ‖ combination), the same "
        "top token, RMS Δp of the reference's top token"
        + (
            f"; and against the exact answer of `{d['reference_model']}`'s weights"
            if d["has_exact"]
            else ""
        )
        + ". Smallest KL first.\n\n"
        + table(rows)
    )
