"""Explain a model's pairwise differences with explicit rules over the measured matrix.

Every finding names its rule and the numbers it rests on; nothing is fixed text. Rules:

Every comparison of two differences is decided over the prompts, never by one prompt's
maximum: the geometric mean of the per-prompt ratio of first-step max |Δ| with its bootstrap
interval (qdiff.compare.stats.paired_ratio), over at least ``MIN_PROMPTS`` prompts; a rule
fires only when the whole interval is past its threshold.

- ``activation-quantization``: for two devices that ran the file (``none``) and its ``f32``
  copy, the file's difference is at least ``AMPLIFICATION`` times the copies'. The weights are
  the same in both cases, so the excess comes from the quantized-weight kernels, which round
  the activations (formats per backend from qdiff.core.backends).
- ``float-precision``: two backends' ``f32`` copies differ by no more than one fp16 rounding of
  the weights on one device (its ``f32`` vs ``f16`` copy): summation order, TF32 and fp16
  arithmetic explain a gap of that size. A gap larger over the prompts is reported as
  unexplained.
- ``setting``: two devices of the same backend that differ only in settings: the setting
  change, and how far it moves the logits on each file.
- ``device-blame``: on the quantized file, a same-backend setting change moves the logits at
  least ``COMPARABLE`` times as much as a change of backend does, so "the device" is not the
  only cause of forks.
- ``unexplained``: a cross-backend difference that none of the rules above accounts for.
- ``red-flag fork`` / ``forks``: along the teacher's text (qdiff.compare.forced), each fork is a near
  tie, a red flag or undetermined. Forks are counted per pair and, since many pairs fork at
  the same place, by distinct site (prompt, position); a site counts as a near tie only when
  every pair that forks there is one.
- ``tiny-yet-parts-early``: a pair whose first-step max |Δ| is tiny against the model's other
  pairs, prompt by prompt (the others' per-prompt median over the pair's, a geometric mean
  over prompts whose bootstrap interval lies at or above ``1/TINY``), yet whose free-running
  texts (qdiff.compare.generations) part on at least ``PARTED`` of the prompts at a median
  divergence index within ``EARLY`` of ``generation.n_tokens``: the share with its Wilson
  interval, and the median index.

With the exact answer of the weights (qdiff.exact, qdiff.compare.distance):

- ``closer-to-exact``: for each pair that differs and asks one question (two devices on one
  file, or one device on two files), which side is closer to exact and by how much at the
  first step, decided over the prompts by a paired ratio with its bootstrap interval
  (qdiff.compare.stats; "as far as each other" when the interval holds 1), and the median
  distance of each along the text;
- ``more-precise-not-closer``: a pair that differs only in a setting that looks more precise
  (an f32 copy, an f32 KV cache) whose more precise side is *not* closer to exact, decided
  the same way;
- ``float-path``: how far each CPU device's f32 copy is from exact, and how much of that
  an f32 KV cache (a sibling device, measured) removes;
- ``error-budget-*``: per combination whose rounding sources the engine follows
  (qdiff.compare.budget), each source alone and all together, and what remains against the
  run's sensitivity floor: ``explained`` within it, ``unexplained`` above it, ``no floor``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np

from qdiff.compare.budget import verdict
from qdiff.compare.forced import MIN_SCALE_POSITIONS, TIE_FACTOR
from qdiff.compare.generations import generation_cap, generations_of, pair_stats
from qdiff.compare.pairs import headline
from qdiff.compare.stats import LEVEL, geometric_mean, paired_ratio
from qdiff.core import markdown
from qdiff.core.backends import BACKENDS
from qdiff.core.labels import Combination, Pair

AMPLIFICATION = 10.0
COMPARABLE = 0.5
TINY = 0.1  # tiny: the other pairs' first-step max |Δ| at least 1/TINY times a pair's
PARTED = 0.5  # texts part early: on at least this share of the prompts,
EARLY = 0.25  # at a median divergence index within this share of generation.n_tokens
MIN_PROMPTS = 5  # prompts a "tiny" verdict is decided over, at least
Key = tuple[str, str]  # (device, dequant)


@dataclass
class Finding:
    rule: str
    text: str
    numbers: dict[str, float] = field(default_factory=dict)


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Matrix:
    """A model's runs and pair summaries, keyed by (device, dequant)."""

    def __init__(self, records: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> None:
        ok = [r for r in records if r["status"] == "ok"]
        self.records: dict[Key, dict[str, Any]] = {Combination.from_record(r).key: r for r in ok}
        self.devices = list(dict.fromkeys(r["device"] for r in ok))
        self.backend = {r["device"]: r["settings"]["backend"] for r in ok}
        self.exact: dict[Key, dict[str, Any]] = {}  # distance-from-exact rows, when measured
        self.pairs: dict[frozenset[Key], dict[str, Any]] = {}
        for p in pairs:
            if p["status"] == "ok":
                pair = Pair.from_result(p)
                self.pairs[frozenset((pair.a.key, pair.b.key))] = p

    def pair(self, a: Key, b: Key) -> dict[str, Any] | None:
        return self.pairs.get(frozenset((a, b)))

    def max_abs(self, a: Key, b: Key) -> float | None:
        p = self.pair(a, b)
        return None if p is None else headline(p)

    def by_prompt(self, a: Key, b: Key) -> dict[str, float]:
        """A pair's first-step max |Δ| per prompt; empty for a pair not compared."""
        p = self.pair(a, b)
        return {} if p is None else _max_abs_by_prompt(p)

    def weight_types(self, dequant: str) -> list[str]:
        for (_, dq), r in self.records.items():
            if dq == dequant:
                return list(r["provenance"]["model_file"]["weight_types"])
        return []

    def from_exact(self, key: Key) -> list[float] | None:
        """A combination's first-step max |Δ| from exact per prompt, where measured."""
        row = self.exact.get(key)
        return None if row is None else _per_prompt(row)

    def settings_only(self, d1: str, d2: str) -> list[str] | None:
        """The settings that differ between two devices of one backend, else None; as the
        findings' Markdown quotes them (a setting's value is the user's text)."""
        if self.backend[d1] != self.backend[d2]:
            return None
        p = self.pair((d1, "none"), (d2, "none"))
        return None if p is None else [markdown.text(d) for d in p["differs"]]


def _paired(near: dict[str, float], far: dict[str, float]) -> dict[str, Any] | None:
    """How many times ``far`` is ``near``, paired by prompt over the prompts both have with
    finite values: ``paired_ratio`` over those where both differ. A prompt bit-identical on
    both sides says nothing and is left out (``zeros``); one where only ``near`` is 0 has an
    unbounded ratio, so the interval's upper end is infinite (``near_zero``), and one where
    only ``far`` is 0 a ratio of 0, so its lower end is 0 (``far_zero``). With fewer than
    MIN_PROMPTS prompts where both differ, the ratio is infinite only when ``near`` is 0 and
    ``far`` is not on at least MIN_PROMPTS prompts and never the other way round; else None:
    an interval would be one prompt's verdict."""
    common = [p for p in near if p in far and math.isfinite(near[p]) and math.isfinite(far[p])]
    both = [p for p in common if near[p] > 0 and far[p] > 0]
    extra = {
        "zeros": sum(near[p] == 0 == far[p] for p in common),
        "near_zero": sum(near[p] == 0 < far[p] for p in common),
        "far_zero": sum(far[p] == 0 < near[p] for p in common),
        "worst_near": max((near[p] for p in common), default=0.0),
        "worst_far": max((far[p] for p in common), default=0.0),
    }
    if len(both) < MIN_PROMPTS:
        if extra["near_zero"] >= MIN_PROMPTS and not extra["far_zero"]:
            infinite = {"ratio": math.inf, "low": math.inf, "high": math.inf}
            return {
                **infinite,
                "n": 0,
                "farther_on": extra["near_zero"],
                "verdict": "farther",
                **extra,
            }
        return None
    r = {**paired_ratio([near[p] for p in both], [far[p] for p in both]), **extra}
    if extra["near_zero"]:
        r["high"] = math.inf
    if extra["far_zero"]:
        r["low"] = 0.0
    return r


def _how(r: dict[str, Any], near: str, far: str) -> str:
    """How a ratio of ``_paired`` was decided, for a finding's text; ``near`` and ``far`` name
    the two differences (the denominator and the numerator)."""
    if r["n"] == 0:
        return (
            f"{near} bit-identical on {r['near_zero']} prompts where {far} differ, by up to "
            f"{_fmt(r['worst_far'])}"
        )
    notes = [
        f"{plural(r[key], 'prompt')} where {what}"
        for key, what in (
            ("zeros", "both sides are bit-identical, left out"),
            ("near_zero", f"{near} alone are bit-identical (an unbounded ratio)"),
            ("far_zero", f"{far} alone are bit-identical (a ratio of 0)"),
        )
        if r[key]
    ]
    return (
        f"geometric mean over {r['n']} prompts of the per-prompt ratio of first-step max |Δ|, "
        f"{LEVEL:.0%} bootstrap interval {r['low']:.3g}–{r['high']:.3g}; worst prompts "
        f"{_fmt(r['worst_far'])} vs {_fmt(r['worst_near'])}" + "".join(f"; {n}" for n in notes)
    )


def _ratio_numbers(r: dict[str, Any]) -> dict[str, float]:
    return {"ratio": r["ratio"], "low": r["low"], "high": r["high"]}


def _activation_quantization(m: Matrix, d1: str, d2: str) -> Finding | None:
    r = _paired(m.by_prompt((d1, "f32"), (d2, "f32")), m.by_prompt((d1, "none"), (d2, "none")))
    if r is None or not r["low"] >= AMPLIFICATION:
        return None
    ratio = "∞" if math.isinf(r["ratio"]) else f"{r['ratio']:.3g}×"
    types = m.weight_types("none")
    same = m.backend[d1] == m.backend[d2]
    what = f"same backend, {'; '.join(m.settings_only(d1, d2) or [])}: " if same else ""
    head = (
        f"`{d1}` vs `{d2}` ({what}the quantized file differs {ratio} more than its f32 copies: "
        f"{_how(r, 'the f32 copies', 'the runs of the file')}). The weights are the same, so the "
        "excess "
        "comes from "
    )
    numbers = {"quantized": r["worst_far"], "f32": r["worst_near"], **_ratio_numbers(r)}
    rounds, keeps = _who_rounds(m, (d1, d2))
    if rounds or keeps:  # the exact answer says which side's quantized kernels round
        parts = [
            f"`{d}`'s file run is {_from_exact_text(x)} "
            f"({BACKENDS[m.backend[d]].activation_formats(types)})"
            for d, x in rounds
        ]
        parts += [
            f"`{d}`'s file run is {_from_exact_text(x)}: its kernels add no rounding of that "
            "size here"
            for d, x in keeps
        ]
        sides = " and ".join(f"`{d}`" for d, _ in rounds) or "neither side"
        return Finding(
            "activation-quantization",
            head + f"the quantized-weight kernels of {sides}: " + "; ".join(parts) + ".",
            numbers,
        )
    formats = sorted({BACKENDS[m.backend[d]].activation_formats(types) for d in (d1, d2)})
    return Finding(
        "activation-quantization",
        head
        + f"the quantized-weight kernels, by their activation formats ({' | '.join(formats)})"
        + (": a small change upstream is amplified by that rounding." if same else "."),
        numbers,
    )


def _from_exact_text(r: dict[str, Any]) -> str:
    return (
        f"{r['ratio']:.3g}× as far from exact as its f32 copy (typical {_fmt(r['file'])} vs "
        f"{_fmt(r['copy'])}; {LEVEL:.0%} interval {r['low']:.3g}–{r['high']:.3g} over "
        f"{r['n']} prompts)"
    )


def _who_rounds(
    m: Matrix, devices: tuple[str, str]
) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, dict[str, Any]]]]:
    """Of the devices whose file run and f32 copy were both measured against exact, prompt
    by prompt: those whose file run is at least ``AMPLIFICATION`` times further from exact
    over the prompts (their quantized kernels round: the interval's lower end), and those
    whose file run is less (its upper end); a device the interval leaves undecided is in
    neither."""
    rounds: list[tuple[str, dict[str, Any]]] = []
    keeps: list[tuple[str, dict[str, Any]]] = []
    for d in devices:
        file, copy = m.from_exact((d, "none")), m.from_exact((d, "f32"))
        if file is None or copy is None or len(file) != len(copy) or len(file) < MIN_PROMPTS:
            continue
        r = {**paired_ratio(copy, file), "file": geometric_mean(file), "copy": geometric_mean(copy)}
        if r["low"] >= AMPLIFICATION:
            rounds.append((d, r))
        elif r["high"] < AMPLIFICATION:
            keeps.append((d, r))
    return rounds, keeps


