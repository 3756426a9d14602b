"""The per-model teacher-forced comparison (qdiff.compare.forced)."""

from __future__ import annotations

from typing import Any

from qdiff.compare.forced import MIN_SCALE_POSITIONS, TIE_FACTOR
from qdiff.compare.pairs import label
from qdiff.core.records import failure_text
from qdiff.judge.diagnosis import fork_sites, plural
from qdiff.report import figures
from qdiff.report.fmt import code, count, num, piece, table, text
from qdiff.report.view import ModelView


def _legend(head: dict[str, Any]) -> str:
    cut = head.get("forced_tokens")  # teacher_forcing.n_tokens
    return (
        f"Every combination was fed the greedy output of `{head['teacher']}` token by token"
        + (f", the first {cut} tokens of each of its texts" if cut else "")
        + f" ({head['n_positions']} positions over {len(head['prompt_ids'])} prompts), so the "
        "logits compare at every "
        + ("forced" if cut else "generated")
        + " position, not only the first. Per position qdiff keeps the logits of the "
        f"teacher's {head['top_k']} most likely tokens (**max \\|Δ\\|** is over those), each side's "
        "exact top-2, and the full log-sum-exp (**KL** is KL(a‖b) over those tokens plus one "
        "bucket for the rest, a lower bound of the full KL). A **fork** is a position whose "
        "top-1 tokens differ; its **margin** is the larger of the two sides' lead of their own "
        "token over the other's. A fork is a **near tie** when the margin is exact and at most "
        f"{TIE_FACTOR:g}× the pair's median max \\|Δ\\| over the positions where the two "
        f"are not bit-identical (at least {MIN_SCALE_POSITIONS} of them), a **red flag** "
        "when it exceeds that, and **undetermined** otherwise."
    )


def section(view: ModelView) -> str:
    """The teacher-forced comparison of every pair (the forced stage's section)."""
    ok = [r for r in view.forced if r["status"] == "ok"]
    good = view.forced_pairs
    if not ok or not good:
        reasons = sorted({failure_text(r) for r in view.forced if r["status"] != "ok"})
        return (
            "_No teacher-forced comparison"
            + (f": {'; '.join(map(text, reasons))}" if reasons else "")
            + "._"
        )
    head = ok[0]
    parts = [
        _legend(head),
        _self_checks(ok),
        table([_pair_row(p) for p in sorted(good, key=lambda p: -p["forced"]["max_abs"])]),
        _fork_sites(good),
        _red_flags(good, {label(r): r.get("pieces", {}) for r in ok}),
        _positions_plot(view, good),
    ]
    return "\n\n".join(part for part in parts if part)


def _self_checks(ok: list[dict[str, Any]]) -> str:
    """The teacher reproduces its own output; each forced first step, the free run's."""
    own = next((r for r in ok if label(r) == r["teacher"]), None)
    differ = [
        f"{label(r)} {r['first_step_identical_to_free_run']}/{len(r['prompt_ids'])}"
        for r in ok
        if r["first_step_identical_to_free_run"] != len(r["prompt_ids"])
    ]
    teacher = (
        f"the teacher forced along its own output chose that output at "
        f"{own['agrees_with_teacher_tokens']}/{own['n_positions']} positions; "
        if own
        else ""
    )
    free_run = (
        "every forced first position was bit-identical to the combination's free run."
        if not differ
        else "forced first positions that differ from the free run: "
        + ", ".join(differ)
        + " (the forced pass did not reproduce the free run)."
    )
    return "Self-checks: " + teacher + free_run


def _pair_row(p: dict[str, Any]) -> dict[str, str]:
    f = p["forced"]
    n = f["n_positions"]
    return {
        "a": code(p["a"]),
        "b": code(p["b"]),
        "bit-identical": count(f["bit_identical"], n),
        "top-1 agree": f"{f['top1_agree']}/{n} ({f['top1_agree'] / n:.1%})"
        if n
        else "nothing compared",
        "max \\|Δ\\| median": num(f["max_abs_median"]),
        "p90": num(f["max_abs_p90"]),
        "max": num(f["max_abs"]),
        "KL mean": num(f["kl_mean"]),
        "KL p99": num(f["kl_p99"]),
        "forks": str(len(f["forks"])),
        "near ties": str(f["near_ties"]),
        "red flags": str(f["red_flags"]),
        "undetermined": str(f.get("undetermined", 0)),
    }


def _fork_sites(good: list[dict[str, Any]]) -> str:
    sites = fork_sites(good)
    if not sites:
        return ""
    n_forks = sum(len(k) for k in sites.values())
    return (
        f"The {plural(n_forks, 'fork')} of all pairs fall on "
        f"{plural(len(sites), 'distinct position')} (prompt, position)."
    )


def _red_flags(good: list[dict[str, Any]], pieces: dict[str, dict[str, str]]) -> str:
    flagged = sorted(
        ((p, fork) for p in good for fork in p["forced"]["forks"] if fork["kind"] == "red flag"),
        key=lambda x: -x[1]["margin"],
    )
    if not flagged:
        return ""
    rows = [
        {
            "a": code(p["a"]),
            "b": code(p["b"]),
            "prompt": code(fork["prompt"]),
            "position": str(fork["position"]),
            "a chose": piece(pieces[p["a"]], fork["token_a"]),
            "b chose": piece(pieces[p["b"]], fork["token_b"]),
            "margin": ("" if fork["margin_exact"] else "≥ ") + num(fork["margin"]),
            "near-tie threshold": num(p["forced"]["tie_threshold"]),
        }
        for p, fork in flagged[:10]
    ]
    return f"Red-flag forks, largest margin first ({len(flagged)} in all, 10 shown):\n\n" + table(
        rows
    )


def _positions_plot(view: ModelView, good: list[dict[str, Any]]) -> str:
    path = view.plot("forced-positions")
    if path is None:
        return ""
    top = sorted(good, key=lambda p: -p["forced"]["max_abs_median"])[:6]
    curves = {
        f"{p['a']} vs {p['b']}": (
            [q["position"] for q in p["forced"]["per_position"]],
            [q["max_abs_median"] for q in p["forced"]["per_position"]],
        )
        for p in top
    }
    figures.forced_curves(curves, path, f"{view.model}: difference along the teacher's text")
    return (
        f"Median max \\|Δ\\| by position for the {len(top)} most different pairs:\n\n"
        + view.link(path, "max |Δ| by position")
    )
