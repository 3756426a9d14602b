"""llama.cpp's rounding sources as switches of the float64 engine (qdiff.exact.roundings),
against llama.cpp's CPU backend on tiny real GGUFs.

- Op by op: each matmul of layer 0, from llama.cpp's own captured input, with the input
  rounded as the switch says, equals llama.cpp's captured output to float32 rounding; the
  same product without the rounding does not.
- Whole models: with the right switches the engine is within the floor of llama.cpp's run
  (the emulation against itself with its roundings' inputs jittered by a float32 sum's
  error, qdiff.compare.budget), at the median position; with a source left out or the other
  attention path, well above it, and the error budget reads that as unexplained.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import in_child, quantize_in_child
from qdiff import exact
from qdiff.compare.budget import budget, ubatch_floor, verdict
from qdiff.core.roundings import (
    JITTER_SEEDS,
    Roundings,
    config_id,
    plan,
    sources_of,
)
from qdiff.core.settings import DeviceSettings
from qdiff.exact.roundings import flash_rows_one_by_one, q8_0
from test_exact import PROMPT, llama_cpp_logits
from tinymodel import write_tiny_gemma3, write_tiny_llama

# matmuls of layer 0 whose input llama.cpp names: (its input, its output, the weight)
LAYER0 = [
    ("attn_norm-0", "Qcur-0", "blk.0.attn_q.weight"),
    ("attn_norm-0", "Kcur-0", "blk.0.attn_k.weight"),
    ("attn_norm-0", "Vcur-0", "blk.0.attn_v.weight"),
    ("ffn_norm-0", "ffn_gate-0", "blk.0.ffn_gate.weight"),
    ("ffn_norm-0", "ffn_up-0", "blk.0.ffn_up.weight"),
]


def captured_layer0(path: Path) -> dict[str, np.ndarray]:
    """llama.cpp's tensors at the prompt's last token, each name's first occurrence (in a
    child process: ``in_child``)."""
    from qdiff.engine.capture import TensorCapture
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel
    from qdiff.engine.worker import _capture_prompt

    log = init_backend()  # kept while llama.cpp runs
    settings = DeviceSettings(backend="cpu", threads=1, kv_cache_type="f32")
    arrays: dict[str, np.ndarray] = {}
    with LoadedModel(path, settings, 256) as model:
        tokens = model.tokenize(PROMPT, parse_special=False)
        row = _capture_prompt(model, TensorCapture("-0$"), "p", tokens, "t", arrays)
    del log
    first: dict[str, np.ndarray] = {}
    for t in row["tensors"]:
        first.setdefault(t["name"], arrays[t["key"]])
    return first


@pytest.mark.parametrize("target", ["q8_0", "q4_1", "q4_k_m", "f16"])
def test_each_matmul_rounds_its_input_as_the_switch_says(tmp_path: Path, target: str) -> None:
    source = write_tiny_llama(tmp_path / "f32.gguf", n_embd=256, n_ff=512)
    path = tmp_path / f"{target}.gguf"
    quantize_in_child(source, path, target)
    tensors = in_child(captured_layer0, path)
    model = exact.ExactModel(path, Roundings(activations=True))
    weights = model.weights
    for given, made, weight in LAYER0:
        x, theirs = tensors[given].astype(np.float64), tensors[made].astype(np.float64)
        kind = weights.type_of(weight)
        emulated = model.linear(x[None], weight)[0]
        plain = x @ weights[weight].T
        scale = np.abs(theirs).max()
        err, err_plain = np.abs(emulated - theirs).max(), np.abs(plain - theirs).max()
        assert err < 1e-5 * scale, (weight, kind, err / scale)
        assert err_plain > 20 * max(err, 1e-7 * scale), (weight, kind, err, err_plain)


def _emulations(path: Path, roundings: Roundings, **settings: object) -> dict[str, np.ndarray]:
    """At every forced position: llama.cpp's run, the exact answer, the engine with
    ``roundings`` (``together``) and jittered (``j<seed>``), as the budget's job has them."""
    prompt, forced, run = llama_cpp_logits(path, kv="f16", **settings)
    model = exact.ExactModel(path)
    sequence, outputs = prompt + forced[:-1], slice(len(prompt) - 1, None)
    made = {"run": run, "exact": model.forward(sequence, outputs)}
    sets = {"together": roundings} | {
        f"j{seed}": dataclasses.replace(roundings, jitter=seed) for seed in JITTER_SEEDS
    }
    for name, r in sets.items():
        model.roundings = r
        made[name] = model.forward(sequence, outputs)
    return made


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("roundings")
    return {
        "llama": write_tiny_llama(folder / "llama.gguf", n_head_kv=2),
        "gemma3": write_tiny_gemma3(folder / "gemma3.gguf"),
    }


