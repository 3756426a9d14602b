"""Explain a model's pairwise differences with explicit rules over the measured matrix.

Every finding names its rule and the numbers it rests on; nothing is fixed text. Rules:

- ``activation-quantization``: for two devices that ran the file (``none``) and its ``f32``
  copy, the file's difference is at least ``AMPLIFICATION`` times the copies'. The weights are
  the same in both cases, so the excess comes from the quantized-weight kernels, which round
  the activations (formats per backend from llama.cpp's source, BACKGROUND.md).
- ``float-precision``: two backends' ``f32`` copies differ by no more than one fp16 rounding of
  the weights on one device (its ``f32`` vs ``f16`` copy): summation order, TF32 and fp16
  arithmetic explain a gap of that size. A larger gap is reported as unexplained.
- ``setting``: two devices of the same backend that differ only in settings: the setting
  change, and how far it moves the logits on each file.
- ``device-blame``: on the quantized file, a same-backend setting change moves the logits at
  least ``COMPARABLE`` times as much as a change of backend does, so "the device" is not the
  only cause of forks.
- ``unexplained``: a cross-backend difference that none of the rules above accounts for.
- ``red-flag fork`` / ``near-tie forks``: along the teacher's text (qdiff.forcing), a fork
  whose margin exceeds ``TIE_FACTOR`` times the pair's median max |Δ| at the positions where
  it differs is a red flag, named with its prompt and position; when every fork is within that, the forks are
  near ties that ordinary rounding differences flip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from qdiff.forcing import TIE_FACTOR

AMPLIFICATION = 10.0
COMPARABLE = 0.5

# which activation format a quantized matmul rounds to, per backend and weight type
_CPU_Q8_0 = {"q4_0", "q5_0", "q8_0", "iq4_nl"}
_CPU_Q8_1 = {"q4_1", "q5_1"}
_FLOAT = {"f32", "f16", "bf16"}


def activation_formats(backend: str, weight_types: list[str]) -> str:
    quantized = sorted(t for t in weight_types if t.lower() not in _FLOAT)
    if not quantized:
        return f"{backend}: no quantized weights"
    if backend == "cpu":
        groups: dict[str, list[str]] = {}
        for t in quantized:
            low = t.lower()
            fmt = "Q8_0" if low in _CPU_Q8_0 else "Q8_1" if low in _CPU_Q8_1 else "Q8_K"
            groups.setdefault(fmt, []).append(t)
        return "cpu: " + "; ".join(f"{','.join(ts)}→{fmt}" for fmt, ts in sorted(groups.items()))
    if backend == "cuda":
        return f"cuda: {','.join(quantized)}→q8_1 (MMVQ/MMQ)"
    if backend == "vulkan":
        return f"vulkan: {','.join(quantized)}→q8_1 with integer dot products, else f16/f32"
    return f"{backend}: weights dequantized in the kernel, activations not quantized"


@dataclass
class Finding:
    rule: str
    text: str
    numbers: dict[str, float] = field(default_factory=dict)


def _fmt(x: float) -> str:
    return f"{x:.3g}"


class Matrix:
    """A model's runs and pair summaries, indexed for the rules."""

    def __init__(self, records: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> None:
        ok = [r for r in records if r["status"] == "ok"]
        self.records = {f"{r['device']}.{r['dequant']}": r for r in ok}
        self.devices = list(dict.fromkeys(r["device"] for r in ok))
        self.backend = {r["device"]: r["settings"]["backend"] for r in ok}
        self.pairs = {
            frozenset((p["a"], p["b"])): p for p in pairs if p["status"] == "ok"
        }

    def pair(self, a: str, b: str) -> dict[str, Any] | None:
        return self.pairs.get(frozenset((a, b)))

    def max_abs(self, a: str, b: str) -> float | None:
        p = self.pair(a, b)
        return None if p is None else p["summary"]["max_abs"]

    def weight_types(self, dequant: str) -> list[str]:
        for label, r in self.records.items():
            if label.endswith(f".{dequant}"):
                return list(r["provenance"]["model_file"]["weight_types"])
        return []

    def settings_only(self, d1: str, d2: str) -> list[str] | None:
        """The settings that differ between two devices of one backend, else None."""
        if self.backend[d1] != self.backend[d2]:
            return None
        for label, p in self.pairs.items():
            if label == frozenset((f"{d1}.none", f"{d2}.none")):
                return p["differs"]
        return None


def _activation_quantization(m: Matrix, d1: str, d2: str) -> Finding | None:
    q, f = m.max_abs(f"{d1}.none", f"{d2}.none"), m.max_abs(f"{d1}.f32", f"{d2}.f32")
    if q is None or f is None or q == 0 or q < AMPLIFICATION * f:
        return None
    ratio = "∞" if f == 0 else f"{q / f:.0f}×"
    types = m.weight_types("none")
    formats = sorted({activation_formats(m.backend[d], types) for d in (d1, d2)})
    same = m.backend[d1] == m.backend[d2]
    what = f"same backend, {'; '.join(m.settings_only(d1, d2) or [])}: " if same else ""
    return Finding(
        "activation-quantization",
        f"`{d1}` vs `{d2}` ({what}the quantized file differs {ratio} more than its f32 copies, "
        f"max |Δ| {_fmt(q)} vs {_fmt(f)}). The weights are the same, so the excess comes from "
        f"the quantized-weight kernels, which round activations ({' | '.join(formats)})"
        + (": a small change upstream is amplified by that rounding." if same else "."),
        {"quantized": q, "f32": f},
    )


def _float_precision(m: Matrix, d1: str, d2: str) -> Finding | None:
    if m.backend[d1] == m.backend[d2]:
        return None
    f = m.max_abs(f"{d1}.f32", f"{d2}.f32")
    if f is None:
        return None
    roundings = [x for d in (d1, d2) if (x := m.max_abs(f"{d}.f32", f"{d}.f16")) is not None]
    if not roundings:
        return Finding(
            "unexplained",
            f"`{d1}` vs `{d2}`: their f32 copies differ by {_fmt(f)}; with no f16 copy to "
            "compare against, this gap is unexplained.",
            {"f32": f},
        )
    h = max(roundings)
    if f <= h:
        return Finding(
            "float-precision",
            f"`{d1}` vs `{d2}`: their f32 copies differ by {_fmt(f)}, no more than one fp16 "
            f"rounding of the weights on one device (f32 vs f16 copy: {_fmt(h)}). Float "
            "summation order and TF32/fp16 arithmetic explain a gap of this size.",
            {"f32": f, "fp16_rounding": h},
        )
    return Finding(
        "unexplained",
        f"`{d1}` vs `{d2}`: their f32 copies differ by {_fmt(f)}, more than one fp16 rounding "
        f"of the weights ({_fmt(h)}): unexplained by float precision.",
        {"f32": f, "fp16_rounding": h},
    )


def _settings(m: Matrix, d1: str, d2: str) -> Finding | None:
    change = m.settings_only(d1, d2)
    if not change:
        return None
    parts = []
    numbers = {}
    for label, r in m.records.items():
        if not label.startswith(f"{d1}."):
            continue
        dq = r["dequant"]
        p = m.pair(f"{d1}.{dq}", f"{d2}.{dq}")
        if p is None:
            continue
        s = p["summary"]
        numbers[dq] = s["max_abs"]
        parts.append(
            f"{dq}: bit-identical" if s["bit_identical"] == s["n_prompts"]
            else f"{dq}: max |Δ| {_fmt(s['max_abs'])}, forks {s['forked']}/{s['n_prompts']}"
        )
    return Finding(
        "setting",
        f"`{d1}` vs `{d2}` (same backend) differ only in {'; '.join(change)}: "
        + ", ".join(parts) + ".",
        numbers,
    )


def _device_blame(m: Matrix, d1: str, d2: str) -> Finding | None:
    if m.backend[d1] == m.backend[d2]:
        return None
    cross = m.max_abs(f"{d1}.none", f"{d2}.none")
    if not cross:
        return None
    best: tuple[float, str, str] | None = None
    for a, b in combinations(m.devices, 2):
        single = len(m.settings_only(a, b) or []) == 1  # one named cause, not a mix
        if single and m.backend[a] in (m.backend[d1], m.backend[d2]):
            x = m.max_abs(f"{a}.none", f"{b}.none")
            if x is not None and (best is None or x > best[0]):
                best = (x, a, b)
    if best is None or best[0] < COMPARABLE * cross:
        return None
    x, a, b = best
    return Finding(
        "device-blame",
        f"`{d1}` vs `{d2}` on the quantized file: {_fmt(cross)}. A same-backend change "
        f"(`{a}` vs `{b}`: {'; '.join(m.settings_only(a, b) or [])}) moves it {_fmt(x)}, "
        f"{x / cross:.0%} as much, so the change of device is not the only cause of forks.",
        {"cross_device": cross, "same_device": x},
    )


def _forks(pairs: list[dict[str, Any]]) -> list[Finding]:
    forced = [p for p in pairs if p.get("forced", {}).get("status") == "ok"]
    flagged = [p for p in forced if p["forced"]["red_flags"]]
    findings = []
    for p in flagged:
        f = p["forced"]
        worst = max((x for x in f["forks"] if x["kind"] == "red flag"), key=lambda x: x["margin"])
        findings.append(Finding(
            "red-flag fork",
            f"`{p['a']}` vs `{p['b']}`: {f['red_flags']} of {len(f['forks'])} forks along the "
            f"teacher's text had a margin above {_fmt(f['tie_threshold'])} ({TIE_FACTOR:g}× the "
            f"pair's median max |Δ| at the positions where it differs, "
            f"{_fmt(f['max_abs_median_differing'])}); the largest, "
            f"{_fmt(worst['margin'])} at prompt `{worst['prompt']}` position {worst['position']}, "
            "needed a difference far above this pair's typical one: look at that position.",
            {"red_flags": f["red_flags"], "margin": worst["margin"]},
        ))
    forked = [p for p in forced if p["forced"]["forks"]]
    if forked and not flagged:
        n = sum(len(p["forced"]["forks"]) for p in forked)
        top = max(forked, key=lambda p: max(x["margin"] for x in p["forced"]["forks"]))
        margin = max(x["margin"] for x in top["forced"]["forks"])
        findings.append(Finding(
            "near-tie forks",
            f"along the teacher's text, all {n} forks of the {len(forked)} pairs that forked "
            f"were near ties (margin at most {TIE_FACTOR:g}× the pair's median max |Δ| at the "
            f"positions where it differs; largest margin {_fmt(margin)}, `{top['a']}` vs `{top['b']}`, threshold "
            f"{_fmt(top['forced']['tie_threshold'])}): the texts part where the model was nearly "
            "tied, as rounding differences of this size are expected to do.",
            {"forks": n, "largest_margin": margin},
        ))
    return findings


def diagnose(records: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> list[Finding]:
    """All findings for one model, device pair by device pair, in matrix order."""
    m = Matrix(records, pairs)
    findings = []
    for d1, d2 in combinations(m.devices, 2):
        found = [
            f for rule in (_settings, _activation_quantization, _float_precision, _device_blame)
            if (f := rule(m, d1, d2)) is not None
        ]
        explained = {"activation-quantization", "float-precision", "setting"}
        cross = m.max_abs(f"{d1}.none", f"{d2}.none")
        if cross and not explained & {f.rule for f in found}:
            found.append(
                Finding(
                    "unexplained",
                    f"`{d1}` vs `{d2}`: the quantized file differs by {_fmt(cross)}; no rule "
                    "explains it (run an f32 copy on both devices to separate the causes).",
                    {"quantized": cross},
                )
            )
        findings += found
    return findings + _forks(pairs)
