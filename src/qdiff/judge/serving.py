"""What the serving cases say (qdiff.core.serving): per case and combination, over the
needles, whether the output stayed bit-identical, how much it moved and where it forked;
per backend, the settings under which every case stayed bit-identical."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from qdiff.core.labels import Combination


@dataclass(frozen=True)
class CaseSummary:
    """One case of one combination, over its needles."""

    status: str  # ok | failed | n/a | crashed
    n_prompts: int = 0  # needles compared
    n_steps: int = 0  # steps compared, over the needles (a text that ends early has fewer)
    identical: int = 0  # needles bit-identical at every compared step
    first_differing_step: int | None = None  # earliest over the needles
    fork_step: int | None = None  # earliest over the needles
    forked: int = 0  # needles whose text forked
    max_abs: float | None = None  # largest over needles and compared steps
    median_step: float | None = None  # median over the needles of the median step's max |Δ|
    first_step: float | None = None  # median over the needles of the first step's max |Δ|
    reason: str = ""

    @property
    def bit_identical(self) -> bool:
        return self.status == "ok" and self.identical == self.n_prompts > 0


def summarise(case: dict[str, Any]) -> CaseSummary:
    """A case's rows (one per needle) in one summary; a case where any needle failed is
    failed, one where none ran n/a."""
    rows = case["prompts"]
    failed = [r for r in rows if r["status"] == "failed"]
    ok = [r for r in rows if r["status"] == "ok"]
    if failed:
        return CaseSummary("failed", reason=failed[0]["reason"])
    if not ok:
        return CaseSummary("n/a", reason=rows[0]["reason"] if rows else "no prompt ran")
    firsts = [r["first_differing_step"] for r in ok if r["first_differing_step"] is not None]
    forks = [r["fork_step"] for r in ok if r["fork_step"] is not None]
    moved = [r["max_abs"] for r in ok if "max_abs" in r]
    medians = [r["max_abs_median_step"] for r in ok if r.get("max_abs_median_step") is not None]
    firsts_moved = [r["max_abs_first_step"] for r in ok if r.get("max_abs_first_step") is not None]
    return CaseSummary(
        "ok",
        n_prompts=len(ok),
        n_steps=sum(r["n_steps"] for r in ok),
        identical=sum(
            1 for r in ok if r["first_differing_step"] is None and r["fork_step"] is None
        ),
        first_differing_step=min(firsts, default=None),
        fork_step=min(forks, default=None),
        forked=len(forks),
        max_abs=max(moved, default=None),
        median_step=statistics.median(medians) if medians else None,
        first_step=statistics.median(firsts_moved) if firsts_moved else None,
    )


def case_table(records: list[dict[str, Any]]) -> dict[str, dict[str, CaseSummary]]:
    """By combination label, by case id: the summaries of every serving record. A record
    that crashed keeps the cases it finished; the case it was in is ``crashed``."""
    table: dict[str, dict[str, CaseSummary]] = {}
    for r in records:
        label = Combination.from_record(r).label
        if r["status"] == "ok":
            table[label] = {c["id"]: summarise(c) for c in r["cases"]}
            continue
        progress = (r.get("error") or {}).get("progress")
        if progress is None:
            continue
        done = {cid: summarise({"prompts": rows}) for cid, rows in progress["done"].items() if rows}
        current = progress["current"].split(",")[0].removeprefix("case ")
        done[current] = CaseSummary("crashed", reason=r["error"]["message"])
        table[label] = done
    return table


def deterministic(
    records: list[dict[str, Any]], table: dict[str, dict[str, CaseSummary]]
) -> dict[str, list[str]]:
    """By backend: the combinations (labels) whose every case that ran stayed bit-identical
    for every needle, with no case failed; an empty list: none was found."""
    found: dict[str, list[str]] = {}
    for r in records:
        label = Combination.from_record(r).label
        found.setdefault(r["settings"]["backend"], [])
        cases = table.get(label)
        if r["status"] != "ok" or not cases:
            continue
        ran = [s for s in cases.values() if s.status != "n/a"]
        if ran and all(s.bit_identical for s in ran):
            found[r["settings"]["backend"]].append(label)
    return found


def stable_cases(
    records: list[dict[str, Any]], table: dict[str, dict[str, CaseSummary]]
) -> dict[str, list[str]]:
    """By backend: the cases (ids) that stayed bit-identical on every combination of that
    backend where they ran (a case n/a on one combination does not count against it)."""
    by_backend: dict[str, list[dict[str, CaseSummary]]] = {}
    for r in records:
        cases = table.get(Combination.from_record(r).label)
        if cases:
            by_backend.setdefault(r["settings"]["backend"], []).append(cases)
    stable: dict[str, list[str]] = {}
    for backend, combos in by_backend.items():
        ids = dict.fromkeys(cid for cases in combos for cid in cases)
        stable[backend] = [
            cid
            for cid in ids
            if (ran := [c[cid] for c in combos if cid in c and c[cid].status != "n/a"])
            and all(s.bit_identical for s in ran)
        ]
    return stable