def _float_precision(m: Matrix, d1: str, d2: str) -> Finding | None:
    if m.backend[d1] == m.backend[d2]:
        return None
    f = m.by_prompt((d1, "f32"), (d2, "f32"))
    if not f:
        return None
    if not any(f.values()):
        return Finding(
            "float-precision",
            f"`{d1}` vs `{d2}`: their f32 copies are bit-identical on all {len(f)} prompts: no "
            "gap to explain.",
            {"f32": 0.0},
        )
    halves = [x for d in (d1, d2) if (x := m.by_prompt((d, "f32"), (d, "f16")))]
    # per prompt, the larger of the two devices' fp16 roundings of the weights
    h = {p: max(x[p] for x in halves if p in x) for p in f if any(p in x for x in halves)}
    r = _paired(h, f) if h else None
    gap = _median_text(f, max(f.values()))
    if r is None:
        why = (
            "with no f16 copy to compare against"
            if not h
            else f"with fewer than {MIN_PROMPTS} prompts to compare it with one fp16 rounding by"
        )
        return Finding(
            "unexplained",
            f"`{d1}` vs `{d2}`: their f32 copies differ by {gap}; {why}, this gap is unexplained.",
            {"f32": max(f.values())},
        )
    numbers = {"f32": r["worst_far"], "fp16_rounding": r["worst_near"], **_ratio_numbers(r)}
    versus = _how(r, "the f32 and f16 copies", "the f32 copies of the two devices")
    if r["low"] > 1:
        return Finding(
            "unexplained",
            f"`{d1}` vs `{d2}`: their f32 copies differ by {gap}, {r['ratio']:.3g}× one fp16 "
            f"rounding of the weights ({versus}): unexplained by float precision.",
            numbers,
        )
    size = "no more than" if r["high"] <= 1 else "about as large as"
    return Finding(
        "float-precision",
        f"`{d1}` vs `{d2}`: their f32 copies differ by {gap}, {size} one fp16 rounding of "
        f"the weights on one device ({r['ratio']:.3g}×: {versus}). Float summation order and "
        "TF32/fp16 arithmetic explain a gap of this size.",
        numbers,
    )


