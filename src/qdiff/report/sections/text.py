"""A real text, scored as llama-perplexity scores it (qdiff.compare.text): every combination
against the exact answer, and every pair of combinations."""

from __future__ import annotations

from typing import Any

from qdiff.compare.stats import LEVEL
from qdiff.compare.text import BLOCK, P_DIFF_PERCENTILES
from qdiff.core.records import failure_text
from qdiff.core.stages import TEXT
from qdiff.report import figures
from qdiff.report.fmt import code, num, table, text
from qdiff.report.view import ModelView

LEGEND = (
    "Each combination teacher-forced along the same text, in windows of {n_ctx} tokens from "
    "an empty KV cache, the second half of each window scored against the text's next token, "
    "as `llama-perplexity --kl-divergence` scores a text; its statistics, computed as it "
    "computes them (± is its uncertainty, which treats positions as independent). KLD is "
    "KL(base ‖ combination) over the teacher's top {top_k} tokens and one bucket for the rest "
    "of the vocabulary: a lower bound of the full KL (llama-perplexity sums over the tokens "
    "the base gives a log-probability above −16, stored as uint16). *Same top* is the share of "
    "positions whose most likely token is the base's; *top-1 in top 5* that of positions where "
    "the base's most likely token is among the combination's 5 most likely."
)


def section(view: ModelView) -> str:
    records = view.stages.get(TEXT.name, [])
    result = view.text
    if not any(r["status"] == "ok" for r in records):
        reasons = sorted({failure_text(r) for r in records if r["status"] != "ok"})
        return f"_The text was not scored: {'; '.join(map(text, reasons)) or 'no text job ran'}._"
    if result is None or result.get("status") != "ok":
        why = failure_text(result) if result else "it did not run"
        return f"_The text was scored, but its comparison failed: {text(why)}._"
    parts = [
        _source(result),
        LEGEND.format(n_ctx=result["n_ctx"], top_k=result["top_k"]),
        _against_exact(result),
        _delta_p_plot(view, result["vs_exact"]),
        _against_reference_model(result.get("reference_model")),
        _pairs(result),
        _not_run(result),
    ]
    return "\n\n".join(p for p in parts if p)


def _source(result: dict[str, Any]) -> str:
    source = result.get("source", {})
    return (
        f"Text: {code(source.get('file', '?'))} (sha256 {code(source.get('sha256', '?'))})"
        f"{', ' + text(source['about']) if source.get('about') else ''}: "
        f"{result['n_text_tokens']:,} tokens, {result['n_windows']} windows, "
        f"{result['n_scored']:,} positions scored; token ids kept: the teacher "
        f"{code(result['teacher'])}'s top {result['top_k']}."
    )


def _pm(pair: list[float], digits: int = 3) -> str:
    return f"{num(pair[0], digits)} ± {num(pair[1], 2)}"


def _pct(pair: list[float]) -> str:
    return f"{100 * pair[0]:.2f} ± {100 * pair[1]:.2f} %"


def _row(stats: dict[str, Any]) -> dict[str, str]:
    """A row of llama-perplexity's figures (no bit-identity: against float64 or another
    model it means nothing; the pairs' table has it)."""
    return {
        "PPL": _pm(stats["ppl"], 5),
        "ln(PPL/PPL base)": _pm(stats["ln_ppl_ratio"]),
        "mean KLD": _pm(stats["kld"]),
        "99.9% KLD": num(stats["kld_percentiles"]["99.9"]),
        "max KLD": num(stats["kld_percentiles"]["100"]),
        "RMS Δp": _pct(stats["p_diff_rms"]),
        "same top": _pct(stats["same_top"]),
        "top-1 in top 5": f"{100 * stats['top1_in_top5']:.2f} %",
    }


def _against_exact(result: dict[str, Any]) -> str:
    vs_exact = result["vs_exact"]
    if not vs_exact:
        status = result.get("exact_status")
        why = f"the exact answer along the text is {text(status)}" if status else "exact is off"
        return f"_Not measured against the exact answer: {why}._"
    first = next(iter(vs_exact.values()))
    rows = [{"combination": code(label), **_row(s)} for label, s in vs_exact.items()]
    head = (
        f"**Against the exact answer** (the float64 engine, PPL {_pm(first['ppl_base'], 5)}), "
        f"the base:"
    )
    return "\n\n".join([head, table(rows), _extremes(result["extremes"])])


