"""How far each combination is from the exact answer of its weights (qdiff.exact).

Per combination, with the exact logits as the reference side of every metric:
- at the first step, over the full vocabulary and every prompt: max |Δ|, RMS, NMSE,
  KL(exact ‖ combination) and top-1 agreement; over the teacher's top-k tokens of the forced
  pass's position 0 when runs keep no full logits (``first_step_logits: top_k``, then
  ``first_step_top_k`` says so);
- along the teacher's text, at every forced position, over the logits teacher forcing keeps
  (qdiff.compare.forced): max |Δ| (median and max over positions), KL (a lower bound of the full
  KL), and top-1 agreement.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qdiff.compare.forced import compare_forced, first_step_metrics, with_probabilities
from qdiff.compare.metrics import METRICS, logit_metrics, median, percentile, summarise
from qdiff.compare.pairs import label
from qdiff.compare.stats import geometric_mean
from qdiff.core.records import failure_text


def distance(
    exact: dict[str, np.ndarray],
    exact_prompts: list[str],
    record: dict[str, Any],
    logits: np.ndarray | None,
    forced: tuple[dict[str, Any], dict[str, np.ndarray]] | None,
) -> dict[str, Any]:
    """One combination's distance from exact, or why there is none. ``logits`` None: the
    run kept none (first_step_logits: top_k), so its first step is the forced pass's."""
    row: dict[str, Any] = {"combination": label(record), "dequant": record["dequant"]}
    if record["status"] != "ok":
        return {**row, "status": "n/a", "reason": f"{record['status']}: {failure_text(record)}"}
    ids = [p["id"] for p in record["prompts"]]
    if ids != exact_prompts:
        return {
            **row,
            "status": "n/a",
            "reason": "the run and the exact reference have other prompts",
        }
    if logits is not None:
        values = logit_metrics(exact["first_logits"], logits.astype(np.float64))
    elif forced is not None and forced[0]["status"] == "ok":
        values = _first_steps_from_forced(exact, ids, forced[0], forced[1])
        row["first_step_top_k"] = int(forced[0]["top_k"])
    else:
        reason = "no first-step logits (first_step_logits: top_k) and no teacher-forced pass"
        return {**row, "status": "n/a", "reason": reason}
    summary = summarise(values)
    row.update(
        status="ok",
        n_prompts=len(ids),
        first_step={
            "max_abs": summary["max_abs_max"],
            "max_abs_median": summary["max_abs_median"],
            # per prompt, in the run's order: what paired comparisons are decided by
            "max_abs_by_prompt": [float(x) for x in values["max_abs"]],
            "rms": summary["rms_rms"],
            "nmse": summary["nmse_mean"],
            "kl_mean": summary["kl_mean"],
            "kl_max": summary["kl_max"],
            "top1_agree": int(summary["top1_agree_count"]),
        },
    )
    if forced is not None:
        row["forced"] = _along_the_text(exact, exact_prompts, *forced)
    return row


def _along_the_text(
    exact: dict[str, np.ndarray],
    exact_prompts: list[str],
    record: dict[str, Any],
    arrays: dict[str, np.ndarray],
) -> dict[str, Any]:
    """A combination's forced pass against exact, at every forced position."""
    if record["status"] != "ok":
        return {"status": "n/a", "reason": failure_text(record)}
    result = compare_forced(exact, arrays, exact_prompts)
    if result["status"] != "ok":
        return result
    kept = ("n_positions", "max_abs", "max_abs_median", "kl_mean", "top1_agree")
    # per prompt, the median over its positions: what a comparison along the text pairs
    by_prompt = {pid: median(np.asarray(v)) for pid, v in result["per_prompt_max_abs"].items()}
    return {"status": "ok", **{k: result[k] for k in kept}, "max_abs_median_by_prompt": by_prompt}