def _settings(m: Matrix, d1: str, d2: str) -> Finding | None:
    change = m.settings_only(d1, d2)
    if not change:
        return None
    parts = []
    numbers = {}
    for dev, dq in m.records:
        if dev != d1 or (p := m.pair((d1, dq), (d2, dq))) is None:
            continue
        s = p["summary"]
        numbers[dq] = headline(p)
        typical = _median_text(_max_abs_by_prompt(p), headline(p))
        parts.append(
            f"{dq}: bit-identical on all {s['n_prompts']} prompts"
            if s["bit_identical_count"] == s["n_prompts"]
            else f"{dq}: max |Δ| {typical}, forks {s['forked']}/{s['n_prompts']}"
        )
    return Finding(
        "setting",
        f"`{d1}` vs `{d2}` (same backend) differ only in {'; '.join(change)}: "
        + ", ".join(parts)
        + ".",
        numbers,
    )


def _median_text(by_prompt: dict[str, float], worst: float) -> str:
    """A pair's first-step max |Δ| as the findings state it: the median over prompts and
    the worst."""
    if not by_prompt:
        return f"{_fmt(worst)} (worst prompt)"
    return f"{_fmt(float(np.median(list(by_prompt.values()))))} median over prompts, worst {_fmt(worst)}"


def _device_blame(m: Matrix, d1: str, d2: str) -> Finding | None:
    if m.backend[d1] == m.backend[d2]:
        return None
    cross = m.by_prompt((d1, "none"), (d2, "none"))
    if not cross or not any(cross.values()):
        return None
    best: tuple[dict[str, Any], str, str] | None = None
    for a, b in combinations(m.devices, 2):
        single = len(m.settings_only(a, b) or []) == 1  # one named cause, not a mix
        if single and m.backend[a] in (m.backend[d1], m.backend[d2]):
            r = _paired(cross, m.by_prompt((a, "none"), (b, "none")))
            if r is not None and (best is None or r["low"] > best[0]["low"]):
                best = (r, a, b)
    if best is None or not best[0]["low"] >= COMPARABLE:
        return None
    r, a, b = best
    return Finding(
        "device-blame",
        f"`{d1}` vs `{d2}` on the quantized file: first-step max |Δ| "
        f"{_median_text(cross, max(cross.values()))}. A same-backend change (`{a}` vs `{b}`: "
        f"{'; '.join(m.settings_only(a, b) or [])}) moves it {r['ratio']:.0%} as much "
        f"({_how(r, 'the two devices', 'the same-backend pair')}), "
        "so the change of device is not the only cause of forks.",
        {"cross_device": r["worst_near"], "same_device": r["worst_far"], **_ratio_numbers(r)},
    )


