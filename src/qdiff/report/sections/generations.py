"""Free-running greedy generations compared as Yuan et al. 2025 and the serving engines'
determinism tests compare them (qdiff.compare.generations)."""

from __future__ import annotations

from typing import Any

from qdiff.compare.generations import (
    generation_cap,
    generations_of,
    model_stats,
    most_parted_first,
)
from qdiff.compare.pairs import label
from qdiff.compare.stats import LEVEL
from qdiff.report import figures
from qdiff.report.fmt import code, num, table
from qdiff.report.view import ModelView

LEGEND = (
    "Each combination's own greedy generation from each prompt, up to its end of generation "
    "or `generation.n_tokens`, compared as Yuan et al. 2025 (arXiv 2506.09501) compare "
    "runtime configurations: the *divergence index* of two generations is the first "
    "position where their tokens differ (a generation that ends earlier differs there); "
    "*Std@Output_Length* is the (population) standard deviation of a prompt's output length "
    "across the combinations, and *Std@top1_prob* that of the chosen token's probability at each "
    "position of the prefix all combinations share, averaged over it; *Avg_* is the mean "
    "over prompts. A pair's share of diverged prompts has a {level:.0%} Wilson interval."
)


def generations(view: ModelView) -> str:
    runs = {label(r): generations_of(r) for r in view.ok}
    if len(runs) < 2:
        return "_Fewer than two combinations generated: nothing to compare._"
    s = model_stats(runs)
    n = s["n_prompts"]
    head = (
        f"Over {n} prompts and {len(runs)} combinations: {s['prompts_with_one_text']} of {n} "
        f"prompts gave one text everywhere; Avg_Std@Output_Length {num(s['avg_std_output_length'])} "
        f"tokens; Avg_Std@top1_prob {_top1(s)}; {_lengths(view)}."
    )
    ranked = most_parted_first(s["pairs"])
    rows = [_pair_row(a, b, p) for (a, b), p in ranked]
    per_prompt = [
        {
            "prompt": code(pid),
            "unique texts": str(p["unique_texts"]),
            "Std@Output_Length": num(p["length_std"]),
            "shared prefix": str(p["common_prefix"]),
            "Std@top1_prob": num(p["std_top1_prob"]) if p["std_top1_prob"] is not None else "–",
        }
        for pid, p in s["per_prompt"].items()
    ]
    parts = [LEGEND.format(level=LEVEL), head, table(rows), _divergence_plot(view, ranked)]
    return "\n\n".join([p for p in parts if p] + ["Per prompt:", table(per_prompt)])


def _pair_row(a: str, b: str, p: dict[str, Any]) -> dict[str, Any]:
    indices = p["indices"]
    return {
        "pair": f"{code(a)} vs {code(b)}",
        "diverged": f"{p['diverged']}/{p['n_prompts']} ({p['share_low']:.0%}–{p['share_high']:.0%})",
        "divergence index, median": num(p["median_index"]) if indices else "–",
        "divergence indices": ", ".join(map(str, indices)) or "none",
    }


MAX_PLOTTED = 20  # pairs in the divergence plot: those whose texts part most often


def _divergence_plot(view: ModelView, ranked: list[tuple[tuple[str, str], dict[str, Any]]]) -> str:
    """Where each pair's texts part, prompt by prompt, and how many did not part."""
    path = view.plot("divergence")
    if path is None:
        return ""
    shown = ranked[:MAX_PLOTTED]
    rows = {f"{a} vs {b}": (p["indices"], p["n_prompts"]) for (a, b), p in shown}
    title = f"{view.model}: where the free-running texts part"
    figures.divergence_strips(rows, generation_cap(view.ok), path, title)
    which = (
        f"the {len(shown)} of {len(ranked)} pairs whose texts part most often"
        if len(shown) < len(ranked)
        else "each pair"
    )
    return (
        f"The divergence index of every prompt whose texts part, for {which} (in the table's "
        "order), and how many prompts did not part within the generated length:\n\n"
        + view.link(path, "divergence indices per pair")
    )


def _top1(s: dict[str, Any]) -> str:
    if not s["top1_recorded"]:
        return "not recorded (runs made by an older qdiff)"
    if s["avg_std_top1_prob"] is None:
        return "none (no prompt's generations share a first token)"
    k, n = s["n_prompts_top1"], s["n_prompts"]
    return (
        f"{num(s['avg_std_top1_prob'])} (over {k} of {n} prompts: those whose texts share a prefix)"
    )


def _lengths(view: ModelView) -> str:
    """How long the generations were: the cap, and how many ended before it."""
    prompts = [p for r in view.ok for p in r.get("prompts", [])]
    cap = generation_cap(view.ok)
    ended = sum(bool(p.get("stopped_at_eog")) for p in prompts)
    return f"at most {cap} tokens each, {ended} of {len(prompts)} generations ended before"
