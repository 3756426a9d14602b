"""Per-model sections over the pairwise comparisons: the table, the distance from the
reference, and tolerances for tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from qdiff.compare.metrics import PAIR_METRICS, median, percentile
from qdiff.compare.pairs import headline
from qdiff.compare.stats import LEVEL
from qdiff.judge.tolerance import HEADROOM, SPLITS, HeldOut, Tolerance, tolerances
from qdiff.report.fmt import code, count, num, table, text
from qdiff.report.view import ModelView


def legend(view: ModelView) -> str:
    return (
        "Every pair compares two combinations of the same model on the same prompts. Logit "
        f"metrics are {view.first_step_tokens}, at the first generated position (the prompt's "
        "last token), with the left combination as reference: "
        + "; ".join(f"**{m.header}**: {m.note}" for m in PAIR_METRICS if m.shown)
        + ". Statistics are over prompts (max |Δ| is the largest, NMSE and KL means unless "
        "named). **forked**: prompts whose greedy texts differ; **first fork**: the earliest "
        "generated step (0-based) where two texts differ."
    )


def _metric_cells(summary: dict[str, Any]) -> dict[str, str]:
    cells = {}
    n = summary["n_prompts"]
    for m in PAIR_METRICS:
        for stat in m.shown:
            value = summary[m.summary_key(stat)]
            cells[m.column(stat)] = count(int(value), n) if m.flag else num(value)
    return cells


def pairs_table(view: ModelView) -> str:
    # sorted by the numbers, before any of them is formatted
    ranked = sorted(
        view.pairs, key=lambda p: (p["status"] != "ok", -headline(p) if p["status"] == "ok" else 0)
    )
    rows = []
    for p in ranked:
        head = {
            "a": code(p["a"]),
            "b": code(p["b"]),
            "what differs": text("; ".join(p["differs"]) or "nothing"),
        }
        if p["status"] != "ok":
            rows.append(
                {**head, PAIR_METRICS[0].column("max"): f"{p['status']}: {text(p['reason'])}"}
            )
            continue
        s = p["summary"]
        rows.append(
            {
                **head,
                **_metric_cells(s),
                "forked": count(s["forked"], s["n_prompts"]),
                "first fork": "none" if s["first_fork_step"] is None else str(s["first_fork_step"]),
            }
        )
    return legend(view) + "\n\n" + table(rows)


def _oriented(pair: dict[str, Any], reference: str) -> list[tuple[float, float, bool]]:
    """(KL(ref‖x), Δp of ref's top token, same top token) per prompt, reference first."""
    if pair["a"] == reference:
        return [(q["kl"], q["dp_top"], q["top1_agree"]) for q in pair["prompts"]]
    return [(q["kl_ba"], q["dp_top_ba"], q["top1_agree"]) for q in pair["prompts"]]


def reference_distance(view: ModelView) -> str:
    reference = view.reference
    if reference is None:
        return "_No reference configured (`reference:` in the config)._"
    rows = []
    for p in view.ok_pairs:
        if reference not in (p["a"], p["b"]):
            continue
        values = _oriented(p, reference)
        kl = np.array([v[0] for v in values])
        rows.append(
            (
                float(kl.mean()),
                {
                    "combination": code(p["b"] if p["a"] == reference else p["a"]),
                    "KL mean": num(float(kl.mean())),
                    "KL median": num(median(kl)),
                    "KL p99": num(percentile(kl, 99)),
                    "KL max": num(float(kl.max())),
                    "same top token": count(sum(v[2] for v in values), len(values)),
                    "RMS Δp": num(float(np.sqrt(np.mean([v[1] ** 2 for v in values])))),
                    "max \\|Δ\\|": num(headline(p)),
                },
            )
        )
    if not rows:
        return f"_The reference `{reference}` did not run for this model._"
    rows.sort(key=lambda r: -r[0])  # by the number, not by its formatted text
    return (
        f"KL(`{reference}` ‖ combination) over prompts, as llama-perplexity reports it; Δp is "
        "for the reference's top token.\n\n" + table([r for _, r in rows])
    )


def _held_out(held: HeldOut | None) -> str:
    """A tolerance checked on held-out halves of the prompts (qdiff.judge.tolerance)."""
    if held is None:
        return "not checked (fewer than 4 prompts)"
    low, high = held.interval()
    return (
        f"{held.prompt_within:.0%} of prompts ({LEVEL:.0%} interval {low:.0%}–{high:.0%}); "
        f"all {held.half_size} of a half in {held.half_within:.0%} of {SPLITS} halves"
    )


def _snippet(view: ModelView, first: Tolerance) -> str:
    """The copy-paste assertion for one tolerance, saying what it covers and how it held
    out of sample."""
    covers = (
        f"the first-step logits of {first.first_step_values} prompt comparisons "
        + view.first_step_tokens
        + (
            f" and {first.forced_values} teacher-forced positions over the teacher's top {first.top_k} "
            "tokens (qdiff keeps no more there; the full vocabulary may differ more at those "
            "positions)"
            if first.forced_max is not None
            else ""
        )
    )
    return (
        f"```python\n# {view.model}, {first.dequant} file, {first.scope}. Covers {covers}.\n"
        f"# Largest difference seen: {num(first.largest)}; {HEADROOM:g}x that, rounded up:\n"
        f"np.testing.assert_allclose(logits_device, logits_reference, rtol=0, atol={first.atol:g})\n"
        + (
            "assert logits_device.argmax() == logits_reference.argmax()  "
            "# held at every compared position\n"
            if first.top1_always
            else f"# top-1 did not always agree ({count(*first.top1_first_step)} first steps"
            + (f", {count(*first.top1_forced)} forced positions" if first.top1_forced else "")
            + "): do not assert the argmax\n"
        )
        + f"# greedy text forked in {count(*first.forked)} comparisons: compare logits, not text\n"
        + (
            f"# set by prompt {first.held_out.set_by}; without it the atol would be "
            f"{first.held_out.atol_without_it:g}\n"
            f"# derived from half of the prompts, held on the other half: {_held_out(first.held_out)}\n"
            if first.held_out
            else ""
        )
        + "```"
    )


def tolerance_table(view: ModelView) -> str:
    rows = tolerances(view.pairs)
    if not rows:
        return "_No two combinations ran the same file on different devices or settings: no tolerance to recommend._"
    out = []
    first_step_column = f"first step, {view.first_step_scope}"
    for t in rows:
        forced = (
            f"{num(t.forced_max)} (`{t.forced_where}`), {t.forced_values} positions × top {t.top_k}"
            if t.forced_max is not None
            else "not measured (teacher forcing off)"
        )
        out.append(
            {
                "between": t.scope + (f" ({t.settings})" if t.settings else ""),
                "file": t.dequant,
                first_step_column: f"{num(t.first_step_max)} (`{t.first_step_where}`), {t.first_step_values} prompts",
                "along the text, kept logits": forced,
                "top-1 agrees": count(*t.top1_first_step)
                + (f"; {count(*t.top1_forced)} positions" if t.top1_forced else ""),
                "texts forked": count(*t.forked),
                "recommended atol": num(t.atol),
                "largest / atol": f"{t.largest / t.atol:.2f}" if t.atol else "–",
                "held out (from one half of the prompts, on the other)": _held_out(t.held_out),
            }
        )
    snippet = _snippet(view, next((t for t in rows if t.dequant == "none"), rows[0]))
    return (
        f"Each row covers every pair of combinations that ran the same file and differ only "
        f"as the first column says. The recommended atol is {HEADROOM:g}× the largest difference "
        "over all of its data, rounded up, so nothing compared exceeds it. That says nothing "
        "of other prompts: *held out* derives the atol in the same way from a random half of "
        "the prompts and checks it on the other half (each prompt's first step and forced "
        f"positions), over {SPLITS} halves: the share of held-out prompts within it (its "
        "interval counts each prompt once) and how often a whole half was. A test over n new "
        "prompts fails when any one of them falls outside, so more often than one prompt "
        "does.\n\n" + table(out) + "\n\n" + snippet
    )
