"""Sections about the whole experiment: what failed in which stage, and the provenance."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from qdiff.compare.distance import ranked, typical
from qdiff.compare.pairs import headline, label
from qdiff.compare.stats import LEVEL, geometric_mean, paired_ratio
from qdiff.core.records import failure_text
from qdiff.core.stages import RUN, STAGES
from qdiff.judge.diagnosis import fork_sites, plural
from qdiff.report.fmt import cell, code, count, num, table, text
from qdiff.report.view import ModelView

LEGEND = (
    "`unavailable`: this llama-cpp-python build or machine lacks the device's backend (or the "
    "teacher of a forced pass did not run), so it was left out, never run on another "
    "backend. `failed`: the stage crashed or errored; its log is named in the reason (under "
    "`results/logs/`), and the next `snakemake` retries it. `left out` (a prompt): too "
    "long for `generation.n_ctx`; the other prompts ran. A pair that involves a "
    'combination that did not run is `n/a`, never "equal".'
)


FOUND_MODELS = 3  # models named in the findings; the rest only in their sections


def found(views: list[ModelView]) -> str:
    """Three to five sentences, every number as a table below prints it: per model, the
    pair that differs most and the combinations closest to and farthest from the exact
    answer; then how the texts fork along the teacher's (sums of the forced table)."""
    sentences = [_found(v) for v in views[:FOUND_MODELS]]
    if len(views) > FOUND_MODELS:
        rest = len(views) - FOUND_MODELS
        sentences.append(
            f"{plural(rest, 'more model')} {'has its' if rest == 1 else 'have their'} own section{'' if rest == 1 else 's'}."
        )
    if any(v.forced_pairs for v in views):
        sentences.append(_fork_sites([fork_sites(v.forced_pairs) for v in views]))
    return "\n".join(f"- {s}" for s in sentences) or "_No model ran._"


def _fork_sites(per_model: list[dict[tuple[str, int], list[str]]]) -> str:
    """Forks along the teacher's text counted once per distinct site (model, prompt,
    position), however many pairs fork there; each pair's own forks are in its table."""
    sites = [kinds for model in per_model for kinds in model.values()]
    ties = sum(all(k == "near tie" for k in kinds) for kinds in sites)
    flagged = sum("red flag" in kinds for kinds in sites)
    return (
        f"Along the teacher's text, the pairs forked {plural(sum(map(len, sites)), 'time')} "
        f"at {plural(len(sites), 'distinct site')} (model, prompt, position): "
        f"{ties} near ties in every pair that forks there, {flagged} with a red flag and "
        f"{len(sites) - ties - flagged} undetermined (each pair's forks: the teacher-forced "
        "tables)."
    )


def _found(view: ModelView) -> str:
    if not view.ok_pairs:
        said = f"On {code(view.model)}, no two combinations' first steps were compared"
    else:
        top = max(view.ok_pairs, key=headline)
        s = top["summary"]
        if headline(top) == 0:
            said = (
                f"On {code(view.model)}, every compared pair gave bit-identical first-step "
                f"logits ({len(view.ok_pairs)} pair(s), {s['n_prompts']} prompts)"
            )
        else:
            said = f"On {code(view.model)}, " + _most_different(view.ok_pairs)
    exact = view.exact or {}
    rows = ranked(exact.get("rows", []))
    if exact.get("status") == "ok" and len(rows) > 1:
        near, far = rows[0], rows[-1]
        if all(r["first_step"].get("max_abs_by_prompt") for r in rows):
            said += "; " + _closest_and_farthest(rows)
        else:  # distances made by an older qdiff: worst prompts only, no ranking claimed
            said += (
                f"; {code(near['combination'])} has the smallest worst-prompt distance from "
                f"the exact answer (max |Δ| {num(near['first_step']['max_abs'])}), "
                f"{code(far['combination'])} the largest "
                f"({num(far['first_step']['max_abs'])})"
            )
    return said + "."


def _by_prompt(pair: dict[str, Any]) -> dict[str, float]:
    return {row["prompt"]: row["max_abs"] for row in pair["prompts"]}