def fork_sites(pairs: list[dict[str, Any]]) -> dict[tuple[str, int], list[str]]:
    """Distinct fork sites (prompt, position) along the teacher's text, with the kind of
    the fork in every pair that forks there."""
    sites: dict[tuple[str, int], list[str]] = {}
    for p in pairs:
        if p.get("forced", {}).get("status") == "ok":
            for fork in p["forced"]["forks"]:
                sites.setdefault((fork["prompt"], fork["position"]), []).append(fork["kind"])
    return sites


def _forks(pairs: list[dict[str, Any]]) -> list[Finding]:
    forced = [p for p in pairs if p.get("forced", {}).get("status") == "ok"]
    findings = []
    for p in (p for p in forced if p["forced"]["red_flags"]):
        f = p["forced"]
        worst = max((x for x in f["forks"] if x["kind"] == "red flag"), key=lambda x: x["margin"])
        findings.append(
            Finding(
                "red-flag fork",
                f"`{p['a']}` vs `{p['b']}`: {f['red_flags']} of {len(f['forks'])} forks along the "
                f"teacher's text had a margin above {_fmt(f['tie_threshold'])} ({TIE_FACTOR:g}× the "
                f"pair's median max |Δ| over the {f['n_differing']} positions where it differs, "
                f"{_fmt(f['max_abs_median_differing'])}); the largest, "
                f"{'≥ ' if not worst['margin_exact'] else ''}{_fmt(worst['margin'])} at prompt "
                f"`{worst['prompt']}` position {worst['position']}, needed a difference far above "
                "this pair's typical one: look at that position.",
                {"red_flags": f["red_flags"], "margin": worst["margin"]},
            )
        )
    sites = fork_sites(forced)
    if not sites:
        return findings
    n_forks = sum(len(kinds) for kinds in sites.values())
    tie_sites = sum(all(k == "near tie" for k in kinds) for kinds in sites.values())
    flagged = sum("red flag" in kinds for kinds in sites.values())
    open_sites = len(sites) - tie_sites - flagged
    forked = [p for p in forced if p["forced"]["forks"]]
    top = max(forked, key=lambda p: max(x["margin"] for x in p["forced"]["forks"]))
    margin = max(x["margin"] for x in top["forced"]["forks"])
    text = (
        f"along the teacher's text, {plural(len(forked), 'pair')} forked {plural(n_forks, 'time')} "
        f"in all, at {plural(len(sites), 'distinct position')} (prompt, position). "
        f"{tie_sites} of those positions are near ties in every pair that forks there "
        f"(margin exact and at most {TIE_FACTOR:g}× the pair's median max |Δ| where it differs), "
        f"{flagged} hold a red flag, {open_sites} are undetermined (a margin only bounded "
        f"below, or fewer than {MIN_SCALE_POSITIONS} differing positions to judge the pair by)."
        f" Largest margin {_fmt(margin)}, `{top['a']}` vs `{top['b']}`, threshold "
        f"{_fmt(top['forced']['tie_threshold'])}."
    )
    if tie_sites == len(sites):
        text += " The texts part where the model was nearly tied, as rounding differences of this size are expected to do."
    findings.append(
        Finding(
            "forks",
            text,
            {
                "forks": n_forks,
                "sites": len(sites),
                "tie_sites": tie_sites,
                "largest_margin": margin,
            },
        )
    )
    return findings


