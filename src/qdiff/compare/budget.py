"""A combination's error budget: how much of its distance from exact each of llama.cpp's
rounding sources explains, against the floor below which no emulation can be told apart.

Per combination whose sources the engine follows (qdiff.exact.roundings), over the first
step of every prompt (max |Δ| over the full vocabulary, per prompt):
- ``distance``: the run against exact;
- each source alone, and all of the combination's sources together, against exact;
- ``residual``: the run against the engine with all of its sources: what they leave;
- ``floor``: the larger of (a) the emulation against itself with every rounding's input
  moved by about a float32 sum's error (``jittered``: where an input lies that close to a
  rounding boundary, llama.cpp's float32 value may round the other way) and (b) the run
  against itself in other ubatches (the serving stage's ``ubatch-n`` cases, on its prompts:
  only the order of its float32 sums changes), and at least FLOAT32_LEVEL of the run's
  largest logit (where no rounding lies near a tie, the jittered draws move nothing).

If the emulation follows every rounding the run makes, the run is one more draw of what
the jittered emulations are, so each prompt's residual is within its floor (the larger of
J draws) with probability J/(J+1). The combination is ``explained`` unless its prompts
within the floor are too few for that (a one-sided binomial test at ALPHA), and
``unexplained`` otherwise: a rounding the run makes and the emulation does not follow. The
median ratio residual / floor says by how much; no single prompt decides. Where the floor is
RESOLUTION of the distance from exact or more, the test has no power (an emulation that
leaves a source out passes too): ``unresolved``, and only the sizes (each source alone and
all together, against the run's distance) say anything.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from qdiff.core.records import failure_text
from qdiff.core.roundings import (
    FA_TILE_Q,
    NOT_FOLLOWED_LABELS,
    SOURCE_LABELS,
    plan,
    ubatch_of,
    vulkan_int_dot,
    vulkan_path_problem,
)

ALPHA = 0.01  # the test's level: "unexplained" is wrong once in a hundred faithful emulations
# a floor of at least this share of the distance from exact leaves the test without power:
# any emulation of about the right size passes it ("unresolved")
RESOLUTION = 0.5
# where no rounding lies near a tie, jittering moves nothing and the floor would be 0; the
# run still differs from the emulation by the order of its float32 sums: about this much
# of its largest logit (measured on CUDA: tiny models' first steps within 1.6e-06 of
# logits of about 10, docs/results/cuda-roundings)
FLOAT32_LEVEL = 2.0**-20


def _spread(per_prompt: np.ndarray) -> dict[str, float]:
    return {"max": float(per_prompt.max()), "median": float(np.median(per_prompt))}


def _max_abs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.float64) - b.astype(np.float64)).max(axis=1)


def ubatch_floor(serving: dict[str, Any] | None, run: dict[str, Any]) -> dict[str, float]:
    """The largest first-step change of the run when only its ubatch size changes, per
    serving prompt (none without such a case). With CPU flash attention, a prompt of at
    least FA_TILE_Q tokens takes another path in smaller ubatches (qdiff.exact.roundings),
    which changes roundings and not only the order of sums: such prompts are left out. On
    CUDA every matmul's kernel follows the ubatch's size (MMVQ or MMQ, MMF or cuBLAS:
    qdiff.exact.cuda), so another ubatch is another rounding, never a floor: none."""
    settings = run["settings"]
    if serving is None or serving.get("status") != "ok" or settings["backend"] == "cuda":
        return {}
    flash_attn = bool(settings.get("flash_attn"))
    lengths = {p["id"]: len(p["prompt_tokens"]) for p in run["prompts"]}
    by_prompt: dict[str, float] = {}
    for case in serving["cases"]:
        if case["kind"] != "ubatch":
            continue
        for row in case["prompts"]:
            if row["status"] != "ok" or row.get("max_abs_first_step") is None:
                continue
            if flash_attn and lengths.get(row["id"], 0) >= FA_TILE_Q:
                continue
            by_prompt[row["id"]] = max(by_prompt.get(row["id"], 0.0), row["max_abs_first_step"])
    return by_prompt


def budget(
    plan: dict[str, Any],
    emulated: dict[str, np.ndarray],
    applies: dict[str, bool],
    exact: np.ndarray,
    logits: np.ndarray,
    prompt_ids: list[str],
    ubatch: dict[str, float],
) -> dict[str, Any]:
    """One combination's budget (see the module's docstring); ``plan`` is its entry of
    qdiff.exact.roundings.plan, ``emulated`` the engine's first steps by set id, ``applies``
    which of those sets can change anything for this model, ``ubatch`` the run's floor by prompt."""
    if "not_emulated" in plan:
        return {"status": "n/a", "reason": plan["not_emulated"]}
    sources = []
    for name, config in plan["sources"].items():
        if not applies.get(config, True):
            continue
        sources.append(
            {"name": name, "label": SOURCE_LABELS[name]}
            | _spread(_max_abs(emulated[config], exact))
        )
    together = emulated[plan["together"]]
    residual = _max_abs(together, logits)
    jitter = np.max([_max_abs(emulated[j], together) for j in plan["jittered"]], axis=0)
    run_floor = np.array([ubatch.get(p, 0.0) for p in prompt_ids])
    level = FLOAT32_LEVEL * np.abs(logits.astype(np.float64)).max(axis=1)
    floor = np.maximum(np.maximum(jitter, run_floor), level)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(floor > 0, residual / floor, np.where(residual > 0, np.inf, 0.0))
    return {
        "status": "ok",
        "not_followed": plan.get("not_followed", []),
        "n_prompts": len(prompt_ids),
        "distance": _spread(_max_abs(logits, exact)),
        "sources": sources,
        "together": _spread(_max_abs(together, exact)),
        "residual": _spread(residual),
        "floor": _spread(floor),
        "floor_parts": {
            "jittered": _spread(jitter),
            "float32": _spread(level),
            "ubatch": {p: ubatch[p] for p in prompt_ids if p in ubatch},
        },
        "ratio_median": float(np.median(ratio)),
        "within_floor": int((residual <= floor).sum()),
        "p_value": binomial_tail(
            int((residual <= floor).sum()), len(prompt_ids), len(plan["jittered"])
        ),
    }