def _most_different(pairs: list[dict[str, Any]]) -> str:
    """The pair that differs most over all prompts (the largest geometric mean of the
    per-prompt first-step max |Δ|), against the next by a paired ratio with its interval
    (qdiff.compare.stats)."""
    order = sorted(pairs, key=lambda p: geometric_mean(list(_by_prompt(p).values())))
    top = order[-1]
    s, values = top["summary"], _by_prompt(top)
    said = (
        f"{code(top['a'])} and {code(top['b'])} differ most (first-step max |Δ|, geometric "
        f"mean over {len(values)} prompts {num(geometric_mean(list(values.values())))}, worst "
        f"{num(headline(top))}; {count(s['forked'], s['n_prompts'])} greedy texts fork"
    )
    if len(order) > 1:
        nxt = _by_prompt(order[-2])
        shared = [q for q in values if q in nxt]
        r = paired_ratio([nxt[q] for q in shared], [values[q] for q in shared])
        versus = f"{code(order[-2]['a'])} vs {code(order[-2]['b'])}"
        said += (
            f"; {r['ratio']:.3g}× the next, {versus}"
            if r["verdict"] == "farther"
            else f"; indistinguishable on these prompts from the next, {versus}, ratio "
            f"{r['ratio']:.3g}"
        ) + f", {LEVEL:.0%} interval {r['low']:.3g}–{r['high']:.3g}"
    return said + ")"


def _closest_and_farthest(rows: list[dict[str, Any]]) -> str:
    """Which combination is closest to exact and which farthest, over the prompts; when
    even the closest and the farthest cannot be told apart, that, and no names."""
    near, far = rows[0], rows[-1]
    r = paired_ratio(
        near["first_step"]["max_abs_by_prompt"], far["first_step"]["max_abs_by_prompt"]
    )
    how = "(first-step max |Δ|, geometric mean over prompts)"
    if r["verdict"] != "farther":
        return (
            f"all {len(rows)} combinations are as far from the exact answer as each other on "
            f"these prompts ({num(typical(near))} to {num(typical(far))}; the largest over the "
            f"smallest, ratio {r['ratio']:.3g}, {LEVEL:.0%} interval {r['low']:.3g}–"
            f"{r['high']:.3g}) {how}"
        )
    return (
        f"{code(near['combination'])} is closest to the exact answer "
        f"({_nearest(near, rows[1])}), {_farthest(rows[-2], far)} {how}"
    )


def _farthest(second: dict[str, Any], far: dict[str, Any]) -> str:
    """The farthest combination, or the two farthest where the prompts cannot tell them
    apart (a paired ratio's interval holding 1)."""
    r = paired_ratio(
        second["first_step"]["max_abs_by_prompt"], far["first_step"]["max_abs_by_prompt"]
    )
    if r["verdict"] == "farther":
        return f"{code(far['combination'])} farthest ({num(typical(far))})"
    return (
        f"{code(far['combination'])} and {code(second['combination'])} farthest "
        f"({num(typical(far))} and {num(typical(second))}, indistinguishable on these prompts: "
        f"ratio {r['ratio']:.3g}, {LEVEL:.0%} interval {r['low']:.3g}–{r['high']:.3g})"
    )


def _nearest(near: dict[str, Any], second: dict[str, Any]) -> str:
    """How the nearest combination compares with the next, over the prompts."""
    a, b = near["first_step"]["max_abs_by_prompt"], second["first_step"]["max_abs_by_prompt"]
    r = paired_ratio(a, b)  # b / a, prompt by prompt: at least 1 (``a`` is the nearer)
    versus = (
        f"{r['ratio']:.3g}× nearer than {code(second['combination'])}"
        if r["verdict"] == "farther"
        else f"indistinguishable from {code(second['combination'])} on these prompts, ratio "
        f"{r['ratio']:.3g}"
    )
    return f"{num(typical(near))}; {versus}, {LEVEL:.0%} interval {r['low']:.3g}–{r['high']:.3g}"


Failure = tuple[str, str, str, str, str]  # model, what, stage, status, reason


def _stage_failures(v: ModelView) -> Iterator[Failure]:
    """A model's prompts left out and combinations failed, stage by stage."""
    for stage in STAGES.values():
        for r in v.stages.get(stage.name, []):
            for skipped in r.get("skipped_prompts", []):  # too long for the context
                what = f"prompt {skipped['id']}"
                yield v.model, what, stage.label, "left out", skipped["reason"]
            # a device left out is named by its run; later stages are left out with it
            if r["status"] == "failed" or (r["status"] != "ok" and stage is RUN):
                yield v.model, label(r), stage.label, r["status"], failure_text(r)


