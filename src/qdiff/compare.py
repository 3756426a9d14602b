"""Compare two runs of the same model: per prompt and as one summary (qdiff.records.PairResult)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.forcing import compare_forced
from qdiff.io import load_array, load_arrays, read_json
from qdiff.labels import Combination, Pair
from qdiff.metrics import PAIR_METRICS, fork_step, logit_metrics, summarise
from qdiff.records import ErrorInfo, PairResult, Record
from qdiff.settings import relation

# Bump when a comparison's fields change: it is a param of the compare rule, so existing
# comparisons are recomputed instead of reaching the report without the new fields.
COMPARE_FORMAT = 4


def label(record: Mapping[str, Any]) -> str:
    return Combination.from_record(record).label


def what_differs(a: Record, b: Record) -> list[str]:
    """The settings that differ between two runs, as "key a→b" (backend first)."""
    changes = []
    if a["dequant"] != b["dequant"]:
        changes.append(f"dequant {a['dequant']}→{b['dequant']}")
    sa, sb = a["settings"], b["settings"]
    for key in sorted(set(sa) | set(sb), key=lambda k: (k != "backend", k)):
        if sa.get(key) != sb.get(key):
            changes.append(f"{key} {_short(sa.get(key))}→{_short(sb.get(key))}")
    return changes


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "{}"
    return str(value)


def _head(rec_a: Record, rec_b: Record) -> PairResult:
    return {
        "model": rec_a["model"],
        "a": label(rec_a),
        "b": label(rec_b),
        "differs": what_differs(rec_a, rec_b),
        "relation": relation(rec_a["settings"], rec_b["settings"]),
    }


def _python(value: Any) -> Any:
    return bool(value) if isinstance(value, np.bool_) else float(value)


def compare_runs(
    rec_a: Record, logits_a: np.ndarray, rec_b: Record, logits_b: np.ndarray
) -> PairResult:
    """Everything the report and the pairs table need about one pair."""
    pair = _head(rec_a, rec_b)
    not_ok = [f"{label(r)} {r['status']}" for r in (rec_a, rec_b) if r["status"] != "ok"]
    if not_ok:
        return {**pair, "status": "n/a", "reason": "; ".join(not_ok), "prompts": []}
    ids_b = {p["id"]: i for i, p in enumerate(rec_b["prompts"])}
    shared = [(i, ids_b[p["id"]]) for i, p in enumerate(rec_a["prompts"]) if p["id"] in ids_b]
    if not shared:
        return {**pair, "status": "n/a", "reason": "no prompt in common", "prompts": []}
    rows_a, rows_b = zip(*shared, strict=True)
    values = logit_metrics(logits_a[list(rows_a)], logits_b[list(rows_b)])
    prompts = []
    for k, (i, j) in enumerate(shared):
        pa, pb = rec_a["prompts"][i], rec_b["prompts"][j]
        prompts.append(
            {
                "prompt": pa["id"],
                **{m.key: _python(values[m.key][k]) for m in PAIR_METRICS},
                "fork_step": fork_step(pa["tokens"], pb["tokens"]),
                "same_prompt_tokens": pa["n_prompt_tokens"] == pb["n_prompt_tokens"],
                "text_a": pa["text"],
                "text_b": pb["text"],
            }
        )
    forks = [p["fork_step"] for p in prompts if p["fork_step"] is not None]
    summary = {
        "n_prompts": len(prompts),
        **summarise(values),
        "forked": len(forks),
        "first_fork_step": min(forks) if forks else None,
        "median_fork_step": float(np.median(forks)) if forks else None,
    }
    return {**pair, "status": "ok", "summary": summary, "prompts": prompts}


def compare_files(
    record_a: Path,
    logits_a: Path,
    record_b: Path,
    logits_b: Path,
    forced: tuple[Path, Path, Path, Path] | None = None,
) -> PairResult:
    """``compare_runs`` (and ``compare_forced_runs`` when ``forced`` gives the two forced
    records and data files) on files; arrays are read only for records that ran."""
    rec_a, rec_b = read_json(record_a), read_json(record_b)
    ran = rec_a["status"] == rec_b["status"] == "ok"
    result = compare_runs(
        rec_a,
        load_array(logits_a) if ran else np.zeros((0, 0)),
        rec_b,
        load_array(logits_b) if ran else np.zeros((0, 0)),
    )
    if forced is not None:
        fa, da, fb, db = forced
        frec_a, frec_b = read_json(fa), read_json(fb)
        both = frec_a["status"] == frec_b["status"] == "ok"
        result["forced"] = compare_forced_runs(
            frec_a, load_arrays(da) if both else {}, frec_b, load_arrays(db) if both else {}
        )
    return result


def compare_forced_runs(
    rec_a: Record,
    data_a: dict[str, np.ndarray],
    rec_b: Record,
    data_b: dict[str, np.ndarray],
) -> dict[str, Any]:
    """The teacher-forced part of a pair (qdiff.forcing), or why there is none."""
    not_ok = [f"{label(r)} {r['status']}" for r in (rec_a, rec_b) if r["status"] != "ok"]
    if not_ok:
        return {"status": "n/a", "reason": "teacher-forced " + "; ".join(not_ok)}
    if rec_a["prompt_ids"] != rec_b["prompt_ids"]:  # type: ignore[typeddict-item]
        return {"status": "n/a", "reason": "the forced passes ran different prompts"}
    result = compare_forced(data_a, data_b, rec_a["prompt_ids"])  # type: ignore[typeddict-item]
    return {"teacher": rec_a["teacher"], **result}  # type: ignore[typeddict-item]


def failed_pair(pair: Pair, error: ErrorInfo) -> PairResult:
    """A comparison that could not be computed: the report shows why, never "equal"."""
    return {
        "model": pair.model,
        "a": pair.a.label,
        "b": pair.b.label,
        "differs": [],
        "status": "failed",
        "reason": f"comparison failed: {error['message']}",
        "prompts": [],
    }


def headline(result: Mapping[str, Any]) -> float:
    """The number pairs are ranked by: the largest first-step max |Δ| over prompts."""
    return float(result["summary"]["max_abs_max"])