def binomial_tail(within: int, n: int, draws: int) -> float:
    """P(at most ``within`` of ``n`` prompts within the floor) when each is with probability
    draws / (draws + 1): how unlikely so few are for a faithful emulation."""
    p = draws / (draws + 1)
    return float(sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(within + 1)))


def combination_budget(
    record: dict[str, Any],
    logits: np.ndarray,
    serving: dict[str, Any] | None,
    roundings: tuple[dict[str, Any], dict[str, np.ndarray]],
    exact_first: np.ndarray,
) -> dict[str, Any]:
    """``budget`` for one run (its record and first-step logits), from the engine's
    emulations (``roundings``: the exact_roundings record and arrays) and its serving
    job's record (the floor), or why there is none."""
    entry = plan({"run": (record["settings"], record["dequant"])})[1]["run"]
    vulkan = record["settings"]["backend"] == "vulkan" and "sources" in entry
    provenance = record.get("provenance", {})
    if vulkan and (why := vulkan_path_problem(provenance, ubatch_of(record["settings"]))):
        return {"status": "n/a", "reason": f"not emulated: {why}"}
    if vulkan and vulkan_int_dot(provenance):  # the shaders of integer dot products
        entry = entry.pop("int_dot", entry)
    emulation, emulated = roundings
    if emulation["status"] != "ok":  # the report lists it with the failures
        return {"status": "failed", "reason": f"no emulation: {failure_text(emulation)}"}
    # what the engine met on these prompts and did not follow (by their lengths, heads
    # and ubatches: CUDA's flash attention beyond its first tile)
    met = emulation.get("not_followed", {}).get(entry.get("together"), [])
    entry["not_followed"] = [NOT_FOLLOWED_LABELS[key] for key in met]
    ids = [p["id"] for p in record["prompts"]]
    if ids != emulation["prompt_ids"]:
        return {"status": "n/a", "reason": "the run and the emulation have other prompts"}
    needed = [entry["together"], *entry["jittered"]] if "sources" in entry else []
    missing = [config for config in needed if config not in emulated]
    if missing:
        why = emulation.get("not_emulated", {}).get(missing[0])
        reason = (
            f"not emulated: {why}" if why else "the emulation of these settings was not computed"
        )
        return {"status": "n/a", "reason": reason}
    ubatch = ubatch_floor(serving, record)
    return budget(entry, emulated, emulation["applies"], exact_first, logits, ids, ubatch)


def verdict(row: dict[str, Any]) -> str:
    """``unexplained`` when the prompts within the floor are too few for a faithful
    emulation (p < ALPHA); else ``unresolved`` when the floor is RESOLUTION of the distance
    from exact or more (an emulation leaving out a source passes as well: only the sizes
    say anything), else ``explained``."""
    if row["p_value"] < ALPHA:
        return "unexplained"
    if row["floor"]["median"] >= RESOLUTION * row["distance"]["median"]:
        return "unresolved"
    return "explained"