def _tiny_yet_parts_early(m: Matrix) -> list[Finding]:
    """Pairs whose first-step difference is tiny against the model's other pairs, prompt by
    prompt, yet whose free-running texts part on many prompts, early."""
    cap = generation_cap(list(m.records.values()))
    if cap is None:
        return []
    runs = {Combination("", *key).label: generations_of(r) for key, r in m.records.items()}
    by_prompt = {id(p): _max_abs_by_prompt(p) for p in m.pairs.values()}
    findings = []
    for p in m.pairs.values():
        if p["a"] not in runs or p["b"] not in runs:
            continue
        others = [by_prompt[id(q)] for q in m.pairs.values() if q is not p]
        tiny = _tiny_against(by_prompt[id(p)], others)
        if tiny is None or not tiny["low"] >= 1 / TINY:  # NaN is not tiny
            continue
        s = pair_stats(runs[p["a"]], runs[p["b"]])
        if _parts_early(s, cap):
            findings.append(_tiny_yet_parted(p, s, tiny, len(others), cap))
    return findings


def _max_abs_by_prompt(pair: dict[str, Any]) -> dict[str, float]:
    return {row["prompt"]: float(row["max_abs"]) for row in pair.get("prompts", [])}


def _tiny_against(mine: dict[str, float], others: list[dict[str, float]]) -> dict[str, Any] | None:
    """How many times the other pairs' per-prompt median first-step max |Δ| is this pair's,
    paired by prompt (each prompt's median over the other pairs that have it), with its
    bootstrap interval (``paired_ratio``); None with fewer than MIN_PROMPTS finite prompts,
    where an interval would be one prompt's verdict."""
    own, median = [], []
    for pid, x in mine.items():
        theirs = [o[pid] for o in others if pid in o and np.isfinite(o[pid])]
        if theirs and np.isfinite(x):
            own.append(x)
            median.append(float(np.median(theirs)))
    if len(own) < MIN_PROMPTS:
        return None
    return {**paired_ratio(own, median), "own": own, "others": median}


def _parts_early(s: dict[str, Any], cap: int) -> bool:
    """On at least PARTED of the prompts, at a median divergence index within EARLY of cap."""
    n = s["n_prompts"]
    return n > 0 and s["diverged"] >= PARTED * n and s["median_index"] <= EARLY * cap