def _read(path: Path, roundings: Roundings, flash: bool) -> tuple[str, dict]:
    """The error budget of llama.cpp's run against ``roundings``, forced positions as its
    prompts (qdiff.compare.budget): its reading, and the row."""
    made = _emulations(path, roundings, flash_attn=flash)
    positions = [str(k) for k in range(len(made["run"]))]
    jittered = [f"j{seed}" for seed in JITTER_SEEDS]
    entry = {"sources": {}, "together": "together", "jittered": jittered}
    row = budget(entry, made, {}, made["exact"], made["run"], positions, {})
    return verdict(row), row


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("flash", [False, True], ids=["plain", "flash"])
def test_the_cpu_attention_and_gelu_are_followed_to_the_floor(
    tiny: dict[str, Path], arch: str, flash: bool
) -> None:
    """An f16 KV cache, without and with flash attention (a 35-token prompt: every row on
    the one-row path, f16 accumulator), and Gemma's GELU table: explained with the right
    switches; with the other attention path, K/V storage alone, or nothing, unexplained and
    at least twice the floor at the median position."""
    gelu = arch == "gemma3"
    right = Roundings(kv_f16=True, qp_f16=not flash, flash_cpu=flash, gelu_table=gelu)
    reading, row = _read(tiny[arch], right, flash)
    assert reading == "explained", row
    for wrong in (
        dataclasses.replace(right, qp_f16=flash, flash_cpu=not flash),
        Roundings(kv_f16=True, gelu_table=gelu),
        Roundings(),
    ):
        reading, row = _read(tiny[arch], wrong, flash)
        assert reading == "unexplained" and row["ratio_median"] > 2, (config_id(wrong), row)


# ---- pure logic ----


def test_q8_0_is_ggmls_own_quantization() -> None:
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32) * 3
    kind = gguf.GGMLQuantizationType.Q8_0
    theirs = gguf.quants.dequantize(gguf.quants.quantize(x, kind), kind)
    assert np.array_equal(q8_0(x), theirs.astype(np.float64))


def test_flash_attentions_one_row_path_is_chosen_per_ubatch() -> None:
    assert flash_rows_one_by_one(35, 512).all()  # one ubatch of 35 < 64 rows
    assert not flash_rows_one_by_one(100, 512).any()  # one ubatch of 100: tiled
    rows = flash_rows_one_by_one(100, 64)  # 64 tiled, then 36 on the one-row path
    assert not rows[:64].any() and rows[64:].all()


