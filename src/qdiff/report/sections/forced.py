"""The per-model teacher-forced comparison (qdiff.compare.forced)."""

from __future__ import annotations

from qdiff.compare.forced import MIN_SCALE_POSITIONS, TIE_FACTOR
from qdiff.compare.pairs import label
from qdiff.core.records import failure_text
from qdiff.judge.diagnosis import fork_sites, plural
from qdiff.report import plots
from qdiff.report.fmt import code, count, num, piece, table, text
from qdiff.report.view import ModelView


def _legend(teacher: str, n_positions: int, n_prompts: int, top_k: int) -> str:
    return (
        f"Every combination was fed the greedy output of `{teacher}` token by token "
        f"({n_positions} positions over {n_prompts} prompts), so the logits compare at every "
        "generated position, not only the first. Per position qdiff keeps the logits of the "
        f"teacher's {top_k} most likely tokens (**max \\|Δ\\|** is over those), each side's "
        "exact top-2, and the full log-sum-exp (**KL** is KL(a‖b) over those tokens plus one "
        "bucket for the rest, a lower bound of the full KL). A **fork** is a position whose "
        "top-1 tokens differ; its **margin** is the larger of the two sides' lead of their own "
        "token over the other's. A fork is a **near tie** when the margin is exact and at most "
        f"{TIE_FACTOR:g}× the pair's median max \\|Δ\\| over the positions where the two "
        f"are not bit-identical (at least {MIN_SCALE_POSITIONS} of them), a **red flag** "
        "when it exceeds that, and **undetermined** otherwise."
    )


def forced(view: ModelView) -> str:
    ok = [r for r in view.forced if r["status"] == "ok"]
    good = view.forced_pairs
    if not ok or not good:
        reasons = sorted({failure_text(r) for r in view.forced if r["status"] != "ok"})
        return (
            "_No teacher-forced comparison"
            + (f": {'; '.join(map(text, reasons))}" if reasons else "")
            + "._"
        )
    teacher = ok[0]["teacher"]
    own = next((r for r in ok if label(r) == teacher), None)
    checks = [
        f"{label(r)} {r['first_step_identical_to_free_run']}/{len(r['prompt_ids'])}"
        for r in ok
        if r["first_step_identical_to_free_run"] != len(r["prompt_ids"])
    ]
    lines = [
        _legend(teacher, ok[0]["n_positions"], len(ok[0]["prompt_ids"]), ok[0]["top_k"]),
        "",
        "Self-checks: "
        + (
            f"the teacher forced along its own output chose that output at "
            f"{own['agrees_with_teacher_tokens']}/{own['n_positions']} positions; "
            if own
            else ""
        )
        + (
            "every forced first position was bit-identical to the combination's free run."
            if not checks
            else "forced first positions that differ from the free run: "
            + ", ".join(checks)
            + " (the forced pass did not reproduce the free run)."
        ),
        "",
    ]
    rows = []
    for p in sorted(good, key=lambda p: -p["forced"]["max_abs"]):
        f = p["forced"]
        n = f["n_positions"]
        rows.append(
            {
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
        )
    lines.append(table(rows))
    sites = fork_sites(good)
    if sites:
        n_forks = sum(len(k) for k in sites.values())
        lines += [
            "",
            f"The {plural(n_forks, 'fork')} of all pairs fall on "
            f"{plural(len(sites), 'distinct position')} (prompt, position).",
        ]
    pieces = {label(r): r.get("pieces", {}) for r in ok}
    flagged = sorted(
        ((p, fork) for p in good for fork in p["forced"]["forks"] if fork["kind"] == "red flag"),
        key=lambda x: -x[1]["margin"],
    )
    if flagged:
        lines += [
            "",
            f"Red-flag forks, largest margin first ({len(flagged)} in all, 10 shown):",
            "",
        ]
        lines.append(
            table(
                [
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
            )
        )
    path = view.plot("forced-positions")
    if path is not None:
        top = sorted(good, key=lambda p: -p["forced"]["max_abs_median"])[:6]
        curves = {
            f"{p['a']} vs {p['b']}": (
                [q["position"] for q in p["forced"]["per_position"]],
                [q["max_abs_median"] for q in p["forced"]["per_position"]],
            )
            for p in top
        }
        plots.forced_curves(curves, path, f"{view.model}: difference along the teacher's text")
        lines += [
            "",
            f"Median max \\|Δ\\| by position for the {len(top)} most different pairs:",
            "",
            view.link(path, "max |Δ| by position"),
        ]
    return "\n".join(lines)