def _tiny_yet_parted(
    p: dict[str, Any], s: dict[str, Any], tiny: dict[str, Any], n_others: int, cap: int
) -> Finding:
    own, others, n = float(np.median(tiny["own"])), float(np.median(tiny["others"])), s["n_prompts"]
    identical = sum(x == 0 for x in tiny["own"])
    if identical:  # a ratio against 0 says nothing a reader can use
        ratio = f"bit-identical at the first step on {identical} of {tiny['n']} prompts"
    else:
        ratio = (
            f"the others' median on each prompt is {tiny['ratio']:.3g}× this pair's, geometric "
            f"mean over the prompts, {LEVEL:.0%} bootstrap interval "
            f"{tiny['low']:.3g}–{tiny['high']:.3g}×"
        )
    text = (
        f"`{p['a']}` vs `{p['b']}`: first-step max |Δ| a median {_fmt(own)} over "
        f"{plural(tiny['n'], 'prompt')}, against a median {_fmt(others)} for the model's "
        f"{plural(n_others, 'other pair')} ({ratio}); yet their free-running "
        f"texts part on {s['diverged']} of these {n} prompts ({LEVEL:.0%} Wilson interval "
        f"{s['share_low']:.0%}–{s['share_high']:.0%}), at a median divergence index of "
        f"{s['median_index']:g} of at most {cap} tokens generated. On these prompts, a "
        "first-step difference this small did not keep the texts together (the rule: the "
        f"interval's lower end at least {1 / TINY:g}×, texts that part on at least "
        f"{PARTED:.0%} of the prompts at a median index within the first {EARLY:.0%} of the "
        "tokens generated)."
    )
    numbers = {
        "max_abs_median": own,
        "others_median": others,
        "ratio": tiny["ratio"],
        "ratio_low": tiny["low"],
        "ratio_high": tiny["high"],
        "diverged": s["diverged"],
        "n_prompts": n,
        "share_low": s["share_low"],
        "share_high": s["share_high"],
        "median_index": s["median_index"],
    }
    return Finding("tiny-yet-parts-early", text, numbers)


# settings whose one side looks more precise than the other: (key, more precise, less precise)
_MORE_PRECISE = [
    *(("dequant", "f32", other) for other in ("none", "f16", "bf16")),
    *(("kv_cache_type", "f32", other) for other in ("f16", "bf16", "q8_0")),
    ("kv_cache_type", "f16", "q8_0"),
]


def _per_prompt(row: dict[str, Any]) -> list[float] | None:
    return row["first_step"].get("max_abs_by_prompt")


def _ratio_text(r: dict[str, Any], far: str, of: str = "first-step max |Δ|") -> str:
    """How a paired ratio was decided; ``far`` the side it puts in the numerator."""
    return (
        f"geometric mean over {r['n']} prompts of the per-prompt ratio of {of}, "
        f"{LEVEL:.0%} bootstrap interval {r['low']:.3g}–{r['high']:.3g}; `{far}` the "
        f"farther on {r['farther_on']} of {r['n']} prompts"
    )


ALONG = "the median over a prompt's forced positions of max |Δ|"


def _along_the_text(pair: Pair, a: dict[str, Any], b: dict[str, Any]) -> tuple[str, dict]:
    """The same question along the teacher's text: a paired ratio of each prompt's median
    max |Δ| over its forced positions, with its interval; empty where either side has none."""
    fa, fb = a.get("forced", {}), b.get("forced", {})
    ma, mb = fa.get("max_abs_median_by_prompt", {}), fb.get("max_abs_median_by_prompt", {})
    common = [pid for pid in ma if pid in mb]  # paired by prompt
    if fa.get("status") != "ok" or fb.get("status") != "ok" or not common:
        return "", {}
    pa, pb = [ma[pid] for pid in common], [mb[pid] for pid in common]
    r = paired_ratio(pa, pb)
    if r["verdict"] == "indistinguishable":
        text = f"along the text, as far as each other ({_ratio_text(r, pair.b.label, ALONG)})"
    else:
        near, far = (pair.a, pair.b) if r["verdict"] == "farther" else (pair.b, pair.a)
        if near is pair.b:
            r = paired_ratio(pb, pa)
        text = (
            f"along the text, `{near.label}` is {r['ratio']:.3g}× closer "
            f"({_ratio_text(r, far.label, ALONG)})"
        )
    medians = (
        f"; medians over all positions {_fmt(fa['max_abs_median'])} vs {_fmt(fb['max_abs_median'])}"
    )
    numbers = {"forced_ratio": r["ratio"], "forced_low": r["low"], "forced_high": r["high"]}
    return f"; {text}{medians}", numbers


def _closer_to_exact(m: Matrix, exact: dict[Key, dict[str, Any]]) -> list[Finding]:
    """For each pair that asks one question: which side is closer to exact, decided over the
    prompts by a paired ratio with its interval (qdiff.compare.stats), never one prompt."""
    findings = []
    for result in m.pairs.values():
        pair = Pair.from_result(result)
        a, b = exact.get(pair.a.key), exact.get(pair.b.key)
        s = result["summary"]
        if a is None or b is None or s["bit_identical_count"] == s["n_prompts"]:
            continue
        if not (pair.same_file or pair.same_device):
            continue  # two changes at once: no single question to answer
        pa, pb = _per_prompt(a), _per_prompt(b)
        if pa is None or pb is None or len(pa) != len(pb):
            continue  # a distance made by an older qdiff: no per-prompt values to pair
        r = paired_ratio(pa, pb)  # how many times b is a
        head = f"`{pair.a.label}` vs `{pair.b.label}`: "
        worst = f"each side's worst prompt {_fmt(max(pa))} vs {_fmt(max(pb))}"
        if r["verdict"] == "indistinguishable":
            text = (
                f"{head}as far from exact as each other at the first step, on these prompts "
                f"(ratio {r['ratio']:.3g}: {_ratio_text(r, pair.b.label)}; {worst})"
            )
        else:
            near, far = (pair.a, pair.b) if r["verdict"] == "farther" else (pair.b, pair.a)
            if near is pair.b:
                r = paired_ratio(pb, pa)  # the same comparison, the nearer side first
            text = (
                f"{head}`{near.label}` is {r['ratio']:.3g}× closer to exact than "
                f"`{far.label}` at the first step ({_ratio_text(r, far.label)}; {worst})"
            )
        along, forced = _along_the_text(pair, a, b)
        numbers = {"ratio": r["ratio"], "low": r["low"], "high": r["high"], **forced}
        findings.append(Finding("closer-to-exact", f"{text}{along}.", numbers))
    return findings


