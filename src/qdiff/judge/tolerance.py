"""Tolerances for cross-device tests, derived from everything the experiment compared.

A tolerance is only as good as the data it was checked against, so each one says what it
covers: which pairs (grouped by what changed between them: another backend or GPU, or only
settings on the same device), the first-step logits over the full vocabulary (over the
teacher's top-k when runs keep no more, ``first_step_logits: top_k``), and, where teacher
forcing ran, every later position over the logits it keeps (the teacher's top-k).
The recommended ``atol`` is 1.5× the largest difference over all of that, rounded up, so no
compared value exceeds it; the headroom is shown.

Covering the data it was derived from says nothing of new prompts, so each tolerance is also
checked out of sample (``held_out``): derived in the same way from a random half of the
prompts, then checked on the other half (each prompt's first step and forced positions),
over many halves, with the coverage's interval (qdiff.compare.stats.wilson). (Leaving out
one prompt at a time would not do: an atol above the maximum of the others covers every
prompt but the largest.) Which prompt sets the atol, and the atol without it, are said too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qdiff.compare.pairs import headline
from qdiff.compare.stats import wilson
from qdiff.core import markdown
from qdiff.core.labels import Pair
from qdiff.core.settings import RELATION_TEXT

HEADROOM = 1.5
CROSS_DEVICE = ("backend", "gpu")


def round_up(x: float) -> float:
    """x rounded up to two significant digits."""
    if x <= 0:
        return 0.0
    step = 10 ** (math.floor(math.log10(x)) - 1)
    return round(math.ceil(x / step - 1e-9) * step, 12)


@dataclass
class Tolerance:
    scope: str  # "cross-device", "same device, other settings", ...
    settings: str  # the settings that differ, as Markdown ("" unless one device's settings)
    dequant: str
    pairs: list[str]
    first_step_max: float  # over the full vocabulary, every prompt
    first_step_where: str
    first_step_values: int  # prompts x pairs
    forced_max: float | None  # over the teacher's top-k, every forced position
    forced_where: str | None
    forced_values: int  # positions x pairs
    top_k: int | None
    top1_first_step: tuple[int, int]
    top1_forced: tuple[int, int] | None
    forked: tuple[int, int]
    held_out: HeldOut | None  # checked on prompts it was not derived from

    @property
    def largest(self) -> float:
        return max(self.first_step_max, self.forced_max or 0.0)

    @property
    def atol(self) -> float:
        return round_up(HEADROOM * self.largest)

    @property
    def top1_always(self) -> bool:
        agree = [self.top1_first_step] + ([self.top1_forced] if self.top1_forced else [])
        return all(k == n for k, n in agree)


def _scope(result: dict[str, Any]) -> str:
    relation = result.get("relation", "backend")
    return "cross-device" if relation in CROSS_DEVICE else RELATION_TEXT[relation]


def worst_by_prompt(group: list[dict[str, Any]]) -> dict[str, float]:
    """Each prompt's largest difference over the group's pairs: its first step and, where
    teacher forcing ran, every forced position's kept logits."""
    worst: dict[str, float] = {}
    for p in group:
        along = p.get("forced", {}).get("per_prompt_max_abs", {})
        for row in p["prompts"]:
            value = max([row["max_abs"], *along.get(row["prompt"], [])])  # per position
            worst[row["prompt"]] = max(worst.get(row["prompt"], 0.0), value)
    return worst


SPLITS = 200  # random halves of the prompts


@dataclass(frozen=True)
class HeldOut:
    """A tolerance derived from half of the prompts, checked on the other half, over SPLITS
    random halves: how often a held-out prompt is within, and a held-out half all of it."""

    n_prompts: int
    prompt_within: float  # share of held-out prompts within, over all splits
    half_within: float  # share of splits whose every held-out prompt is within
    half_size: int  # prompts in a held-out half
    set_by: str  # the prompt of the largest difference
    atol_without_it: float  # the atol derived from every prompt but that one

    def interval(self) -> tuple[float, float]:
        """A Wilson interval for ``prompt_within`` counting each prompt once: the splits
        reuse the same prompts, so they are not more evidence than the prompts are."""
        return wilson(round(self.prompt_within * self.n_prompts), self.n_prompts)


def held_out(group: list[dict[str, Any]]) -> HeldOut | None:
    """The group's tolerance checked on prompts it was not derived from (``HeldOut``), or
    None with fewer than 4 prompts."""
    worst = worst_by_prompt(group)
    if len(worst) < 4:
        return None
    ids = sorted(worst, key=worst.__getitem__)
    values = np.array([worst[k] for k in ids])
    rng = np.random.default_rng(0)
    within = checked = halves = 0
    for _ in range(SPLITS):
        order = rng.permutation(len(values))
        fit, check = order[: len(values) // 2], order[len(values) // 2 :]
        ok = values[check] <= round_up(HEADROOM * values[fit].max())
        within += int(ok.sum())
        checked += len(check)
        halves += int(ok.all())
    return HeldOut(
        n_prompts=len(values),
        prompt_within=within / checked,
        half_within=halves / SPLITS,
        half_size=len(values) - len(values) // 2,
        set_by=ids[-1],
        atol_without_it=round_up(HEADROOM * values[-2]),
    )


def tolerances(pairs: list[dict[str, Any]]) -> list[Tolerance]:
    """One tolerance per scope and file, over the pairs that ran the same file."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in pairs:
        pair = Pair.from_result(p)
        if p["status"] == "ok" and pair.same_file and p.get("relation") != "same":
            groups.setdefault((_scope(p), pair.a.dequant), []).append(p)
    rows = []
    for (scope, dequant), group in sorted(
        groups.items(), key=lambda kv: (kv[0][0] != "cross-device", kv[0])
    ):
        worst = max(group, key=headline)
        forced = [p for p in group if p.get("forced", {}).get("status") == "ok"]
        worst_forced = max(forced, key=lambda p: p["forced"]["max_abs"]) if forced else None
        rows.append(
            Tolerance(
                scope=scope,
                settings=markdown.text("; ".join(sorted({d for p in group for d in p["differs"]})))
                if scope == "same device, other settings"
                else "",
                dequant=dequant,
                pairs=[f"{p['a']} vs {p['b']}" for p in group],
                first_step_max=headline(worst),
                first_step_where=f"{worst['a']} vs {worst['b']}",
                first_step_values=sum(p["summary"]["n_prompts"] for p in group),
                forced_max=worst_forced["forced"]["max_abs"] if worst_forced else None,
                forced_where=f"{worst_forced['a']} vs {worst_forced['b']}"
                if worst_forced
                else None,
                forced_values=sum(p["forced"]["n_positions"] for p in forced),
                top_k=forced[0]["forced"]["top_k"] if forced else None,
                top1_first_step=(
                    sum(p["summary"]["top1_agree_count"] for p in group),
                    sum(p["summary"]["n_prompts"] for p in group),
                ),
                top1_forced=(
                    sum(p["forced"]["top1_agree"] for p in forced),
                    sum(p["forced"]["n_positions"] for p in forced),
                )
                if forced
                else None,
                forked=(
                    sum(p["summary"]["forked"] for p in group),
                    sum(p["summary"]["n_prompts"] for p in group),
                ),
                held_out=held_out(group),
            )
        )
    return rows
