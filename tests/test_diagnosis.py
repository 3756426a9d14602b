"""Each diagnosis rule on constructed matrices that should, and should not, trigger it."""

from __future__ import annotations

from itertools import combinations

from qdiff.diagnosis import activation_formats, diagnose

WEIGHTS = {"none": {"f32": 10, "q4_K": 20, "q8_0": 2}, "f32": {"f32": 32}, "f16": {"f32": 10, "f16": 22}}


def record(device: str, dequant: str, backend: str = "cpu", **settings) -> dict:
    return {
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
        differs = [f"{k} {ra['settings'][k]}→{rb['settings'][k]}" for k in ra["settings"]
                   if ra["settings"][k] != rb["settings"].get(k)]
        if ra["dequant"] != rb["dequant"]:
            differs.insert(0, f"dequant {ra['dequant']}→{rb['dequant']}")
        pairs.append({
            "a": a, "b": b, "status": "ok", "differs": differs,
            "summary": {"max_abs": value, "bit_identical": 8 if value == 0 else 0,
                        "n_prompts": 8, "forked": 3 if value > 1 else 0},
        })
    return records, pairs


def rules(findings) -> list[str]:
    return [f.rule for f in findings]


CPU_CUDA = {"cpu": {"backend": "cpu"}, "gpu": {"backend": "cuda"}}


def test_activation_quantization_when_the_file_differs_far_more_than_its_copies() -> None:
    records, pairs = matrix(CPU_CUDA, ["none", "f32"], {("cpu.none", "gpu.none"): 2.0,
                                                       ("cpu.f32", "gpu.f32"): 0.02})
    found = [f for f in diagnose(records, pairs) if f.rule == "activation-quantization"]
    assert len(found) == 1
    assert "100× more" in found[0].text and "max |Δ| 2 vs 0.02" in found[0].text
    assert "q4_K→Q8_K" in found[0].text and "q8_1" in found[0].text
    assert found[0].numbers == {"quantized": 2.0, "f32": 0.02}


def test_no_activation_quantization_when_copies_differ_as_much() -> None:
    records, pairs = matrix(CPU_CUDA, ["none", "f32"], {("cpu.none", "gpu.none"): 0.05,
                                                       ("cpu.f32", "gpu.f32"): 0.02})
    found = diagnose(records, pairs)
    assert "activation-quantization" not in rules(found)
    assert "unexplained" in rules(found)  # no f16 copy: the f32 gap cannot be explained


def test_float_precision_when_the_f32_gap_is_within_one_fp16_rounding() -> None:
    gaps = {("cpu.none", "gpu.none"): 2.0, ("cpu.f32", "gpu.f32"): 0.03,
            ("gpu.f32", "gpu.f16"): 0.13, ("cpu.f32", "cpu.f16"): 0.03}
    found = diagnose(*matrix(CPU_CUDA, ["none", "f32", "f16"], gaps))
    fp = [f for f in found if f.rule == "float-precision"]
    assert len(fp) == 1 and fp[0].numbers == {"f32": 0.03, "fp16_rounding": 0.13}
    assert "unexplained" not in rules(found)


def test_f32_gap_beyond_fp16_rounding_is_unexplained() -> None:
    gaps = {("cpu.none", "gpu.none"): 2.0, ("cpu.f32", "gpu.f32"): 0.5,
            ("gpu.f32", "gpu.f16"): 0.1, ("cpu.f32", "cpu.f16"): 0.05}
    found = diagnose(*matrix(CPU_CUDA, ["none", "f32", "f16"], gaps))
    assert "float-precision" not in rules(found)
    assert any(f.rule == "unexplained" and "more than one fp16 rounding" in f.text for f in found)


def test_setting_names_the_one_that_differs() -> None:
    devices = {"cpu": {"backend": "cpu"}, "cpu-fa": {"backend": "cpu", "flash_attn": True}}
    found = diagnose(*matrix(devices, ["none", "f32"], {("cpu.none", "cpu-fa.none"): 1.8,
                                                       ("cpu.f32", "cpu-fa.f32"): 0.0}))
    setting = [f for f in found if f.rule == "setting"]
    assert len(setting) == 1
    assert "differ only in flash_attn False→True" in setting[0].text
    assert "none: max |Δ| 1.8, forks 3/8" in setting[0].text and "f32: bit-identical" in setting[0].text


def test_device_blame_when_a_same_device_change_moves_as_much() -> None:
    devices = {"cpu": {"backend": "cpu"}, "cpu-fa": {"backend": "cpu", "flash_attn": True},
               "gpu": {"backend": "cuda"}}
    gaps = {("cpu.none", "gpu.none"): 2.2, ("cpu.none", "cpu-fa.none"): 1.8}
    found = [f for f in diagnose(*matrix(devices, ["none"], gaps)) if f.rule == "device-blame"]
    assert any("`cpu` vs `gpu`" in f.text and "82% as much" in f.text for f in found)


def test_no_device_blame_when_same_device_changes_are_small() -> None:
    devices = {"cpu": {"backend": "cpu"}, "cpu-fa": {"backend": "cpu", "flash_attn": True},
               "gpu": {"backend": "cuda"}}
    gaps = {("cpu.none", "gpu.none"): 2.2, ("cpu-fa.none", "gpu.none"): 2.2,
            ("cpu.none", "cpu-fa.none"): 0.1}
    assert "device-blame" not in rules(diagnose(*matrix(devices, ["none"], gaps)))


def test_activation_formats_follow_the_backend() -> None:
    types = ["f32", "q4_K", "q5_0", "q4_1"]
    assert activation_formats("cpu", types) == "cpu: q5_0→Q8_0; q4_1→Q8_1; q4_K→Q8_K"
    assert activation_formats("metal", types).endswith("activations not quantized")
    assert activation_formats("cpu", ["f32"]) == "cpu: no quantized weights"