def _more_precise_not_closer(m: Matrix, exact: dict[Key, dict[str, Any]]) -> list[Finding]:
    """A setting that looks more precise whose side is not closer to exact over the
    prompts (farther, or indistinguishable, by qdiff.compare.stats)."""
    findings = []
    for result in m.pairs.values():
        if len(result["differs"]) != 1:
            continue
        pair = Pair.from_result(result)
        sides = {pair.a.key: m.records.get(pair.a.key), pair.b.key: m.records.get(pair.b.key)}
        for key, precise, coarse in _MORE_PRECISE:
            value = {
                k: (r["dequant"] if key == "dequant" else r["settings"].get(key))
                for k, r in sides.items()
                if r is not None
            }
            if set(value.values()) != {precise, coarse}:
                continue
            hi = next(k for k, v in value.items() if v == precise)
            lo = next(k for k, v in value.items() if v == coarse)
            if hi not in exact or lo not in exact:
                continue
            p_hi, p_lo = _per_prompt(exact[hi]), _per_prompt(exact[lo])
            if p_hi is None or p_lo is None or len(p_hi) != len(p_lo):
                continue
            r = paired_ratio(p_lo, p_hi)  # how many times the precise side is the coarse
            if r["verdict"] == "nearer":
                continue  # the precise side is closer: nothing to say
            how = "as far from" if r["verdict"] == "indistinguishable" else "further from"
            findings.append(
                Finding(
                    "more-precise-not-closer",
                    f"`{'.'.join(hi)}` ({key} {precise}) is {how} exact than "
                    f"`{'.'.join(lo)}` ({key} {coarse}) at the first step, over these prompts "
                    f"(ratio {r['ratio']:.3g}: {_ratio_text(r, '.'.join(hi))}). A setting that "
                    "looks more "
                    "precise is not closer here.",
                    {"ratio": r["ratio"], "low": r["low"], "high": r["high"]},
                )
            )
    return findings


def _float_path(m: Matrix, exact: dict[Key, dict[str, Any]]) -> list[Finding]:
    findings = []
    for (device, dequant), row in exact.items():
        if dequant != "f32" or m.backend.get(device) != "cpu":
            continue
        d = row["first_step"]["max_abs"]
        text = (
            f"`{Combination('', device, dequant).label}` (the same weights as the file, in f32) "
            f"is {_fmt(d)} from exact (first-step max |Δ|, worst prompt): llama.cpp's f16 "
            "roundings and float32 sums on this CPU, not the weights (the error budget below "
            "says which)."
        )
        numbers = {"f32": d}
        f32_kv = _f32_kv_sibling(m, device)
        mine, theirs = _per_prompt(row), None if f32_kv is None else m.from_exact((f32_kv, "f32"))
        if mine and theirs and len(mine) == len(theirs) >= MIN_PROMPTS:
            r = paired_ratio(theirs, mine)  # how many times this device's distance is theirs
            if r["verdict"] == "farther":  # the f32 KV cache is nearer exact on these prompts
                numbers |= {"f32_kv_cache": max(theirs), **_ratio_numbers(r)}
                text += (
                    f" With the KV cache in f32 (`{f32_kv}.f32`, measured) it is "
                    f"{_fmt(max(theirs))}: the f16 KV cache accounts for {1 - 1 / r['ratio']:.1%} "
                    f"of that distance (1 − 1/the paired ratio; {LEVEL:.0%} interval "
                    f"{1 - 1 / r['low']:.1%}–{1 - 1 / r['high']:.1%} over {r['n']} prompts)."
                )
        findings.append(Finding("float-path", text, numbers))
    return findings


