"""The serving conditions of one model: the determinism map (qdiff.judge.serving)."""

from __future__ import annotations

from typing import Any

from qdiff.core.labels import Combination
from qdiff.core.records import failure_text
from qdiff.core.serving import KINDS
from qdiff.core.stages import SERVING
from qdiff.judge.serving import CaseSummary, case_table, deterministic, stable_cases
from qdiff.report.fmt import code, num, table, text
from qdiff.report.view import ModelView


def section(view: ModelView) -> str:
    """The map: case × combination, then what each backend keeps bit-identical, then the
    size of the serving effects beside the device and setting effects."""
    records = view.stages.get(SERVING.name, [])
    cases_by_combination = case_table(records)
    if not cases_by_combination:
        reasons = sorted({failure_text(r) for r in records if r["status"] != "ok"})
        return (
            "_No serving cases ran"
            + (f": {'; '.join(map(text, reasons))}" if reasons else "")
            + "._"
        )
    serving = _settings(records)
    cases = [{k: v for k, v in c.items() if k != "prompts"} for c in serving["cases"]]
    parts = [
        _legend(serving, cases),
        _map(cases_by_combination, cases),
        _deterministic(records, cases_by_combination),
        _sources(records, cases_by_combination),
        _sizes(view, records, cases_by_combination, cases),
    ]
    return "\n\n".join(p for p in parts if p)


