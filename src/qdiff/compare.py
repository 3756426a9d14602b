"""Compare two runs of the same model: per prompt and as one summary row."""

from __future__ import annotations

from typing import Any

import numpy as np

from qdiff.forcing import compare_forced
from qdiff.metrics import fork_step, logit_metrics

# Bump when a comparison's fields change: it is a param of the compare rule, so existing
# comparisons are recomputed instead of reaching the report without the new fields.
COMPARE_FORMAT = 3


def label(record: dict[str, Any]) -> str:
    return f"{record['device']}.{record['dequant']}"


def what_differs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
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


def compare_runs(
    rec_a: dict[str, Any], logits_a: np.ndarray, rec_b: dict[str, Any], logits_b: np.ndarray
) -> dict[str, Any]:
    """Everything the report and the pairs table need about one pair."""
    pair = {
        "model": rec_a["model"],
        "a": label(rec_a),
        "b": label(rec_b),
        "differs": what_differs(rec_a, rec_b),
    }
    not_ok = [f"{label(r)} {r['status']}" for r in (rec_a, rec_b) if r["status"] != "ok"]
    if not_ok:
        return {**pair, "status": "n/a", "reason": "; ".join(not_ok), "prompts": []}
    ids_b = {p["id"]: i for i, p in enumerate(rec_b["prompts"])}
    shared = [(i, ids_b[p["id"]]) for i, p in enumerate(rec_a["prompts"]) if p["id"] in ids_b]
    if not shared:
        return {**pair, "status": "n/a", "reason": "no prompt in common", "prompts": []}
    rows_a, rows_b = zip(*shared)
    m = logit_metrics(logits_a[list(rows_a)], logits_b[list(rows_b)])
    prompts = []
    for k, (i, j) in enumerate(shared):
        pa, pb = rec_a["prompts"][i], rec_b["prompts"][j]
        prompts.append(
            {
                "prompt": pa["id"],
                "max_abs": float(m["max_abs"][k]),
                "mean_abs": float(m["mean_abs"][k]),
                "rms": float(m["rms"][k]),
                "nmse": float(m["nmse"][k]),
                "kl": float(m["kl"][k]),
                "top1_agree": bool(m["top1_a"][k] == m["top1_b"][k]),
                "top1_margin_a": float(m["margin_a"][k]),
                "dp_top": float(m["dp_top"][k]),
                "kl_ba": float(m["kl_ba"][k]),
                "dp_top_ba": float(m["dp_top_ba"][k]),
                "bit_identical": bool(m["bit_identical"][k]),
                "fork_step": fork_step(pa["tokens"], pb["tokens"]),
                "same_prompt_tokens": pa["n_prompt_tokens"] == pb["n_prompt_tokens"],
                "text_a": pa["text"],
                "text_b": pb["text"],
            }
        )
    forks = [p["fork_step"] for p in prompts if p["fork_step"] is not None]
    max_abs = np.array([p["max_abs"] for p in prompts])
    kl = np.array([p["kl"] for p in prompts])
    summary = {
        "n_prompts": len(prompts),
        "max_abs": float(max_abs.max()),
        "max_abs_median": float(np.median(max_abs)),
        "max_abs_p90": float(np.percentile(max_abs, 90)),
        "mean_abs": float(np.mean([p["mean_abs"] for p in prompts])),
        "rms": float(np.sqrt(np.mean([p["rms"] ** 2 for p in prompts]))),
        "nmse": float(np.mean([p["nmse"] for p in prompts])),
        "kl_mean": float(np.mean([p["kl"] for p in prompts])),
        "kl_max": float(kl.max()),
        "kl_median": float(np.median(kl)),
        "kl_p99": float(np.percentile(kl, 99)),
        "dp_rms": float(np.sqrt(np.mean([p["dp_top"] ** 2 for p in prompts]))),
        "top1_agree": sum(p["top1_agree"] for p in prompts),
        "bit_identical": sum(p["bit_identical"] for p in prompts),
        "forked": len(forks),
        "first_fork_step": min(forks) if forks else None,
        "median_fork_step": float(np.median(forks)) if forks else None,
    }
    return {**pair, "status": "ok", "summary": summary, "prompts": prompts}


def compare_forced_runs(
    rec_a: dict[str, Any], data_a: dict[str, np.ndarray],
    rec_b: dict[str, Any], data_b: dict[str, np.ndarray],
) -> dict[str, Any]:
    """The teacher-forced part of a pair (qdiff.forcing), or why there is none."""
    not_ok = [f"{label(r)} {r['status']}" for r in (rec_a, rec_b) if r["status"] != "ok"]
    if not_ok:
        return {"status": "n/a", "reason": "teacher-forced " + "; ".join(not_ok)}
    if rec_a["prompt_ids"] != rec_b["prompt_ids"]:
        return {"status": "n/a", "reason": "the forced passes ran different prompts"}
    return {"teacher": rec_a["teacher"], **compare_forced(data_a, data_b, rec_a["prompt_ids"])}