def _first_steps_from_forced(
    exact: dict[str, np.ndarray],
    ids: list[str],
    record: dict[str, Any],
    data: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Every PAIR_METRIC per prompt of exact vs a forced pass's position 0, over the slice."""
    exact, data = with_probabilities(exact), with_probabilities(data)
    rows = [
        first_step_metrics(exact, data, k, record["prompt_ids"].index(pid))
        for k, pid in enumerate(ids)
    ]
    return {key: np.array([r[key] for r in rows]) for key in METRICS}


def typical(row: dict[str, Any]) -> float:
    """A combination's first-step distance from exact over all its prompts: the geometric
    mean of the per-prompt max |Δ| (its worst prompt's, for a distance made by an older
    qdiff, which kept no per-prompt values)."""
    per_prompt = row["first_step"].get("max_abs_by_prompt")
    if not per_prompt:
        return float(row["first_step"]["max_abs"])
    return geometric_mean(per_prompt)


def ranked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The combinations that ran, nearest to exact first (``typical``)."""
    return sorted((r for r in rows if r["status"] == "ok"), key=typical)


def closest(rows: list[dict[str, Any]]) -> str | None:
    """The combination nearest to exact over all prompts (``typical``)."""
    order = ranked(rows)
    return order[0]["combination"] if order else None


def tokenizer_problem(reference: dict[str, Any], record: dict[str, Any]) -> str | None:
    """Why two runs' logits do not index the same tokens, or None: other token texts (the
    same vocabulary size is not enough), or prompts that tokenize to other ids."""
    theirs, ours = (r["provenance"]["model_file"].get("tokenizer") for r in (reference, record))
    if theirs is None or ours is None:
        return (
            "the tokenizers were not recorded (a model file made by an older qdiff): make it "
            "again, e.g. snakemake --forcerun fetch_model, to compare the two models"
        )
    if theirs["sha256"] != ours["sha256"]:
        return (
            f"another tokenizer than the reference model's ({ours['n_tokens']} vs "
            f"{theirs['n_tokens']} tokens, other token texts): their logits index other "
            "tokens, so they are not comparable"
        )
    other = [
        p["id"]
        for p, q in zip(record["prompts"], reference["prompts"], strict=True)
        if p["prompt_tokens"] != q["prompt_tokens"]
    ]
    if other:
        return (
            f"prompts {', '.join(other)} tokenize to other ids than in the reference model's "
            "run (another chat template?): the first steps answer other inputs"
        )
    return None


def against_reference_model(
    reference: dict[str, Any],
    reference_logits: np.ndarray,
    reference_exact: np.ndarray | None,
    record: dict[str, Any],
    logits: np.ndarray | None,
) -> dict[str, Any]:
    """One combination of a model against another model's reference run (as
    llama-perplexity --kl-divergence compares a quantized model with its original: KL, the
    same top token, RMS Δp) and, when there is one, against that model's exact answer."""
    row: dict[str, Any] = {"combination": label(record), "dequant": record["dequant"]}
    if record["status"] != "ok" or logits is None:
        return {**row, "status": "n/a", "reason": f"{record['status']}: {failure_text(record)}"}
    if reference["status"] != "ok":
        return {**row, "status": "n/a", "reason": f"the reference {label(reference)} did not run"}
    if [p["id"] for p in record["prompts"]] != [p["id"] for p in reference["prompts"]]:
        return {**row, "status": "n/a", "reason": "other prompts than the reference model's run"}
    if problem := tokenizer_problem(reference, record):
        return {**row, "status": "n/a", "reason": problem}
    if logits.shape != reference_logits.shape:
        return {
            **row,
            "status": "n/a",
            "reason": (
                f"another vocabulary than the reference model ({logits.shape[1]} vs "
                f"{reference_logits.shape[1]} tokens): not comparable"
            ),
        }
    values = logit_metrics(reference_logits.astype(np.float64), logits.astype(np.float64))
    kl = values["kl"]
    row.update(
        status="ok",
        n_prompts=len(kl),
        kl_mean=float(kl.mean()),
        kl_median=median(kl),
        kl_p99=percentile(kl, 99),
        kl_max=float(kl.max()),
        same_top=int(values["top1_agree"].sum()),
        rms_dp=float(np.sqrt(np.mean(values["dp_top"] ** 2))),
        max_abs=float(values["max_abs"].max()),
    )
    if reference_exact is not None:
        exact = logit_metrics(reference_exact, logits.astype(np.float64))
        row["vs_exact"] = {
            "max_abs": float(exact["max_abs"].max()),
            "kl_mean": float(exact["kl"].mean()),
            "same_top": int(exact["top1_agree"].sum()),
        }
    return row