def _settings(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The serving settings and cases (in the config's order) of a record that ran, or of
    one that crashed on the way (its progress keeps them)."""
    for r in records:
        if r["status"] == "ok":
            return {**r["serving"], "cases": r["cases"]}
    return next(
        r["error"]["progress"]["serving"] for r in records if (r.get("error") or {}).get("progress")
    )


def _legend(serving: dict[str, Any], cases: list[dict[str, Any]]) -> str:
    kinds = dict.fromkeys(c["kind"] for c in cases)
    return (
        f"Each needle prompt ({', '.join(code(p) for p in serving.get('prompts', []))}) was "
        f"decoded greedily for {serving.get('n_tokens', '?')} tokens alone in a fresh context "
        "with the combination's own settings (the reference), then under each case below, and "
        "compared with the reference step by step up to the first step whose tokens differ. "
        "**=** every needle bit-identical at every step (needles, and steps compared over them: a "
        "text that ends early compares fewer); **Δ from s** the logits first differ "
        "at step s (max \\|Δ\\| over needles and steps), the texts do not fork; **fork at f** "
        "the greedy text changes at step f (earliest over the needles; k/n needles forked). "
        "Cases: " + "; ".join(f"**{text(k)}**: {text(KINDS[k])}" for k in kinds) + "."
    )


def _cell(summary: CaseSummary | None) -> str:
    if summary is None:
        return "–"
    if summary.status != "ok":
        return text(summary.status)
    if summary.bit_identical:
        return f"= ({summary.n_prompts}/{summary.n_prompts}, {summary.n_steps} steps)"
    moved = f", {num(summary.max_abs)}" if summary.max_abs is not None else ""
    if summary.fork_step is not None:
        return f"fork at {summary.fork_step} ({summary.forked}/{summary.n_prompts}){moved}"
    return f"Δ from {summary.first_differing_step}{moved}"


def _map(table_: dict[str, dict[str, CaseSummary]], cases: list[dict[str, Any]]) -> str:
    rows = [
        {
            "combination": code(label),
            **{text(c["label"]): _cell(by_case.get(c["id"])) for c in cases},
        }
        for label, by_case in table_.items()
    ]
    problems = [
        f"{code(label)} {code(cid)}: {text(s.reason)}"
        for label, by_case in table_.items()
        for cid, s in by_case.items()
        if s.status in ("failed", "crashed")
    ]
    not_applicable = {
        f"{code(cid)}: {text(s.reason)}"
        for by_case in table_.values()
        for cid, s in by_case.items()
        if s.status == "n/a"
    }
    said = table(rows)
    if problems:
        said += "\n\nCases that did not run: " + "; ".join(problems) + "."
    if not_applicable:
        said += "\n\nn/a: " + "; ".join(sorted(not_applicable)) + "."
    return said


def _deterministic(records: list[dict[str, Any]], table_: dict[str, dict[str, CaseSummary]]) -> str:
    """Per backend, the combinations under whose settings every case was bit-identical."""
    lines = []
    stable = stable_cases(records, table_)
    for backend, labels in deterministic(records, table_).items():
        kept = ", ".join(code(cid) for cid in stable.get(backend, [])) or "none"
        if labels:
            lines.append(
                f"- {text(backend)}: every case bit-identical on "
                + ", ".join(code(label) for label in labels)
                + " (each with its device's settings, as the runs table lists them)"
            )
        else:
            lines.append(
                f"- {text(backend)}: none of this model's combinations kept every case "
                f"bit-identical; the cases bit-identical on all of them: {kept}"
                + _closest(records, table_, backend)
            )
    return "Settings under which every case ran bit-identical, by backend:\n\n" + "\n".join(lines)


def _closest(
    records: list[dict[str, Any]], table_: dict[str, dict[str, CaseSummary]], backend: str
) -> str:
    """The backend's combinations with the most bit-identical cases (every one of a tie),
    and the cases each broke: the knobs left to fix for determinism there."""
    kept = {
        label: (sum(s.bit_identical for s in cases.values()), cases)
        for r in records
        if r["settings"]["backend"] == backend
        and (cases := table_.get(label := Combination.from_record(r).label))
    }
    if not kept:
        return ""
    most = max(n for n, _ in kept.values())
    closest = []
    for label, (n, cases) in kept.items():
        if n == most:
            broke = [cid for cid, s in cases.items() if s.status != "n/a" and not s.bit_identical]
            closest.append(
                f"{code(label)} kept {n} of {n + len(broke)} "
                f"(all but {', '.join(code(cid) for cid in broke)})"
            )
    return "; the closest: " + "; ".join(closest)


def _sources(records: list[dict[str, Any]], table_: dict[str, dict[str, CaseSummary]]) -> str:
    """What the source says of a break, where its code path was read and its conditions
    hold; every other difference is only measured."""
    split_kv = [
        code(Combination.from_record(r).label)
        for r in records
        if _takes_split_kv(r)
        and (s := table_.get(Combination.from_record(r).label, {}).get("threads-1"))
        and s.status == "ok"
        and not s.bit_identical
        and (s.first_differing_step or 0) >= 1
    ]
    said = [
        "Each case computes the same function as the reference with another batch, cache "
        "layout, ubatch or thread count, which can change which kernels run and the order "
        "in which they add (floating-point addition is not associative); no difference is "
        "called a bug here, and only a break named below is traced to its code."
    ]
    if split_kv:
        said.append(
            "The threads case on " + ", ".join(split_kv) + " differs from its first decoded "
            "step on, not at the prompt's: llama.cpp's CPU flash attention, for a single query "
            "row (one decoded token) over a KV view of at least 512 cells, splits the cells "
            "into one chunk per thread and merges the chunks' partial sums "
            "(`ggml-cpu/ops.cpp`, `use_split_kv_path`), so another thread count adds them in "
            "another order; a prompt's many rows are not split that way."
        )
    return " ".join(said)


def _takes_split_kv(record: dict[str, Any]) -> bool:
    """Whether the threads case's decoding meets use_split_kv_path's conditions: the CPU's
    flash attention, K and V in f16 or f32, and a KV view of at least 512 cells, which a
    prompt of more than 256 tokens gives (the used cells padded to 256, get_n_kv)."""
    settings = record["settings"]
    rows: list[dict[str, Any]] = next(
        (c["prompts"] for c in record.get("cases", []) if c["kind"] == "threads"), []
    )
    return (
        settings["backend"] == "cpu"
        and bool(settings["flash_attn"])
        and settings.get("kv_cache_type", "f16") in ("f16", "f32")
        and all(r.get("prompt_tokens", 0) > 256 for r in rows if r["status"] == "ok")
    )


def _sizes(
    view: ModelView,
    records: list[dict[str, Any]],
    table_: dict[str, dict[str, CaseSummary]],
    cases: list[dict[str, Any]],
) -> str:
    """The largest serving effect per combination beside the device and setting effects
    the teacher-forced comparison measures on the same file."""
    lines = []
    for label, by_case in table_.items():
        moved = [
            (s.median_step, c)
            for c in cases
            if (s := by_case.get(c["id"])) and s.status == "ok" and s.median_step
        ]
        if not moved:
            continue
        size, case = max(moved, key=lambda m: m[0])
        first = by_case[case["id"]].first_step
        nearby = _device_effects(view, label)
        lines.append(
            f"- {code(label)}: {text(case['label'])} moves the logits by max \\|Δ\\| "
            f"{num(first)} at the first step and {num(size)} at its median step (medians "
            "over the needles; steps up to the fork)" + (f"; {nearby}" if nearby else "")
        )
    if not lines:
        return ""
    return (
        "The largest serving effect of each combination, beside what changing the device "
        "or a setting does to the same file (the median over the run's prompts of the "
        "first step's max \\|Δ\\|; along the text, the teacher-forced comparison's median "
        "position):\n\n" + "\n".join(lines)
    )


def _device_effects(view: ModelView, label: str) -> str:
    """What changing the device or a setting does to this combination, for pairs on the
    same file: at the first step (median over the prompts of max |Δ|) and, where the
    teacher-forced comparison ran, along the teacher's text (its median position)."""
    dequant = label.split(".", 1)[1]
    effects = []
    for p in view.ok_pairs:
        if label not in (p["a"], p["b"]) or p["a"].split(".", 1)[1] != dequant:
            continue
        if p["b"].split(".", 1)[1] != dequant:
            continue
        forced = p.get("forced") or {}
        along = (
            f", {num(forced['max_abs_median'])} along the text"
            if forced.get("status") == "ok"
            else ""
        )
        other = p["a"] if p["b"] == label else p["b"]
        effects.append((p["summary"]["max_abs_median"], other, along))
    return ", ".join(
        f"against {code(other)} it differs by {num(size)} at the first step{along}"
        for size, other, along in sorted(effects, reverse=True)
    )
