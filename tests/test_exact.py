"""The exact float64 engine (qdiff.exact) against llama.cpp itself, on tiny real GGUFs.

Tolerances, derived from float32 arithmetic (unit roundoff u = 2^-24 ≈ 6e-8): a dot product
of length n in float32 is off by at most n·u relative to its terms (n ≤ 512 here: 3e-5); two
layers and the output, a few such operations each, bound llama.cpp's f32 path at 1e-4 of the
logits' scale. On Gemma, llama.cpp's CPU GELU reads an fp16 table: the input and the value
are each rounded to fp16 (2^-11 relative), about 1e-3 per layer's feed-forward; over 3
layers (and a safety factor of two) that bounds the gap at 7e-3 of the scale, and emulating
the table (``Roundings(gelu_table=True)``) must bring it back under the float32 bound: what remains are
inputs within float32 noise of an fp16 rounding boundary, rounded the other way. (Those
flips compound with depth, so the tiny gemma3 is shallow: 3 layers, one of them global.)
A deliberately wrong engine (RoPE pairs, RoPE base, a missing norm, no sliding window) must
exceed the float32 bound tenfold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import in_child, quantize_in_child
from qdiff import exact
from qdiff.core.roundings import Roundings
from qdiff.core.settings import DeviceSettings
from qdiff.engine.log import init_backend
from qdiff.engine.model import LoadedModel
from tinymodel import write_tiny_gemma3, write_tiny_llama

FLOAT32_BOUND = 1e-4
GELU_TABLE_BOUND = 7e-3
PROMPT = "Once upon a time there was a dragon"  # 35 tokens: past the tiny gemma3's window


@functools.cache
def llama_cpp_logits(
    path: Path, n_forced: int = 6, kv: str = "f32", **settings: Any
) -> tuple[list[int], list[int], np.ndarray]:
    """llama.cpp's CPU logits (an f32 KV cache unless ``kv`` says otherwise; other device
    ``settings``) at the prompt's last token and along its own greedy output, one token per
    step, as a forced pass takes them. In a child process, so that a crash of llama.cpp fails
    these tests and not the session; once per model and settings (they are deterministic)."""
    return in_child(_llama_cpp_logits, path, n_forced, kv, settings)


def _llama_cpp_logits(
    path: Path, n_forced: int, kv: str, settings: dict[str, Any]
) -> tuple[list[int], list[int], np.ndarray]:
    log = init_backend()  # kept while llama.cpp runs: it holds the callback
    device = DeviceSettings(**{"backend": "cpu", "threads": 1, "kv_cache_type": kv, **settings})
    model = LoadedModel(path, device, 256)
    with model:
        prompt = model.tokenize(PROMPT, parse_special=False)
        forced = model.generate(prompt, n_forced).tokens
        rows: list[np.ndarray] = []
        model.force(prompt, forced, lambda t, logits: rows.append(logits.copy()))
    del log
    return prompt, forced, np.array(rows, dtype=np.float64)


def gap(
    path: Path,
    make: Callable[[Path], exact.ExactModel] = exact.ExactModel,
    kv: str = "f32",
    **settings: Any,
) -> float:
    """The largest |exact - llama.cpp| over the forced positions, relative to the scale."""
    prompt, forced, reference = llama_cpp_logits(path, kv=kv, **settings)
    ours = make(path).forward(prompt + forced[:-1], slice(len(prompt) - 1, None))
    return float(np.abs(ours - reference).max() / np.abs(ours).max())


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("exact") / "llama.gguf", n_head_kv=2)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("exact") / "gemma3.gguf")


def test_llama_agrees_with_llama_cpp_to_float32_rounding(tiny_llama: Path) -> None:
    assert gap(tiny_llama) < FLOAT32_BOUND


def test_gemma3_agrees_with_llama_cpp_up_to_its_fp16_gelu_table(tiny_gemma3: Path) -> None:
    model = exact.ExactModel(tiny_gemma3)
    assert model.hp.swa_layers == (True, False, True)
    assert model.hp.rope(0) == (10000.0, 1.0) and model.hp.rope(1) == (1e6, 1.0)
    plain = gap(tiny_gemma3)
    emulated = gap(tiny_gemma3, lambda p: exact.ExactModel(p, Roundings(gelu_table=True)))
    assert emulated < FLOAT32_BOUND < plain < GELU_TABLE_BOUND  # the table is the whole gap


def _wrong(which: str, changes: dict) -> Callable[[Path], exact.ExactModel]:
    def make(path: Path) -> exact.ExactModel:
        model = exact.ExactModel(path, Roundings(gelu_table=which == "gemma3"))
        model.hp = dataclasses.replace(model.hp, **changes)
        return model

    return make


@pytest.mark.parametrize(
    ("which", "change"),
    [
        ("llama", {"arch": dataclasses.replace(exact.ARCHITECTURES["llama"], neox_rope=True)}),
        ("llama", {"rope_base": 1e6}),
        ("gemma3", {"rope_base_swa": 1e6}),  # the local layers' base llama.cpp defaults
        ("gemma3", {"swa_layers": (False,) * 3}),  # no sliding window
        ("gemma3", {"arch": dataclasses.replace(exact.ARCHITECTURES["gemma3"], post_norms=False)}),
    ],
)
def test_a_wrong_engine_fails(
    tiny_llama: Path, tiny_gemma3: Path, which: str, change: dict
) -> None:
    path = tiny_llama if which == "llama" else tiny_gemma3
    assert gap(path, _wrong(which, change)) > 10 * FLOAT32_BOUND


@pytest.mark.parametrize("target", ["q8_0", "q4_1", "q5_0", "q4_k_m", "q6_k"])
def test_dequantization_matches_llama_cpp_bit_for_bit(tmp_path: Path, target: str) -> None:
    """gguf-py's dequantization against the f32 copy llama_model_quantize writes, for every
    weight type of the shipped models (K-quants need rows of 256)."""
    source = write_tiny_llama(tmp_path / "f32.gguf", n_embd=256, n_ff=512)
    quantized, copy = tmp_path / f"{target}.gguf", tmp_path / f"{target}.f32.gguf"
    quantize_in_child(source, quantized, target)
    quantize_in_child(quantized, copy, "f32")
    ours, theirs = exact.Weights(quantized), exact.Weights(copy)
    types = ours.types()
    assert set(types) - {"f32"}, types  # something was quantized
    for name in ours._tensors:
        a, b = ours.float32(name), theirs.float32(name)
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), name


def test_an_architecture_it_does_not_know_is_named(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "alien.gguf", arch="qdiffnet")
    with pytest.raises(
        exact.UnsupportedArchitectureError, match="supports llama, gemma3, not 'qdiffnet'"
    ):
        exact.ExactModel(path)


@pytest.mark.parametrize("which", ["llama", "gemma3"])
def test_the_cpu_f16_kv_cache_emulated_explains_most_of_its_effect(
    tiny_llama: Path, tiny_gemma3: Path, which: str
) -> None:
    """llama.cpp's CPU attention with its default f16 KV cache (no flash attention): with the
    same roundings (and, on Gemma, the GELU table) the exact engine comes closer to llama.cpp's
    run than without them. Not to float32's bound: each f16 rounding of an input that lies
    within float32 noise of a rounding boundary can go the other way, and these roundings
    touch every Q, K, V and softmax weight (seen here: 2.5-5x closer, ~1e-4 left)."""
    path = tiny_llama if which == "llama" else tiny_gemma3
    gelu = which == "gemma3"

    def with_roundings(p: Path) -> exact.ExactModel:
        return exact.ExactModel(p, Roundings(gelu_table=gelu, kv_f16=True, qp_f16=True))

    def without(p: Path) -> exact.ExactModel:
        return exact.ExactModel(p, Roundings(gelu_table=gelu))

    emulated, plain = gap(path, with_roundings, kv="f16"), gap(path, without, kv="f16")
    assert emulated < plain / 2 and plain > FLOAT32_BOUND
