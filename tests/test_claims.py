"""The write-up's claims checked against a small hand-made matrix (pure logic)."""

from __future__ import annotations

from itertools import combinations
from typing import Any

from qdiff.judge.claims import check_all
from qdiff.report.view import ModelView

FILE_TYPES = {"Q8_0": "Q8_0", "Q4_K_M": "Q4_K - Medium"}


def view(
    fmt: str, gaps: dict[tuple[str, str], tuple[float, int | None]], exact: dict[str, float]
) -> ModelView:
    """One format's matrix on cpu and cuda, none and f32: pair gaps on the write-up's prompt
    (max |Δ|, fork step) and each combination's distance from exact."""
    model = f"smollm2.requant-{fmt.lower()}"
    records = []
    for device, backend in (("cpu", "cpu"), ("cuda", "cuda")):
        for dq in ("none", "f32"):
            records.append(
                {
                    "model": model,
                    "device": device,
                    "dequant": dq,
                    "status": "ok",
                    "settings": {"backend": backend, "flash_attn": False, "n_ubatch": 512},
                    "timings": {"decode_ms_per_token": 7.0 if dq == "none" else 15.0},
                    "prompts": [{"id": "rust"}],
                    "provenance": {
                        "model_file": {"file_type": FILE_TYPES[fmt] if dq == "none" else "all F32"}
                    },
                }
            )
    pairs = []
    for a, b in combinations(records, 2):
        la, lb = f"{a['device']}.{a['dequant']}", f"{b['device']}.{b['dequant']}"
        gap, fork = gaps.get((la, lb), (0.01, None))
        pairs.append(
            {
                "model": model,
                "a": la,
                "b": lb,
                "status": "ok",
                "differs": [],
                "summary": {"max_abs_max": gap},
                "prompts": [{"prompt": "rust", "max_abs": gap, "fork_step": fork}],
            }
        )
    rows = [
        {"combination": c, "status": "ok", "first_step": {"max_abs": d}} for c, d in exact.items()
    ]
    return ModelView(
        model, {"run": records}, pairs, exact={"model": model, "status": "ok", "rows": rows}
    )


def as_written(fmt: str, fork: int | None) -> ModelView:
    """llama.cpp behaving as candle did: only the CPU rounds activations."""
    return view(
        fmt,
        {
            ("cpu.none", "cuda.none"): (0.6, fork),
            ("cpu.f32", "cuda.f32"): (5e-5, None),
            ("cuda.none", "cuda.f32"): (0.02, None),
        },
        {"cpu.none": 0.6, "cpu.f32": 1e-4, "cuda.none": 0.02, "cuda.f32": 1e-4},
    )


def holds(rows: list[dict[str, Any]]) -> list[str]:
    return [r["holds"] for r in rows]


def test_a_matrix_that_behaves_as_the_writeup_says_meets_every_claim() -> None:
    rows = check_all([as_written("Q8_0", None), as_written("Q4_K_M", 13)])
    assert holds(rows) == ["yes"] * 8
    assert rows[2]["measured with llama.cpp"].startswith("Q8_0 cuda: 0.6 (all prompts: 0.6)")


def test_a_gpu_that_also_rounds_activations_fails_that_claim_and_says_why() -> None:
    q8, q4 = as_written("Q8_0", None), as_written("Q4_K_M", 13)
    for v in (q8, q4):  # CUDA's MMVQ rounds activations to q8_1 too: its file is far from exact
        v.exact["rows"][2]["first_step"]["max_abs"] = 0.5
    rows = check_all([q8, q4])
    gpu = rows[1]
    assert (
        gpu["holds"] == "**no**"
        and "file 0.5 from exact, the CPU's 0.6" in gpu["measured with llama.cpp"]
    )
    assert holds(rows)[0] == "yes"


def test_claims_without_a_gpu_are_not_measured_not_failed() -> None:
    v = as_written("Q8_0", None)
    v.stages["run"] = [r for r in v.records if r["device"] == "cpu"]
    rows = check_all([v])
    assert rows[2]["holds"] == "not measured" and rows[0]["holds"] == "yes"


def test_a_claim_that_holds_for_one_format_only_is_partly_met() -> None:
    q8, q4 = as_written("Q8_0", None), as_written("Q4_K_M", 13)
    q8.exact["rows"][2]["first_step"]["max_abs"] = 0.5  # only Q8_0's GPU run rounds
    assert check_all([q8, q4])[1]["holds"] == "partly (1 of 2)"


def test_the_cpu_that_stands_for_the_writeups_cpu_has_llama_cpps_defaults() -> None:
    v = as_written("Q8_0", None)
    for dq, distance in (("none", 0.9), ("f32", 2e-5)):  # an f32 KV cache device, listed first
        record = {**v.records[0], "device": "cpu-kv32", "dequant": dq}
        record["settings"] = {**record["settings"], "kv_cache_type": "f32"}
        v.records.insert(0, record)
        v.exact["rows"].append(
            {"combination": f"cpu-kv32.{dq}", "status": "ok", "first_step": {"max_abs": distance}}
        )
    measured = check_all([v])[0]["measured with llama.cpp"]
    assert measured.startswith("Q8_0: the file's CPU run is 0.6 from exact, its f32 copy 0.0001")
