"""Each diagnosis rule on constructed matrices that should, and should not, trigger it."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest

from qdiff.compare.budget import budget
from qdiff.core.backends import BACKENDS
from qdiff.judge.diagnosis import diagnose, fork_sites

WEIGHTS = {
    "none": {"f32": 10, "q4_K": 20, "q8_0": 2},
    "f32": {"f32": 32},
    "f16": {"f32": 10, "f16": 22},
}


def record(device: str, dequant: str, backend: str = "cpu", **settings) -> dict:
    return {
        "model": "m",
        "device": device,
        "dequant": dequant,
        "status": "ok",
        "settings": {"backend": backend, "flash_attn": False, **settings},
        "provenance": {"model_file": {"weight_types": WEIGHTS[dequant]}},
    }


PAIR_SPREAD = [1.0, 0.8, 0.9, 0.7, 0.95, 0.85, 0.75, 0.6]  # a pair's 8 prompts, worst first


def matrix(
    devices: dict[str, dict],
    dequants: list[str],
    max_abs: dict[tuple[str, str], float | list[float]],
):
    """Records for every device x dequant and pairs whose first-step max |Δ| comes from
    ``max_abs`` (keyed by unordered label pairs; missing pairs are 0.01): per prompt, or
    the worst of 8 prompts spread as PAIR_SPREAD."""
    records = [record(d, dq, **s) for d, s in devices.items() for dq in dequants]
    pairs = []
    for ra, rb in combinations(records, 2):
        a, b = f"{ra['device']}.{ra['dequant']}", f"{rb['device']}.{rb['dequant']}"
        given = max_abs.get((a, b), max_abs.get((b, a), 0.01))
        per_prompt = given if isinstance(given, list) else [given * x for x in PAIR_SPREAD]
        value = max(per_prompt)
        differs = [
            f"{k} {ra['settings'][k]}→{rb['settings'][k]}"
            for k in ra["settings"]
            if ra["settings"][k] != rb["settings"].get(k)
        ]
        if ra["dequant"] != rb["dequant"]:
            differs.insert(0, f"dequant {ra['dequant']}→{rb['dequant']}")
        pairs.append(
            {
                "model": "m",
                "a": a,
                "b": b,
                "status": "ok",
                "differs": differs,
                "summary": {
                    "max_abs_max": value,
                    "bit_identical_count": sum(x == 0 for x in per_prompt),
                    "n_prompts": len(per_prompt),
                    "forked": 3 if value > 1 else 0,
                },
                "prompts": [{"prompt": f"p{i}", "max_abs": x} for i, x in enumerate(per_prompt)],
            }
        )
    return records, pairs


def rules(findings) -> list[str]:
    return [f.rule for f in findings]


CPU_CUDA = {"cpu": {"backend": "cpu"}, "gpu": {"backend": "cuda"}}


def test_activation_quantization_when_the_file_differs_far_more_than_its_copies() -> None:
    records, pairs = matrix(
        CPU_CUDA, ["none", "f32"], {("cpu.none", "gpu.none"): 2.0, ("cpu.f32", "gpu.f32"): 0.02}
    )
    found = [f for f in diagnose(records, pairs) if f.rule == "activation-quantization"]
    assert len(found) == 1
    assert "the quantized file differs 100× more than its f32 copies: geometric mean over 8 " in (
        found[0].text
    )
    assert "interval 100–100; worst prompts 2 vs 0.02)" in found[0].text
    assert "q4_K→Q8_K" in found[0].text and "q8_1" in found[0].text
    assert found[0].numbers == pytest.approx(
        {"quantized": 2.0, "f32": 0.02, "ratio": 100, "low": 100, "high": 100}
    )


def test_activation_quantization_is_decided_over_prompts_not_by_one_prompts_maximum() -> None:
    """The file's runs differ 100 times more than the copies on one prompt (2.0 against
    0.02) and 2.5 times on the other seven: the maximum says 100×, the prompts about 4×,
    below the rule's 10×; with the copies bit-identical on one prompt, that prompt is left
    out and counted."""
    f32 = [0.02] * 8
    quantized = [2.0] + [0.05] * 7
    records, pairs = matrix(
        CPU_CUDA,
        ["none", "f32"],
        {("cpu.none", "gpu.none"): quantized, ("cpu.f32", "gpu.f32"): f32},
    )
    assert "activation-quantization" not in rules(diagnose(records, pairs))
    records, pairs = matrix(
        CPU_CUDA,
        ["none", "f32"],
        {("cpu.none", "gpu.none"): [2.0] * 8, ("cpu.f32", "gpu.f32"): [0.0] + [0.02] * 7},
    )
    (found,) = [f for f in diagnose(records, pairs) if f.rule == "activation-quantization"]
    assert "geometric mean over 7 prompts" in found.text
    assert (
        "1 prompt where the f32 copies alone are bit-identical (an unbounded ratio)" in found.text
    )
    assert "interval 100–inf" in found.text
    records, pairs = matrix(
        CPU_CUDA, ["none", "f32"], {("cpu.none", "gpu.none"): 2.0, ("cpu.f32", "gpu.f32"): 0.0}
    )
    (found,) = [f for f in diagnose(records, pairs) if f.rule == "activation-quantization"]
    assert (
        "differs ∞ more than its f32 copies: the f32 copies bit-identical on 8 prompts where"
        in (found.text)
    )
    # bit-identical copies everywhere, the file's runs apart on one prompt only: no verdict
    records, pairs = matrix(
        CPU_CUDA,
        ["none", "f32"],
        {("cpu.none", "gpu.none"): [2.0] + [0.0] * 7, ("cpu.f32", "gpu.f32"): 0.0},
    )
    assert "activation-quantization" not in rules(diagnose(records, pairs))


def test_no_activation_quantization_when_copies_differ_as_much() -> None:
    records, pairs = matrix(
        CPU_CUDA, ["none", "f32"], {("cpu.none", "gpu.none"): 0.05, ("cpu.f32", "gpu.f32"): 0.02}
    )
    found = diagnose(records, pairs)
    assert "activation-quantization" not in rules(found)
    assert "unexplained" in rules(found)  # no f16 copy: the f32 gap cannot be explained


def test_float_precision_when_the_f32_gap_is_within_one_fp16_rounding() -> None:
    gaps = {
        ("cpu.none", "gpu.none"): 2.0,
        ("cpu.f32", "gpu.f32"): 0.03,
        ("gpu.f32", "gpu.f16"): 0.13,
        ("cpu.f32", "cpu.f16"): 0.03,
    }
    found = diagnose(*matrix(CPU_CUDA, ["none", "f32", "f16"], gaps))
    fp = [f for f in found if f.rule == "float-precision"]
    assert len(fp) == 1
    assert fp[0].numbers == pytest.approx(
        {
            "f32": 0.03,
            "fp16_rounding": 0.13,
            "ratio": 0.03 / 0.13,
            "low": 0.03 / 0.13,
            "high": 0.03 / 0.13,
        }
    )
    assert "differ by 0.0248 median over prompts, worst 0.03, no more than one fp16" in fp[0].text
    assert "unexplained" not in rules(found)


def test_f32_gap_beyond_fp16_rounding_is_unexplained() -> None:
    gaps = {
        ("cpu.none", "gpu.none"): 2.0,
        ("cpu.f32", "gpu.f32"): 0.5,
        ("gpu.f32", "gpu.f16"): 0.1,
        ("cpu.f32", "cpu.f16"): 0.05,
    }
    found = diagnose(*matrix(CPU_CUDA, ["none", "f32", "f16"], gaps))
    assert "float-precision" not in rules(found)
    assert any(
        f.rule == "unexplained"
        and "5× one fp16 rounding of the weights" in f.text
        and "unexplained by float precision" in f.text
        for f in found
    )


def test_bit_identical_f32_copies_need_no_explanation_and_too_few_prompts_are_said() -> None:
    records, pairs = matrix(
        CPU_CUDA, ["none", "f32"], {("cpu.none", "gpu.none"): 2.0, ("cpu.f32", "gpu.f32"): 0.0}
    )
    found = diagnose(records, pairs)
    assert any(
        f.rule == "float-precision" and "bit-identical on all 8 prompts: no gap" in f.text
        for f in found
    )
    few = {("cpu.none", "gpu.none"): [2.0, 1.5, 1.8], ("cpu.f32", "gpu.f32"): [0.02, 0.01, 0.03]}
    found = diagnose(*matrix(CPU_CUDA, ["none", "f32"], few))
    assert "activation-quantization" not in rules(found)
    assert any("fewer than 5 prompts to decide the rules by" in f.text for f in found)


def test_setting_names_the_one_that_differs() -> None:
    devices = {"cpu": {"backend": "cpu"}, "cpu-fa": {"backend": "cpu", "flash_attn": True}}
    found = diagnose(
        *matrix(
            devices,
            ["none", "f32"],
            {("cpu.none", "cpu-fa.none"): 1.8, ("cpu.f32", "cpu-fa.f32"): 0.0},
        )
    )
    setting = [f for f in found if f.rule == "setting"]
    assert len(setting) == 1
    assert "differ only in flash_attn False→True" in setting[0].text
    assert "none: max |Δ| 1.49 median over prompts, worst 1.8, forks 3/8" in setting[0].text
    assert "f32: bit-identical on all 8 prompts" in setting[0].text


def test_device_blame_when_a_same_device_change_moves_as_much() -> None:
    devices = {
        "cpu": {"backend": "cpu"},
        "cpu-fa": {"backend": "cpu", "flash_attn": True},
        "gpu": {"backend": "cuda"},
    }
    gaps = {("cpu.none", "gpu.none"): 2.2, ("cpu.none", "cpu-fa.none"): 1.8}
    found = [f for f in diagnose(*matrix(devices, ["none"], gaps)) if f.rule == "device-blame"]
    assert any("`cpu` vs `gpu`" in f.text and "82% as much" in f.text for f in found)


def test_no_device_blame_when_same_device_changes_are_small() -> None:
    devices = {
        "cpu": {"backend": "cpu"},
        "cpu-fa": {"backend": "cpu", "flash_attn": True},
        "gpu": {"backend": "cuda"},
    }
    gaps = {
        ("cpu.none", "gpu.none"): 2.2,
        ("cpu-fa.none", "gpu.none"): 2.2,
        ("cpu.none", "cpu-fa.none"): 0.1,
    }
    assert "device-blame" not in rules(diagnose(*matrix(devices, ["none"], gaps)))


def test_device_blame_is_decided_over_prompts_not_by_one_prompts_maximum() -> None:
    """A same-backend change that moves one prompt as much as the change of device (2.0
    against 2.2) and the seven others 0.1: 91% by the maxima, about 7% over the prompts."""
    devices = {
        "cpu": {"backend": "cpu"},
        "cpu-fa": {"backend": "cpu", "flash_attn": True},
        "gpu": {"backend": "cuda"},
    }
    gaps = {
        ("cpu.none", "gpu.none"): [2.2] * 8,
        ("cpu-fa.none", "gpu.none"): [2.2] * 8,
        ("cpu.none", "cpu-fa.none"): [2.0] + [0.1] * 7,
    }
    assert "device-blame" not in rules(diagnose(*matrix(devices, ["none"], gaps)))
    # bit-identical on 3 of 8 prompts and as large as the change of device on the other 5:
    # the prompts where it did not move at all count against it
    gaps[("cpu.none", "cpu-fa.none")] = [0.0] * 3 + [2.0] * 5
    assert "device-blame" not in rules(diagnose(*matrix(devices, ["none"], gaps)))


def test_activation_formats_follow_the_backend() -> None:
    types = ["f32", "q4_K", "q5_0", "q4_1"]
    assert BACKENDS["cpu"].activation_formats(types) == "cpu: q5_0→Q8_0; q4_1→Q8_1; q4_K→Q8_K"
    assert "activations not quantized (rounded to f16 in matmuls of more than 8 tokens)" in (
        BACKENDS["metal"].activation_formats(types)
    )
    assert BACKENDS["cpu"].activation_formats(["mxfp4"]) == "cpu: mxfp4→Q8_0"  # ggml-cpu.c
    assert BACKENDS["cpu"].activation_formats(["f32"]) == "cpu: no quantized weights"
    for backend in BACKENDS.values():  # every backend says what it does; none is silent
        assert backend.activation_formats(types).startswith(f"{backend.name}: q")


def forced_pair(a: str, b: str, forks: list[tuple[str, int, str]]) -> dict:
    return {
        "model": "m",
        "a": a,
        "b": b,
        "status": "ok",
        "differs": [],
        "forced": {
            "status": "ok",
            "red_flags": sum(k == "red flag" for *_, k in forks),
            "tie_threshold": 0.5,
            "n_differing": 40,
            "max_abs_median_differing": 0.25,
            "forks": [
                {"prompt": p, "position": t, "kind": k, "margin": 0.1, "margin_exact": True}
                for p, t, k in forks
            ],
        },
    }


def test_forks_are_counted_by_site_and_a_site_is_a_tie_only_if_every_pair_says_so() -> None:
    pairs = [
        forced_pair("cpu.none", "cpu-fa.none", [("p", 3, "near tie"), ("q", 5, "near tie")]),
        forced_pair("cpu.none", "cpu-fa.f32", [("p", 3, "near tie"), ("q", 5, "undetermined")]),
        forced_pair("cpu.f32", "cpu-fa.none", [("p", 3, "near tie")]),
    ]
    (found,) = [f for f in diagnose([], pairs) if f.rule == "forks"]
    assert (
        found.numbers["forks"] == 5
        and found.numbers["sites"] == 2
        and found.numbers["tie_sites"] == 1
    )
    assert "3 pairs forked 5 times in all, at 2 distinct positions" in found.text
    assert "1 are undetermined" in found.text
    assert "expected to do" not in found.text  # not every site is a tie: no such claim


def _forced(forced: float | list[float]) -> dict:
    if isinstance(forced, list):
        return {
            "status": "ok",
            "max_abs_median": float(np.median(forced)),
            "max_abs_median_by_prompt": {f"p{i}": x for i, x in enumerate(forced)},
        }
    return {"status": "ok", "max_abs_median": forced}


def exact_rows(
    distances: dict[str, tuple[float | list[float], float | list[float]]],
    budgets: dict[str, dict] | None = None,
) -> dict:
    """A distance-from-exact result: label -> (first-step max |Δ|, or per prompt; forced
    median max |Δ|, or per prompt)."""
    return {
        "model": "m",
        "status": "ok",
        "rows": [
            {
                "combination": label,
                "status": "ok",
                "first_step": (
                    {"max_abs": max(first), "max_abs_by_prompt": first}
                    if isinstance(first, list)
                    else {"max_abs": first}
                ),
                "forced": _forced(forced),
                **({"budget": budgets[label]} if budgets and label in budgets else {}),
            }
            for label, (first, forced) in distances.items()
        ],
    }


SPREAD = [0.9, 1.0, 1.1, 0.95, 1.05, 1.0, 0.98, 1.02, 0.97, 1.03, 0.99, 1.01]  # 12 prompts


def _prompts(scale: float, last: float | None = None) -> list[float]:
    values = [scale * x for x in SPREAD]
    return values[:-1] + [last] if last is not None else values


def test_a_ranking_that_one_prompt_would_flip_is_decided_over_all_prompts() -> None:
    """By its worst prompt, `cpu.none` (1.9) looks farther from exact than `cpu-fa.none`
    (1.65 at most); on the 11 other prompts it is nearer, about 1.0 against 1.5: it is the
    closer one, with an interval over prompts that excludes 1."""
    devices = {"cpu": {"backend": "cpu"}, "cpu-fa": {"backend": "cpu", "flash_attn": True}}
    records, pairs = matrix(devices, ["none", "f32"], {("cpu.none", "cpu-fa.none"): 1.8})
    exact = exact_rows(
        {
            "cpu.none": (_prompts(1.0, last=1.9), _prompts(0.7)),
            "cpu-fa.none": (_prompts(1.5, last=1.5), _prompts(0.8)),
            "cpu.f32": (_prompts(0.025), _prompts(0.007)),
            "cpu-fa.f32": (_prompts(0.02), [0.007 * x for x in SPREAD[::-1]]),
        }
    )
    found = {
        f.text.split(":")[0]: f
        for f in diagnose(records, pairs, exact)
        if f.rule == "closer-to-exact"
    }
    text = found["`cpu.none` vs `cpu-fa.none`"].text
    assert "`cpu.none` is 1.42× closer to exact than `cpu-fa.none` at the first step" in text
    assert "geometric mean over 12 prompts of the per-prompt ratio of first-step max |Δ|" in text
    assert (
        "interval 1.28–1.5; `cpu-fa.none` the farther on 11 of 12 prompts; each side's worst prompt 1.9 vs 1.65"
        in text
    )
    # along the text, each prompt's median over its positions, paired the same way
    assert (
        "along the text, `cpu.none` is 1.14× closer (geometric mean over 12 prompts of the "
        "per-prompt ratio of the median over a prompt's forced positions of max |Δ|, 95% "
        "bootstrap interval 1.14–1.14; `cpu-fa.none` the farther on 12 of 12 prompts); "
        "medians over all positions 0.7 vs 0.8." in text
    )
    assert "`cpu.none` vs `cpu-fa.f32`" not in found  # two changes at once: no single question
    near = found["`cpu.f32` vs `cpu-fa.f32`"].text  # a constant 1.25 on every prompt
    assert "`cpu-fa.f32` is 1.25× closer" in near and "interval 1.25–1.25" in near
    assert "along the text, as far as each other (" in near  # the same values, reordered


def test_distances_no_interval_separates_name_no_side() -> None:
    devices = {"cpu": {"backend": "cpu"}, "cpu-fa": {"backend": "cpu", "flash_attn": True}}
    records, pairs = matrix(devices, ["none"], {("cpu.none", "cpu-fa.none"): 1.8})
    exact = exact_rows({"cpu.none": (_prompts(1.0), 0.72), "cpu-fa.none": (SPREAD[::-1], 0.67)})
    (found,) = [f for f in diagnose(records, pairs, exact) if f.rule == "closer-to-exact"]
    assert "as far from exact as each other at the first step, on these prompts" in found.text
    assert "closer" not in found.text


def test_a_more_precise_setting_that_is_not_closer_is_said_plainly() -> None:
    devices = {"cpu": {"backend": "cpu"}}
    records, pairs = matrix(devices, ["none", "f32", "f16"], {})
    exact = exact_rows(
        {
            "cpu.none": (_prompts(1.9), 0.7),
            "cpu.f32": (_prompts(0.04), 0.01),
            "cpu.f16": (_prompts(0.03), 0.01),
        }
    )
    (found,) = [f for f in diagnose(records, pairs, exact) if f.rule == "more-precise-not-closer"]
    assert found.text.startswith(
        "`cpu.f32` (dequant f32) is further from exact than `cpu.f16` (dequant f16) at the "
        "first step, over these prompts (ratio 1.33"
    )


def _budget_of(residual: list[float], floor: list[float]) -> dict:
    """A budget row (qdiff.compare.budget.budget) over prompts p0, p1, ...: the run at
    ``residual`` from the emulation, whose jittered draws are ``floor`` from it."""
    n = len(residual)
    ids = [f"p{k}" for k in range(n)]
    exact = np.zeros((n, 4))
    together = exact + 0.02  # all sources together: 0.02 from exact
    logits = together + np.array(residual)[:, None]
    sets = {"kv": exact + 0.015, "all": together, "j1": together + np.array(floor)[:, None]}
    sets["j2"] = together + 0.5 * np.array(floor)[:, None]
    plan = {"sources": {"kv_f16": "kv"}, "together": "all", "jittered": ["j1", "j2"]}
    return budget(plan, sets, {}, exact, logits, ids, {})


def test_the_error_budget_reads_a_residual_against_its_floor() -> None:
    """Within the floor on most prompts: explained; above it on every prompt, even by a
    little: unexplained, with the median ratio; one prompt far above decides nothing."""
    records, pairs = matrix({"cpu": {"backend": "cpu"}}, ["none", "f32"], {})
    inside = _budget_of([0.001] * 11 + [0.5], [0.002] * 12)
    above = _budget_of([0.003] * 12, [0.002] * 12)
    exact = exact_rows(
        {"cpu.none": (1.9, 0.7), "cpu.f32": (0.025, 0.007)},
        budgets={"cpu.none": inside, "cpu.f32": above},
    )
    found = {f.rule: f.text for f in diagnose(records, pairs, exact) if "budget" in f.rule}
    assert found["error-budget-explained"].startswith(
        "`cpu.none` is 0.021 from exact (first-step max |Δ|, median over 12 prompts; worst 0.52)"
    )
    assert "f16 K/V cache 0.015; all together 0.02" in found["error-budget-explained"]
    assert "within it on 11 of 12 prompts" in found["error-budget-explained"]
    assert "`cpu.f32`" in found["error-budget-unexplained"]
    assert "the median over prompts of residual / floor is 1.5" in found["error-budget-unexplained"]
    assert "within it on 0 of 12 prompts (p = 1.9e-06)" in found["error-budget-unexplained"]
    assert "The floor is" not in found["error-budget-explained"]  # 10% of the distance


def test_an_unexplained_budget_names_the_roundings_the_engine_does_not_follow() -> None:
    """A GPU combination's emulation leaves some of its backend's roundings out: a residual
    above the floor is then expected, and said so, not read as an unknown rounding."""
    records, pairs = matrix({"cuda": {"backend": "cuda"}}, ["none"], {})
    above = _budget_of([0.003] * 12, [0.002] * 12) | {"not_followed": ["TF32 products"]}
    exact = exact_rows({"cuda.none": (1.9, 0.7)}, budgets={"cuda.none": above})
    (found,) = [f for f in diagnose(records, pairs, exact) if "budget" in f.rule]
    assert found.rule == "error-budget-unexplained"
    assert found.text.endswith(
        "as expected, since the engine does not yet follow this backend's TF32 products."
    )
    assert "does not follow." not in found.text


def test_an_error_budget_whose_floor_is_the_distance_is_unresolved() -> None:
    records, pairs = matrix({"cpu": {"backend": "cpu"}}, ["f32"], {})
    coarse = _budget_of([0.001] * 12, [0.05] * 12)  # the floor 0.05, the distance 0.021
    exact = exact_rows({"cpu.f32": (0.025, 0.007)}, budgets={"cpu.f32": coarse})
    (found,) = [f for f in diagnose(records, pairs, exact) if "budget" in f.rule]
    assert found.rule == "error-budget-unresolved"  # all within, the floor twice the distance
    assert "The floor is 238% of the distance itself, so the logits cannot tell this emulation" in (
        found.text
    )


def test_the_float_path_measures_the_kv_caches_share_with_an_f32_kv_device() -> None:
    devices = {
        "cpu": {"backend": "cpu", "kv_cache_type": "f16"},
        "cpu-kv32": {"backend": "cpu", "kv_cache_type": "f32"},
    }
    records, pairs = matrix(devices, ["none", "f32"], {})
    exact = exact_rows({"cpu.f32": ([0.015] * 12, 0.008), "cpu-kv32.f32": ([2.4e-05] * 12, 1e-05)})
    found = {
        f.text.split(" ")[0]: f for f in diagnose(records, pairs, exact) if f.rule == "float-path"
    }
    text = found["`cpu.f32`"].text
    assert "With the KV cache in f32 (`cpu-kv32.f32`, measured) it is 2.4e-05" in text
    assert "the f16 KV cache accounts for 99.8% of that distance" in text
    assert "accounts for" not in found["`cpu-kv32.f32`"].text  # it is the f32 KV device


def test_exact_distances_name_the_side_whose_quantized_kernels_round() -> None:
    devices = {"cpu": {"backend": "cpu"}, "vulkan": {"backend": "vulkan"}}
    records, pairs = matrix(
        devices,
        ["none", "f32"],
        {("cpu.none", "vulkan.none"): 1.28, ("cpu.f32", "vulkan.f32"): 0.015},
    )
    exact = exact_rows(
        {
            "cpu.none": (_prompts(1.28), 0.5),
            "cpu.f32": (_prompts(0.015), 0.008),
            "vulkan.none": (_prompts(0.0107), 0.006),
            "vulkan.f32": (_prompts(0.0124), 0.006),
        }
    )
    (found,) = [f for f in diagnose(records, pairs, exact) if f.rule == "activation-quantization"]
    assert (
        "the quantized-weight kernels of `cpu`: `cpu`'s file run is 85.3× as far from exact as "
        "its f32 copy (typical 1.28 vs 0.015; 95% interval 85.3–85.3 over 12 prompts)" in found.text
    )
    assert (
        "`vulkan`'s file run is 0.863× as far from exact as its f32 copy (typical 0.0107 vs "
        "0.0124; 95% interval 0.863–0.863 over 12 prompts): its kernels add no rounding of "
        "that size here" in found.text
    )
    assert "vulkan: " not in found.text  # no activation format claimed for the side that keeps them


def test_the_reports_first_findings_count_fork_sites_once() -> None:
    """The summary's opening count of forks along the text: a site where three pairs fork
    is one site, not three near ties (it used to sum each pair's count)."""
    from qdiff.report.sections.overview import _fork_sites

    pairs = [
        forced_pair("cpu.none", "cpu-fa.none", [("p", 3, "near tie"), ("q", 5, "near tie")]),
        forced_pair("cpu.none", "cpu-fa.f32", [("p", 3, "near tie"), ("q", 5, "red flag")]),
        forced_pair("cpu.f32", "cpu-fa.none", [("p", 3, "near tie")]),
    ]
    other_model = [forced_pair("cpu.none", "cpu-fa.none", [("p", 3, "undetermined")])]
    said = _fork_sites([fork_sites(pairs), fork_sites(other_model)])
    assert "forked 6 times at 3 distinct sites (model, prompt, position)" in said
    assert (
        "1 near ties in every pair that forks there, 1 with a red flag and 1 undetermined" in said
    )


QUANTIZED_APART = {  # every pair 1.0 apart at the first step, but the f32 copies' 0.02
    ("cpu.none", "gpu.none"): 1.0,
    ("cpu.none", "cpu.f32"): 1.0,
    ("cpu.none", "gpu.f32"): 1.0,
    ("cpu.f32", "gpu.none"): 1.0,
    ("gpu.none", "gpu.f32"): 1.0,
    ("cpu.f32", "gpu.f32"): 0.02,
}


def generating(records: list[dict], parts: dict[str, int], k: int = 6) -> list[dict]:
    """Each record generates the same 20 tokens from each of 10 prompts, except that the
    combinations in ``parts`` change their token at that position on the first ``k``."""
    for r in records:
        at = parts.get(f"{r['device']}.{r['dequant']}")
        r["generation"] = {"n_tokens": 20}
        r["prompts"] = [
            {"id": f"p{i}", "tokens": [999 if t == at and i < k else t for t in range(20)]}
            for i in range(10)
        ]
    return records


def per_prompt(pairs: list[dict], values: dict[tuple[str, str], list[float]]) -> list[dict]:
    """Give each pair per-prompt first-step max |Δ| rows over the 10 prompts: ``values`` per
    pair, else its headline on every prompt."""
    for p in pairs:
        row = values.get((p["a"], p["b"]), [p["summary"]["max_abs_max"]] * 10)
        p["prompts"] = [{"prompt": f"p{i}", "max_abs": x} for i, x in enumerate(row)]
    return pairs


def test_a_tiny_first_step_difference_whose_texts_part_early_is_a_finding() -> None:
    """The f32 copies are 0.02 apart, a fiftieth of the other pairs' 1.0 on every prompt, yet
    their texts part on 6 of 10 prompts at token 1 of 20: the finding names the pair and its
    numbers."""
    records, pairs = matrix(CPU_CUDA, ["none", "f32"], QUANTIZED_APART)
    found = diagnose(generating(records, {"gpu.f32": 1}), per_prompt(pairs, {}))
    (f,) = [f for f in found if f.rule == "tiny-yet-parts-early"]
    assert f.text.startswith(
        "`cpu.f32` vs `gpu.f32`: first-step max |Δ| a median 0.02 over 10 prompts, against a "
        "median 1 for the model's 5 other pairs (the others' median on each prompt is 50× "
        "this pair's, geometric mean over the prompts, 95% bootstrap interval 50–50×)"
    )
    assert "part on 6 of these 10 prompts (95% Wilson interval 31%–83%)" in f.text
    assert "median divergence index of 1 of at most 20 tokens generated" in f.text
    assert "lower end at least 10×" in f.text and "at least 50%" in f.text
    assert f.numbers["median_index"] == 1 and f.numbers["diverged"] == 6


def test_tiny_is_decided_over_prompts_not_by_one_prompts_maximum() -> None:
    """Issue 31: a threshold on the worst prompt's max |Δ| is one prompt's verdict. Here the
    other pairs are 1.0 apart on one prompt only (0.03 on the rest), so the f32 copies'
    0.02 is not tiny by their worst prompts' 1.0: no finding. And an f32 pair 0.5 apart on
    one prompt but 0.01 on the nine others is tiny over the prompts: a finding."""
    records, pairs = matrix(CPU_CUDA, ["none", "f32"], QUANTIZED_APART)
    one_prompt_apart = {k: [1.0] + [0.03] * 9 for k in QUANTIZED_APART if k[0] != "cpu.f32"}
    one_prompt_apart[("cpu.f32", "gpu.none")] = [1.0] + [0.03] * 9
    one_prompt_apart[("cpu.f32", "gpu.f32")] = [0.02] * 10
    found = diagnose(generating(records, {"gpu.f32": 1}), per_prompt(pairs, one_prompt_apart))
    assert "tiny-yet-parts-early" not in rules(found)

    records, pairs = matrix(CPU_CUDA, ["none", "f32"], QUANTIZED_APART)
    outlier = {("cpu.f32", "gpu.f32"): [0.5] + [0.01] * 9}
    found = diagnose(generating(records, {"gpu.f32": 1}), per_prompt(pairs, outlier))
    (f,) = [f for f in found if f.rule == "tiny-yet-parts-early"]
    assert f.numbers["max_abs_median"] == 0.01 and f.numbers["ratio_low"] >= 10


def test_tiny_needs_enough_finite_prompts_and_names_a_bit_identical_pair() -> None:
    """A NaN prompt is left out (it made a "nan×" finding); fewer than 5 prompts decide
    nothing (the interval would be one prompt's verdict); a pair bit-identical at the first
    step is said to be, not "1e+291×" the others."""
    records, pairs = matrix(CPU_CUDA, ["none", "f32"], QUANTIZED_APART)
    nan = {("cpu.f32", "gpu.f32"): [float("nan")] * 6 + [0.02] * 4}
    found = diagnose(generating(records, {"gpu.f32": 1}), per_prompt(pairs, nan))
    assert "tiny-yet-parts-early" not in rules(found)

    records, pairs = matrix(CPU_CUDA, ["none", "f32"], QUANTIZED_APART)
    zero = {("cpu.f32", "gpu.f32"): [0.0] * 2 + [0.02] * 8}
    found = diagnose(generating(records, {"gpu.f32": 1}), per_prompt(pairs, zero))
    (f,) = [f for f in found if f.rule == "tiny-yet-parts-early"]
    assert "(bit-identical at the first step on 2 of 10 prompts)" in f.text, f.text


def test_no_finding_when_the_texts_part_late_rarely_or_after_a_large_difference() -> None:
    records, pairs = matrix(CPU_CUDA, ["none", "f32"], QUANTIZED_APART)
    per_prompt(pairs, {})
    for parts, k in (
        ({"gpu.f32": 15}, 6),  # late: at 15 of 20
        ({"gpu.f32": 1}, 4),  # early but on 4 of 10 prompts only
        ({"gpu.none": 1}, 6),  # early and often, but 1.0 apart: not tiny
    ):
        found = diagnose(generating(records, parts, k), pairs)
        assert "tiny-yet-parts-early" not in rules(found), parts
    assert "tiny-yet-parts-early" not in rules(diagnose(records[:2], pairs[:1]))  # no others