def _error_budget(m: Matrix, exact: dict[Key, dict[str, Any]]) -> list[Finding]:
    """Per combination whose rounding sources the engine follows: how far each source alone
    and all together take the exact answer, and what remains against the run's floor."""
    findings = []
    for key, row in exact.items():
        b = row.get("budget")
        if b is None or b["status"] != "ok":
            continue
        label = Combination("", *key).label
        alone = ", ".join(f"{s['label']} {_fmt(s['median'])}" for s in b["sources"])
        text = (
            f"`{label}` is {_fmt(b['distance']['median'])} from exact (first-step max |Δ|, "
            f"median over {b['n_prompts']} prompts; worst {_fmt(b['distance']['max'])}). Each "
            f"of its rounding sources alone takes the exact answer {alone}; all together "
            f"{_fmt(b['together']['median'])}"
        )
        numbers = {"distance": b["distance"]["median"], "residual": b["residual"]["median"]}
        numbers |= {s["name"]: s["median"] for s in b["sources"]}
        numbers |= {"ratio_median": b["ratio_median"], "p_value": b["p_value"]}
        reading = verdict(b)
        share = b["together"]["median"] / b["distance"]["median"]
        coarse = b["floor"]["median"] / b["distance"]["median"]
        text += (
            f" ({share:.2g}× the run's own distance). The run is "
            f"{_fmt(b['residual']['median'])} from that emulation; the median over prompts of residual / "
            f"floor is {b['ratio_median']:.2g} (floor median {_fmt(b['floor']['median'])}: "
            "how far equally valid float32 inputs move the emulation), within it on "
            f"{b['within_floor']} of {b['n_prompts']} prompts"
        )
        not_followed = b.get("not_followed", [])
        if reading == "unexplained" and not_followed:
            text += (
                f" (p = {b['p_value']:.2g}): as expected, since the engine does not yet "
                f"follow this backend's {'; '.join(not_followed)}."
            )
        elif reading == "unexplained":
            text += (
                f" (p = {b['p_value']:.2g}): the run rounds somewhere the emulation does not "
                "follow."
            )
        elif reading == "unresolved":
            text += (
                f". The floor is {coarse:.0%} of the distance itself, so the logits cannot tell "
                "this emulation from one that leaves a source out: only the sizes above say "
                "how much each source can account for (tests/test_roundings.py and, for "
                "CUDA and Vulkan, tests/test_cuda_kernels.py and test_vulkan_kernels.py check "
                "the switches op by op instead)."
            )
        else:
            text += ": on these prompts the rest is indistinguishable from that floor."
            if not_followed:
                text += f" The engine does not follow {'; '.join(not_followed)}."
        findings.append(Finding(f"error-budget-{reading.replace(' ', '-')}", text, numbers))
    return findings


def _f32_kv_sibling(m: Matrix, device: str) -> str | None:
    """A device of the same backend whose only difference is an f32 KV cache; none with flash
    attention, which casts an f32 cache's K and V to f16 (llama-graph.cpp)."""
    mine = m.records[(device, "f32")]["settings"]
    if mine.get("flash_attn"):
        return None
    for other in m.devices:
        theirs = m.records.get((other, "f32"), {}).get("settings")
        if theirs and theirs == {**mine, "kv_cache_type": "f32"} and theirs != mine:
            return other
    return None


def diagnose(
    records: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    exact: dict[str, Any] | None = None,
) -> list[Finding]:
    """All findings for one model, device pair by device pair, in matrix order; with the
    distance from exact (qdiff.compare.distance), the rules that use it."""
    m = Matrix(records, pairs)
    if exact is not None and exact.get("status") == "ok":
        m.exact = {
            Combination.parse(exact["model"], r["combination"]).key: r
            for r in exact["rows"]
            if r["status"] == "ok"
        }
    findings = []
    for d1, d2 in combinations(m.devices, 2):
        found = [
            f
            for rule in (_settings, _activation_quantization, _float_precision, _device_blame)
            if (f := rule(m, d1, d2)) is not None
        ]
        explained = {"activation-quantization", "float-precision", "setting"}
        cross = m.max_abs((d1, "none"), (d2, "none"))
        if cross and not explained & {f.rule for f in found}:
            by_prompt = m.by_prompt((d1, "none"), (d2, "none"))
            hint = (
                f"fewer than {MIN_PROMPTS} prompts to decide the rules by"
                if m.pair((d1, "f32"), (d2, "f32")) is not None and len(by_prompt) < MIN_PROMPTS
                else "run an f32 copy on both devices to separate the causes"
            )
            found.append(
                Finding(
                    "unexplained",
                    f"`{d1}` vs `{d2}`: the quantized file differs by "
                    f"{_median_text(by_prompt, cross)} (first-step max |Δ|); no rule explains "
                    f"it ({hint}).",
                    {"quantized": cross},
                )
            )
        findings += found
    findings += _forks(pairs)
    findings += _tiny_yet_parts_early(m)
    if m.exact:
        for rule in (_float_path, _error_budget, _closer_to_exact, _more_precise_not_closer):
            findings += rule(m, m.exact)
    return findings