def _own_failures(v: ModelView) -> Iterator[Failure]:
    """What failed on its own: the exact reference, an error budget's emulations, the
    localisation, a comparison."""
    if v.exact is not None and v.exact["status"] != "ok":
        yield v.model, "exact reference", "exact reference", v.exact["status"], v.exact["reason"]
    for row in (v.exact or {}).get("rows", []):
        if row.get("budget", {}).get("status") == "failed":
            yield v.model, row["combination"], "error budget", "failed", row["budget"]["reason"]
    if v.localised is not None and v.localised.get("status") == "failed":
        yield v.model, "localisation", "localisation", "failed", failure_text(v.localised)
    for p in v.pairs:
        if p["status"] == "failed":
            yield v.model, f"{p['a']} vs {p['b']}", "comparison", "failed", failure_text(p)


def failures(views: list[ModelView]) -> str:
    """Every stage's failures (qdiff.core.stages), one row per combination and reason,
    naming the stages it cost; then exact references, error budgets, comparisons and
    localisations that failed on their own."""
    grouped: dict[tuple[str, str, str, str], list[str]] = {}
    for v in views:
        for model, what, stage, status, reason in [*_stage_failures(v), *_own_failures(v)]:
            grouped.setdefault((model, what, status, reason), []).append(stage)
    if not grouped:
        return "Every stage of every combination ran."
    rows = [
        {
            "model": code(model),
            "what": code(what),
            "stages": ", ".join(dict.fromkeys(stages)),
            "status": text(status),
            "reason": text(reason),
        }
        for (model, what, status, reason), stages in grouped.items()
    ]
    return LEGEND + "\n\n" + table(rows)


def provenance(records: list[dict[str, Any]]) -> str:
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return "_no combination ran_"
    first = ok[0]["provenance"]
    common = {
        "qdiff": text(first["qdiff"]),
        "llama-cpp-python": text(first["llama_cpp_python"]),
        "Python": text(first["python"]),
        "NumPy": text(first["numpy"]),
        "OS": text(first["os"]),
        "CPU": text(first["cpu_model"]),
        "llama.cpp system info": code(first["system_info"]),
    }
    lines = [f"- **{k}**: {v}" for k, v in common.items()]
    licences = {r["model"]: r["provenance"]["model_file"].get("licence") for r in ok}
    lines += ["- **model licences** (as each file and its source declare them):"] + [
        f"  - {code(model)}: {text(licence or 'not recorded')}"
        for model, licence in licences.items()
    ]
    rows = []
    for r in ok:
        prov = r["provenance"]
        used = ", ".join(f"{d['name']} ({d['description']})" for d in prov["used_devices"])
        gpu = prov.get("device_info") or {}
        rows.append(
            {
                "model": code(r["model"]),
                "combination": code(label(r)),
                "device used": text(
                    used
                    + (f", driver {gpu['driver']}, CUDA {gpu['cuda']}" if gpu.get("cuda") else "")
                ),
                "model file sha256": code(prov["model_file"]["sha256"][:16]) + "…",
                "weight types": text(
                    ", ".join(f"{k}×{v}" for k, v in prov["model_file"]["weight_types"].items())
                ),
                "settings": text(
                    ", ".join(
                        f"{k}={v}"
                        for k, v in r["settings"].items()
                        if k not in ("backend", "env") and v != {}
                    )
                ),
                # values of names qdiff does not know as settings are placeholders (qdiff.core.secrets)
                "env": text(
                    ", ".join(f"{k}={v}" for k, v in r["settings"].get("env", {}).items()) or "–"
                ),
            }
        )
    return "\n".join(lines) + "\n\n" + table(rows)


def claims(views: list[ModelView]) -> str:
    """The write-up's claims next to what qdiff measured (qdiff.judge.claims)."""
    from qdiff.judge import claims as claims_lib

    return (
        (claims_lib.__doc__ or "").split("\n\n", 1)[1].strip()
        + "\n\n"
        + table([{k: cell(v) for k, v in row.items()} for row in claims_lib.check_all(views)])
    )
