"""Each diagnosis rule on constructed matrices that should, and should not, trigger it."""

from __future__ import annotations

from itertools import combinations

from qdiff.core.backends import BACKENDS
from qdiff.judge.diagnosis import diagnose

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


def matrix(devices: dict[str, dict], dequants: list[str], max_abs: dict[tuple[str, str], float]):
    """Records for every device x dequant and pairs whose max |Δ| comes from ``max_abs``
    (keyed by unordered label pairs; missing pairs are 0.01)."""
    records = [record(d, dq, **s) for d, s in devices.items() for dq in dequants]
    pairs = []
    for ra, rb in combinations(records, 2):
        a, b = f"{ra['device']}.{ra['dequant']}", f"{rb['device']}.{rb['dequant']}"
        value = max_abs.get((a, b), max_abs.get((b, a), 0.01))
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
                    "bit_identical_count": 8 if value == 0 else 0,
                    "n_prompts": 8,
                    "forked": 3 if value > 1 else 0,
                },
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
    assert "100× more" in found[0].text and "max |Δ| 2 vs 0.02" in found[0].text
    assert "q4_K→Q8_K" in found[0].text and "q8_1" in found[0].text
    assert found[0].numbers == {"quantized": 2.0, "f32": 0.02}


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
    assert len(fp) == 1 and fp[0].numbers == {"f32": 0.03, "fp16_rounding": 0.13}
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
    assert any(f.rule == "unexplained" and "more than one fp16 rounding" in f.text for f in found)


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
    assert "none: max |Δ| 1.8, forks 3/8" in setting[0].text
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


def test_activation_formats_follow_the_backend() -> None:
    types = ["f32", "q4_K", "q5_0", "q4_1"]
    assert BACKENDS["cpu"].activation_formats(types) == "cpu: q5_0→Q8_0; q4_1→Q8_1; q4_K→Q8_K"
    assert BACKENDS["metal"].activation_formats(types).endswith("activations not quantized")
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


def exact_rows(
    distances: dict[str, tuple[float, float]], emulated: dict[str, float] | None = None
) -> dict:
    """A distance-from-exact result: label -> (first-step max |Δ|, forced median max |Δ|)."""
    return {
        "model": "m",
        "status": "ok",
        "rows": [
            {
                "combination": label,
                "status": "ok",
                "first_step": {"max_abs": first},
                "forced": {"status": "ok", "max_abs_median": forced},
                **(
                    {"first_step_vs_cpu_roundings": {"max_abs": emulated[label]}}
                    if emulated and label in emulated
                    else {}
                ),
            }
            for label, (first, forced) in distances.items()
        ],
    }


def test_the_side_closer_to_exact_is_named_and_disagreements_said() -> None:
    devices = {"cpu": {"backend": "cpu"}, "cpu-fa": {"backend": "cpu", "flash_attn": True}}
    records, pairs = matrix(devices, ["none", "f32"], {("cpu.none", "cpu-fa.none"): 1.8})
    exact = exact_rows(
        {
            "cpu.none": (1.9, 0.7),
            "cpu-fa.none": (1.5, 0.8),
            "cpu.f32": (0.025, 0.007),
            "cpu-fa.f32": (0.02, 0.008),
        }
    )
    found = {
        f.text.split(":")[0]: f
        for f in diagnose(records, pairs, exact)
        if f.rule == "closer-to-exact"
    }
    text = found["`cpu.none` vs `cpu-fa.none`"].text
    assert "`cpu-fa.none` is 1.27× closer to exact at the first step (max |Δ| 1.5 vs 1.9)" in text
    assert "along the text it is the other way round: `cpu.none` is closer" in text
    assert "`cpu.none` vs `cpu-fa.f32`" not in found  # two changes at once: no single question
    near = found["`cpu.f32` vs `cpu-fa.f32`"].text  # 0.025 vs 0.02: within 25%, a side is named
    assert "`cpu-fa.f32` is 1.25× closer" in near


def test_distances_within_ten_percent_name_no_side() -> None:
    devices = {"cpu": {"backend": "cpu"}, "cpu-fa": {"backend": "cpu", "flash_attn": True}}
    records, pairs = matrix(devices, ["none"], {("cpu.none", "cpu-fa.none"): 1.8})
    exact = exact_rows({"cpu.none": (1.48, 0.72), "cpu-fa.none": (1.43, 0.67)})
    (found,) = [f for f in diagnose(records, pairs, exact) if f.rule == "closer-to-exact"]
    assert (
        "about as far from exact at the first step (max |Δ| 1.48 vs 1.43, within 10%)" in found.text
    )
    assert "is 1.03× closer" not in found.text


def test_a_more_precise_setting_that_is_not_closer_is_said_plainly() -> None:
    devices = {"cpu": {"backend": "cpu"}}
    records, pairs = matrix(devices, ["none", "f32", "f16"], {})
    exact = exact_rows({"cpu.none": (1.9, 0.7), "cpu.f32": (0.04, 0.01), "cpu.f16": (0.03, 0.01)})
    (found,) = [f for f in diagnose(records, pairs, exact) if f.rule == "more-precise-not-closer"]
    assert found.text.startswith(
        "`cpu.f32` (dequant f32) is further from exact than `cpu.f16` (dequant f16)"
    )


def test_the_float_path_says_how_much_llama_cpps_cpu_roundings_explain() -> None:
    records, pairs = matrix(
        {"cpu": {"backend": "cpu", "kv_cache_type": "f16"}}, ["none", "f32"], {}
    )
    exact = exact_rows(
        {"cpu.none": (1.9, 0.7), "cpu.f32": (0.025, 0.007)}, emulated={"cpu.f32": 0.004}
    )
    (found,) = [f for f in diagnose(records, pairs, exact) if f.rule == "float-path"]
    assert "`cpu.f32` (the same weights as the file, in f32) is 0.025 from exact" in found.text
    assert "to within 0.004 of it: the emulation reproduces most of it." in found.text


def test_the_float_path_measures_the_kv_caches_share_with_an_f32_kv_device() -> None:
    devices = {
        "cpu": {"backend": "cpu", "kv_cache_type": "f16"},
        "cpu-kv32": {"backend": "cpu", "kv_cache_type": "f32"},
    }
    records, pairs = matrix(devices, ["none", "f32"], {})
    exact = exact_rows(
        {"cpu.f32": (0.015, 0.008), "cpu-kv32.f32": (2.4e-05, 1e-05)}, emulated={"cpu.f32": 0.012}
    )
    found = {
        f.text.split(" ")[0]: f for f in diagnose(records, pairs, exact) if f.rule == "float-path"
    }
    text = found["`cpu.f32`"].text
    assert "With the KV cache in f32 (`cpu-kv32.f32`, measured) it is 2.4e-05" in text
    assert "the f16 KV cache accounts for 99.8% of that distance" in text
    assert "the emulation reproduces little of it, so llama.cpp rounds somewhere" in text
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
            "cpu.none": (1.28, 0.5),
            "cpu.f32": (0.015, 0.008),
            "vulkan.none": (0.0107, 0.006),
            "vulkan.f32": (0.0124, 0.006),
        }
    )
    (found,) = [f for f in diagnose(records, pairs, exact) if f.rule == "activation-quantization"]
    assert (
        "the quantized-weight kernels of `cpu`: `cpu`'s file run is 1.28 from exact" in found.text
    )
    assert (
        "`vulkan`'s file run is about as near exact as its f32 copy (0.0107 vs 0.0124)"
        in found.text
    )
    assert "vulkan: " not in found.text  # no activation format claimed for the side that keeps them
