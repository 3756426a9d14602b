"""Sections about the whole experiment: what failed in which stage, and the provenance."""

from __future__ import annotations

from typing import Any

from qdiff.compare.pairs import headline, label
from qdiff.core.records import failure_text
from qdiff.core.stages import RUN, STAGES
from qdiff.judge.diagnosis import plural
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
    forced = [p["forced"] for v in views for p in v.forced_pairs]
    forks = sum(len(f["forks"]) for f in forced)
    if forced:
        sentences.append(
            f"Along the teacher's text, the pairs forked {plural(forks, 'time')} in all: "
            f"{plural(sum(f['near_ties'] for f in forced), 'near tie')}, "
            f"{plural(sum(f['red_flags'] for f in forced), 'red flag')} and "
            f"{sum(f.get('undetermined', 0) for f in forced)} undetermined "
            "(the teacher-forced tables)."
        )
    return "\n".join(f"- {s}" for s in sentences) or "_No model ran._"


def _found(view: ModelView) -> str:
    if not view.ok_pairs:
        said = f"On {code(view.model)}, no two combinations were compared"
    else:
        top = max(view.ok_pairs, key=headline)
        s = top["summary"]
        if headline(top) == 0:
            said = (
                f"On {code(view.model)}, every compared pair gave bit-identical first-step "
                f"logits ({len(view.ok_pairs)} pair(s), {s['n_prompts']} prompts)"
            )
        else:
            said = (
                f"On {code(view.model)}, {code(top['a'])} and {code(top['b'])} differ most "
                f"(first-step max |Δ| {num(headline(top))}; "
                f"{count(s['forked'], s['n_prompts'])} greedy texts fork)"
            )
    exact = view.exact or {}
    rows = sorted(
        (r for r in exact.get("rows", []) if r["status"] == "ok"),
        key=lambda r: r["first_step"]["max_abs"],
    )
    if exact.get("status") == "ok" and len(rows) > 1:
        near, far = rows[0], rows[-1]
        said += (
            f"; {code(near['combination'])} is closest to the exact answer (max |Δ| "
            f"{num(near['first_step']['max_abs'])}), {code(far['combination'])} farthest "
            f"({num(far['first_step']['max_abs'])})"
        )
    return said + "."


def failures(views: list[ModelView]) -> str:
    """Every stage's failures (qdiff.core.stages), one row per combination and reason,
    naming the stages it cost; then exact references, comparisons and localisations that
    failed on their own."""
    grouped: dict[tuple[str, str, str, str], list[str]] = {}

    def add(model: str, what: str, stage: str, status: str, reason: str) -> None:
        grouped.setdefault((model, what, status, reason), []).append(stage)

    for v in views:
        for stage in STAGES.values():
            for r in v.stages.get(stage.name, []):
                for skipped in r.get("skipped_prompts", []):  # too long for the context
                    add(
                        v.model,
                        f"prompt {skipped['id']}",
                        stage.label,
                        "left out",
                        skipped["reason"],
                    )
                # a device left out is named by its run; later stages are left out with it
                if r["status"] == "failed" or (r["status"] != "ok" and stage is RUN):
                    add(v.model, label(r), stage.label, r["status"], failure_text(r))
        if v.exact is not None and v.exact["status"] != "ok":
            add(v.model, "exact reference", "exact reference", v.exact["status"], v.exact["reason"])
        if v.localised is not None and v.localised.get("status") == "failed":
            add(v.model, "localisation", "localisation", "failed", failure_text(v.localised))
        for p in v.pairs:
            if p["status"] == "failed":
                add(v.model, f"{p['a']} vs {p['b']}", "comparison", "failed", failure_text(p))
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