def test_each_combination_gets_its_backends_sources() -> None:
    cpu = DeviceSettings(backend="cpu").as_dict()
    assert set(sources_of(cpu, "none")) == {"activations", "kv_f16", "qp_f16", "gelu_table"}
    flash = {**cpu, "flash_attn": True, "n_ubatch": 32}
    assert sources_of(flash, "f32")["flash_cpu"] == Roundings(flash_cpu=True, n_ubatch=32)
    assert "kv_f16" not in sources_of({**cpu, "kv_cache_type": "f32"}, "f32")
    configs, by_combination = plan(
        {
            "cpu.none": (cpu, "none"),
            "cpu.f32": (cpu, "f32"),
            "cuda.none": (DeviceSettings(backend="cuda").as_dict(), "none"),
            "cuda-ub16.none": (DeviceSettings(backend="cuda", n_ubatch=16).as_dict(), "none"),
            "cuda-fa.none": (DeviceSettings(backend="cuda", flash_attn=True).as_dict(), "none"),
            "cuda-kv32.f32": (DeviceSettings(backend="cuda", kv_cache_type="f32").as_dict(), "f32"),
            "vulkan.none": (DeviceSettings(backend="vulkan").as_dict(), "none"),
            "metal.none": (DeviceSettings(backend="metal").as_dict(), "none"),
            "cpu.f16": (cpu, "f16"),
        }
    )
    cuda_sources = by_combination["cuda.none"]["sources"]
    assert set(cuda_sources) == {
        "cuda_activations",
        "cuda_f16",
        "cuda_tf32",
        "kv_f16",
        "cuda_attention",
    }
    assert cuda_sources["cuda_attention"] == "cuda_attention@ub512"
    assert "cuda_attention" not in by_combination["cuda-fa.none"]["sources"]
    # an f32 cache: attention's TF32 kernels, no f16 K/V
    kv32 = by_combination["cuda-kv32.f32"]
    assert set(kv32["sources"]) == {"cuda_tf32", "cuda_attention_kv_f32"}
    assert kv32["together"] == "cuda_tf32+cuda_attention_kv_f32+f32_copy@ub512"
    assert set(by_combination["vulkan.none"]["sources"]) == {
        "vulkan_matmul",
        "kv_f16",
        "vulkan_attention",
    }
    assert "not emulated yet" in by_combination["metal.none"]["not_emulated"]
    assert "weights are not the file's" in by_combination["cpu.f16"]["not_emulated"]
    shared = by_combination["cpu.none"]["sources"]["kv_f16"]
    assert shared == by_combination["cpu.f32"]["sources"]["kv_f16"] == "kv_f16"
    every = [c for entry in by_combination.values() for c in entry.get("sources", {}).values()]
    assert set(every) <= set(configs) and len(configs) == len(set(configs))
    assert len(by_combination["cpu.none"]["jittered"]) == len(JITTER_SEEDS)


def test_a_floor_is_at_least_float32s_level_of_the_largest_logit() -> None:
    """Where jittering moves nothing (no rounding near a tie), the run still differs from
    a faithful emulation by the order of its float32 sums: the floor is 2^-20 of its
    largest logit, not 0."""
    logits = np.array([[8.0, 0.0, -1.0]] * 3)
    together = logits + np.array([[2e-6], [1e-5], [4e-6]])  # the residual per prompt
    sets = {"all": together, "j1": together, "j2": together}
    entry = {"sources": {}, "together": "all", "jittered": ["j1", "j2"]}
    row = budget(entry, sets, {}, np.zeros_like(logits), logits, ["a", "b", "c"], {})
    assert row["floor"]["median"] == row["floor_parts"]["float32"]["max"] == 8 * 2.0**-20
    assert row["floor_parts"]["jittered"]["max"] == 0.0 and row["within_floor"] == 2


def test_another_ubatch_is_a_floor_on_the_cpu_and_not_on_cuda() -> None:
    """On CUDA a smaller ubatch changes every matmul's kernel: not a floor."""
    rows = [{"id": "a", "status": "ok", "max_abs_first_step": 0.003}]
    serving = {"status": "ok", "cases": [{"kind": "ubatch", "prompts": rows}]}
    run = {"prompts": [{"id": "a", "prompt_tokens": [1, 2, 3]}]}
    assert ubatch_floor(serving, run | {"settings": {"backend": "cpu"}}) == {"a": 0.003}
    assert ubatch_floor(serving, run | {"settings": {"backend": "cuda"}}) == {}


def test_cudas_attention_is_of_one_cache_type() -> None:
    """An f16 cache's attention and an f32 cache's exclude each other: no set of switches
    says both."""
    with pytest.raises(ValueError, match="exclude each other"):
        Roundings(cuda_attention=True, cuda_attention_kv_f32=True)
    f32_cache = DeviceSettings(backend="cuda", kv_cache_type="f32").as_dict()
    assert "cuda_attention" not in sources_of(f32_cache, "none")


def test_flash_attention_rounds_an_f32_caches_k_and_v_to_f16() -> None:
    """llama-graph.cpp casts an f32 K and V to f16 for ggml_flash_attn_ext: an f32 KV cache
    with flash attention still has the f16 K/V source, without it not."""
    f32_cache = DeviceSettings(backend="cpu", kv_cache_type="f32").as_dict()
    assert "kv_f16" not in sources_of(f32_cache, "f32")
    flash = sources_of({**f32_cache, "flash_attn": True}, "f32")
    assert {"kv_f16", "flash_cpu"} <= set(flash)