# the Δp percentiles plotted: those compare_text keeps from 1 to 99 (beyond, single positions)
DELTA_P_LEVELS = sorted(float(q) for q in P_DIFF_PERCENTILES if 1 <= q <= 99)


def _delta_p_plot(view: ModelView, vs_exact: dict[str, Any]) -> str:
    """Δp's percentiles, every combination against the exact answer, one line each."""
    path = view.plot("delta-p")
    if path is None or not vs_exact:
        return ""
    lines = {
        label: [s["p_diff_percentiles"][f"{q:g}"] for q in DELTA_P_LEVELS]
        for label, s in vs_exact.items()
    }
    title = f"{view.model}: Δp along the text\nagainst the exact answer"
    figures.delta_p_percentiles(lines, DELTA_P_LEVELS, path, title)
    return (
        "Percentiles of Δp over the scored positions, each combination's probability of the "
        "text's token minus the exact answer's (a symmetric-log scale unless all are 0):\n\n"
        + view.link(path, "Δp percentiles against exact")
    )


def _against_reference_model(reference: dict[str, Any] | None) -> str:
    if reference is None:
        return ""
    model = code(reference["model"])
    if reference["status"] != "ok":
        return f"_Not measured against the reference model {model}: its text pass is {text(reference['status'])}._"
    rows = [
        {"combination": code(label), **_row(s)}
        if s["comparable"]
        else {"combination": code(label), "PPL": f"not comparable: {text(s['reason'])}"}
        for label, s in reference["rows"].items()
    ]
    head = (
        f"**Against the reference model** {model} (its reference combination's pass, the base; "
        "KLD over the token ids both kept and one bucket for the rest):"
    )
    return "\n\n".join([head, table(rows)])


def _extremes(extremes: dict[str, Any] | None) -> str:
    """Nearest, next and farthest, each pair decided block by block with its interval;
    a sentence says no more than the pair it rests on."""
    if extremes is None:
        return ""
    near, nxt, far = (code(extremes[k]) for k in ("nearest", "runner_up", "farthest"))
    lead, spread = extremes["lead"], extremes["spread"]
    if spread["verdict"] == "indistinguishable":
        return (
            f"The nearest and the farthest by KLD from exact, {near} and {far}, cannot be told "
            f"apart on this text: {far}'s KLD is {_ratio(spread)} {near}'s."
        )
    first = (
        f"{near} is nearest the exact answer: the next, {nxt}, has {_ratio(lead)} its KLD"
        if lead["verdict"] == "farther"
        else f"{near} has the smallest KLD from exact and {nxt} the next, and the two cannot "
        f"be told apart on this text ({nxt}'s is {_ratio(lead)} {near}'s)"
    )
    return f"{first}. The farthest, {far}, has {_ratio(spread)} the nearest's KLD."


def _ratio(r: dict[str, Any]) -> str:
    return (
        f"{num(r['ratio'])} times (geometric mean of the ratio over {r['n']} blocks of about "
        f"{BLOCK} positions, {LEVEL:.0%} bootstrap interval {num(r['low'])}-{num(r['high'])}; "
        f"larger on {r['farther_on']} of {r['n']} blocks)"
    )


def _pairs(result: dict[str, Any]) -> str:
    pairs = sorted(result["pairs"].values(), key=lambda p: p["kld"][0])
    rows = [
        {
            "base": code(p["a"]),
            "combination": code(p["b"]),
            "mean KLD": _pm(p["kld"]),
            "RMS Δp": _pct(p["p_diff_rms"]),
            "same top": _pct(p["same_top"]),
            "bit-identical positions": f"{p['identical_positions']:,} of {p['n']:,}",
        }
        for p in pairs
    ]
    if not rows:
        return ""
    return "\n\n".join(
        [
            "**Pairs of combinations** (the teacher as the base where it is in the pair):",
            table(rows),
        ]
    )


def _not_run(result: dict[str, Any]) -> str:
    if not result["not_run"]:
        return ""
    listed = ", ".join(f"{code(k)} ({text(v)})" for k, v in result["not_run"].items())
    return f"Not scored: {listed}."
