"""How far every combination is from the exact answer of the model's weights (qdiff.exact)."""

from __future__ import annotations

from typing import Any

from qdiff.compare.budget import verdict
from qdiff.compare.distance import ranked, typical
from qdiff.core.roundings import SOURCE_LABELS
from qdiff.report import figures
from qdiff.report.fmt import code, count, num, table, text
from qdiff.report.view import ModelView


def legend(view: ModelView) -> str:
    return (
        "The exact answer is the model's own definition computed in float64 from the GGUF's "
        "weights (dequantized exactly as llama.cpp does), with no fp16 table, no KV-cache "
        "rounding and no summation order of any backend (`src/qdiff/exact/`). Every "
        f"combination is measured against it: at the first step {view.first_step_tokens}, with KL as "
        "KL(exact ‖ combination), and along the teacher's text at every forced position over "
        "the logits teacher forcing keeps. ★ marks the combination closest to exact over all "
        "prompts (the smallest geometric mean of the per-prompt first-step max \\|Δ\\|, the "
        "column *typical*; rows in that order). An f16 copy's distance includes the rounding of "
        "its weights."
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
    ok = ranked(d["rows"])
    for r in ok + [r for r in d["rows"] if r["status"] != "ok"]:
        name = code(r["combination"]) + (" ★" if r["combination"] == d["closest"] else "")
        if r["status"] != "ok":
            rows.append({"combination": name, "max \\|Δ\\|": f"n/a: {text(r['reason'])}"})
            continue
        s = r["first_step"]
        rows.append(
            {
                "combination": name,
                "typical": num(typical(r)),
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
    return head + left_out(exact) + "\n\n" + table(rows)


def left_out(exact: dict[str, Any]) -> str:
    """A sentence naming the file's keys and tensors the engine did not read, if any."""
    unread = exact.get("unread", {})
    names = [code(n) for n in (*unread.get("keys", []), *unread.get("tensors", []))]
    if not names:
        return ""
    return (
        " **The engine did not read** these of the file's keys and tensors, so its answer "
        f"leaves them out: {', '.join(names)}."
    )


BUDGET_LEGEND = (
    "How much of each combination's distance from exact (first-step max \\|Δ\\| over the "
    "full vocabulary; the median over prompts, the worst in brackets) llama.cpp's rounding "
    "sources explain: the float64 engine "
    "with one source switched on (`src/qdiff/exact/roundings.py`, `cuda.py` and `vulkan.py` say "
    "what each follows in llama.cpp's code), then all of the combination's sources together, and the run against "
    "that emulation (*residual*). The *floor*, per prompt, is the larger of the emulation "
    "against itself with every rounding's input moved by a float32 sum's error (2^-20, at "
    "random, two draws: where an input lies that close to a rounding boundary, llama.cpp may "
    "round it the other way) and the run against itself in other ubatches (the serving "
    "stage's `ubatch-n` cases, on its prompts; not on CUDA, where the ubatch's size picks "
    "the kernels), and at least 2^-20 of the run's largest "
    "logit (float32 sums in another order). A faithful emulation leaves each prompt "
    "within its floor with probability 2/3: *unexplained* means the prompts within it are "
    "too few for that (binomial test, p < 0.01), the run rounding somewhere the emulation "
    "does not follow; *unresolved*, that the floor is at least half the distance from exact "
    "itself, where any emulation of about the right size passes and only the sizes (each "
    "source alone, all together, against *from exact*) say anything; *explained*, neither. "
    "*residual / floor* is the median over prompts of that ratio."
)


def _budget_row(name: str, b: dict[str, Any], sources: list[str]) -> dict[str, str]:
    if b["status"] != "ok":
        return {"combination": name, "from exact": f"n/a: {text(b['reason'])}"}
    alone = {s["name"]: num(s["median"]) for s in b["sources"]}
    return {
        "combination": name,
        "from exact": f"{num(b['distance']['median'])} ({num(b['distance']['max'])})",
        **{SOURCE_LABELS[s]: alone.get(s, "–") for s in sources},
        "all together": f"{num(b['together']['median'])} ({num(b['together']['max'])})",
        "residual": num(b["residual"]["median"]),
        "floor": num(b["floor"]["median"]),
        "residual / floor": f"{b['ratio_median']:.2g}",
        "floor / from exact": f"{b['floor']['median'] / b['distance']['median']:.2g}",
        "within floor": count(b["within_floor"], b["n_prompts"]),
        "reading": f"{verdict(b)} (p = {b['p_value']:.2g})"
        + "".join(f"; not followed: {text(n)}" for n in b.get("not_followed", [])),
    }


def error_budget(view: ModelView) -> str:
    d = view.exact
    if d is None or d["status"] != "ok":
        return "_No exact reference, so no error budget._"
    budgets = [(r["combination"], r["budget"]) for r in d["rows"] if "budget" in r]
    if not budgets:
        return "_No combination whose rounding sources qdiff's engine follows (CPU, for now)._"
    names = {s["name"] for _, b in budgets if b["status"] == "ok" for s in b["sources"]}
    sources = [s for s in SOURCE_LABELS if s in names]
    rows = [_budget_row(code(c), b, sources) for c, b in budgets]
    return BUDGET_LEGEND + "\n\n" + table(rows) + _budget_plot(view, budgets)


def _budget_plot(view: ModelView, budgets: list[tuple[str, dict[str, Any]]]) -> str:
    path = view.plot("budget")
    ok = [(c, b) for c, b in budgets if b["status"] == "ok"]
    if path is None or not ok:
        return ""
    bars = {
        c: [("from exact", b["distance"]["median"])]
        + [(s["label"], s["median"]) for s in b["sources"]]
        + [
            ("all together", b["together"]["median"]),
            ("residual", b["residual"]["median"]),
            ("floor", b["floor"]["median"]),
        ]
        for c, b in ok
    }
    figures.budget_bars(bars, path, f"{view.model}: error budget (first step)")
    return "\n\n" + view.link(path, "error budget per combination")


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
