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
Every architecture of the engine's table has a tiny model here (tinymodel.VARIANTS), written
as its converter writes it, and a deliberately wrong engine for what sets it apart (RoPE
pairs, base or factors, a missing bias or norm, a soft-cap, the sliding window) must exceed
the float32 bound tenfold.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import REPO, in_child, quantize_in_child
from qdiff import exact
from qdiff.core.roundings import Roundings
from qdiff.core.settings import DeviceSettings
from qdiff.engine.log import init_backend
from qdiff.engine.model import LoadedModel
from qdiff.exact import dequantize
from qdiff.exact.reference import Workload, memory_needed
from qdiff.exact.stage import ExactInputs, memory_plan
from tinymodel import SOFTCAPS, VARIANTS, Variant, write_tiny_llama, write_tiny_model, write_variant

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


N_CTX = 256  # the context llama_cpp_logits gives llama.cpp (past the tiny phi3's LongRoPE)


def exact_model(path: Path, roundings: Roundings | None = None) -> exact.ExactModel:
    """The engine for a file, with the context llama.cpp ran it in; on Gemma, with the GELU
    table emulated unless ``roundings`` say otherwise."""
    model = exact.ExactModel(path, n_ctx=N_CTX)
    if roundings is None:
        roundings = Roundings(gelu_table=model.hp.arch.activation == "gelu")
    model.roundings = roundings
    return model


def gap(
    path: Path,
    make: Callable[[Path], exact.ExactModel] = exact_model,
    kv: str = "f32",
    **settings: Any,
) -> float:
    """The largest |exact - llama.cpp| over the forced positions, relative to the scale."""
    prompt, forced, reference = llama_cpp_logits(path, kv=kv, **settings)
    ours = make(path).forward(prompt + forced[:-1], slice(len(prompt) - 1, None))
    return float(np.abs(ours - reference).max() / np.abs(ours).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A tiny model of each of tinymodel.VARIANTS, written once."""
    folder = tmp_path_factory.mktemp("exact")
    return functools.cache(lambda name: write_variant(folder / f"{name}.gguf", name))


@pytest.fixture(scope="module")
def tiny_llama(tiny: Callable[[str], Path]) -> Path:
    return tiny("llama")


@pytest.fixture(scope="module")
def tiny_gemma3(tiny: Callable[[str], Path]) -> Path:
    return tiny("gemma3")


def test_every_architecture_of_the_engine_has_a_tiny_model() -> None:
    assert {v.arch for v in VARIANTS.values()} == set(exact.ARCHITECTURES)


@pytest.mark.parametrize("name", VARIANTS)
def test_each_architecture_agrees_with_llama_cpp_to_float32_rounding(
    tiny: Callable[[str], Path], name: str
) -> None:
    """On a GELU model, with llama.cpp's fp16 GELU table emulated: without it the gap is
    the table's (above the float32 bound, below GELU_TABLE_BOUND)."""
    path = tiny(name)
    assert gap(path) < FLOAT32_BOUND
    model = exact_model(path)
    model.forward([1, 5, 9], slice(-1, None))
    assert model.hp.unread_keys == () and model.weights.unread() == []  # it read them all
    if exact_model(path).hp.arch.activation == "gelu":
        assert FLOAT32_BOUND < gap(path, lambda p: exact_model(p, Roundings())) < GELU_TABLE_BOUND


def test_the_hyperparameters_each_architecture_reads(tiny: Callable[[str], Path]) -> None:
    """What the tiny files name, and llama.cpp's defaults where they name nothing."""
    gemma3, gemma2, phi3 = (exact_model(tiny(n)).hp for n in ("gemma3", "gemma2", "phi3"))
    assert gemma3.swa_layers == (True, False, True)
    assert gemma3.rope(0) == (10000.0, 1.0) and gemma3.rope(1) == (1e6, 1.0)
    assert exact_model(tiny("gemma3-4b")).hp.rope(1) == (1e6, 1 / 8)
    assert gemma2.swa_layers == (True, False) and gemma2.rope(0) == gemma2.rope(1) == (1e6, 1.0)
    assert (gemma2.attn_softcap, gemma2.softcap) == SOFTCAPS
    assert phi3.rope_factors == "rope_factors_long.weight" and phi3.n_swa == 0
    assert exact.ExactModel(tiny("phi3")).hp.rope_factors == "rope_factors_short.weight"
    assert exact_model(tiny("llama3")).hp.rope_factors == "rope_freqs.weight"


def test_gemma2s_defaults_and_its_27b_attention_scale(tmp_path: Path) -> None:
    """llama.cpp's gemma2 defaults (soft-caps 50 and 30, a window of 4096) where the file
    names none, and the 27B's Q scale 1/sqrt(n_embd/n_head) read off its 46 layers."""
    plain = Variant("gemma2", n_layer=46, tied_output=True, post_norms=True)
    path = write_tiny_model(tmp_path / "g.gguf", "gemma2", n_embd=64, n_layer=46, variant=plain)
    hp = exact.ExactModel(path).hp
    assert (hp.attn_softcap, hp.softcap, hp.n_swa) == (50.0, 30.0, 4096)
    assert hp.attn_scale == pytest.approx(1 / np.sqrt(64 / 4)) and hp.head_dim == 16
    small = write_tiny_model(tmp_path / "s.gguf", "gemma2", n_embd=64, variant=plain)
    assert exact.ExactModel(small).hp.attn_scale == pytest.approx(1 / np.sqrt(16))


def _wrong(
    changes: dict[str, Any] | None = None, **arch: Any
) -> Callable[[Path], exact.ExactModel]:
    """The engine with some of its hyperparameters (or its architecture's entry) wrong."""

    def make(path: Path) -> exact.ExactModel:
        model = exact_model(path)
        hp = model.hp
        model.hp = dataclasses.replace(
            hp, **(changes or {}), arch=dataclasses.replace(hp.arch, **arch)
        )
        return model

    return make


def _without_biases(path: Path) -> exact.ExactModel:
    model = exact_model(path)
    for name in [n for n in model.weights.names() if n.endswith(".bias")]:
        del model.weights._tensors[name]
    return model


@pytest.mark.parametrize(
    ("name", "make"),
    [
        pytest.param("llama", _wrong(neox_rope=True), id="llama: NEOX RoPE pairs"),
        pytest.param("llama", _wrong({"rope_base": 1e6}), id="llama: RoPE base 1e6"),
        pytest.param("llama3", _wrong({"rope_factors": ""}), id="llama 3: rope_freqs ignored"),
        pytest.param("qwen2", _without_biases, id="qwen2: no Q/K/V biases"),
        pytest.param("qwen2", _wrong(neox_rope=False), id="qwen2: adjacent RoPE pairs"),
        pytest.param("qwen3", _wrong(qk_norm=False), id="qwen3: no Q/K norms"),
        pytest.param("gemma2", _wrong({"attn_softcap": 0.0}), id="gemma2: no attention soft-cap"),
        pytest.param("gemma2", _wrong({"softcap": 0.0}), id="gemma2: no final soft-cap"),
        # Gemma 3's default for the local layers, not Gemma 2's (the global base)
        pytest.param("gemma2", _wrong({"rope_base_swa": 1e4}), id="gemma2: local RoPE base 1e4"),
        pytest.param("gemma2", _wrong({"swa_layers": (False,) * 2}), id="gemma2: no window"),
        # llama.cpp's default for the local layers is 1e4, not the file's global base
        pytest.param("gemma3", _wrong({"rope_base_swa": 1e6}), id="gemma3: local RoPE base 1e6"),
        pytest.param("gemma3", _wrong({"swa_layers": (False,) * 3}), id="gemma3: no window"),
        pytest.param("gemma3", _wrong(post_norms=False), id="gemma3: no post-norms"),
        pytest.param(
            "gemma3-4b", _wrong({"rope_scale": 1.0}), id="gemma3 4B: global layers unscaled"
        ),
        pytest.param(
            "gemma3-4b", _wrong({"rope_scale_swa": 1 / 8}), id="gemma3 4B: local layers scaled"
        ),
        pytest.param(
            "phi3",
            _wrong({"rope_factors": "rope_factors_short.weight"}),
            id="phi3: short LongRoPE factors for a long context",
        ),
        pytest.param("phi3", _wrong({"rope_attn_factor": 1.0}), id="phi3: no attention factor"),
        # phi3.cpp: "Phi SWA is currently disabled"
        pytest.param(
            "phi3", _wrong({"n_swa": 8, "swa_layers": (True,) * 2}), id="phi3: window applied"
        ),
    ],
)
def test_a_wrong_engine_fails(
    tiny: Callable[[str], Path], name: str, make: Callable[[Path], exact.ExactModel]
) -> None:
    assert gap(tiny(name), make) > 10 * FLOAT32_BOUND


@pytest.mark.parametrize("target", ["q8_0", "q4_1", "q5_0", "q4_k_m", "q6_k"])
def test_dequantization_matches_llama_cpp_bit_for_bit(
    tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's dequantization (ggml's to_float) against the f32 copy
    llama_model_quantize writes (the same to_float: the loader's reading of the file) and
    against gguf-py's numpy dequantizers (an implementation of its own), for every weight
    type of the shipped models (K-quants need rows of 256)."""
    import gguf

    source = write_tiny_llama(tmp_path / "f32.gguf", n_embd=256, n_ff=512)
    quantized, copy = tmp_path / f"{target}.gguf", tmp_path / f"{target}.f32.gguf"
    quantize_in_child(source, quantized, target)
    quantize_in_child(quantized, copy, "f32")
    ours, theirs = exact.Weights(quantized), exact.Weights(copy)
    types = ours.types()
    assert set(types) - {"f32"}, types  # something was quantized
    for t in gguf.GGUFReader(quantized).tensors:
        name = t.name
        a, b = ours.float32(name), theirs.float32(name)
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), name
        numpy_version = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        assert a.shape == numpy_version.shape and a.tobytes() == numpy_version.tobytes(), name
        # the float64 copy the engine keeps, converted a few rows at a time
        monkeypatch.setattr("qdiff.exact.model.DEQUANTIZE_VALUES", 3 * a.shape[-1] + 1)
        assert np.array_equal(ours.float64(name), a.astype(np.float64)), name


def test_dequantizing_refuses_data_that_does_not_hold_the_values() -> None:
    """ggml reads whole blocks (Q8_0: 34 bytes, 32 values): two rows of one block each
    dequantize to 32 values a row; asked for 64, or for 48, it refuses before anything is
    read, rather than read past the data."""
    Q8_0 = 8  # ggml_type
    rows = np.zeros((2, 34), dtype=np.uint8)
    rows[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1
    rows[:, 2:] = np.arange(32, dtype=np.int8).view(np.uint8)
    assert np.array_equal(dequantize.float32(rows, Q8_0, 32), np.tile(np.arange(32.0), (2, 1)))
    for wrong in (64, 48):
        with pytest.raises(ValueError, match="do not hold"):
            dequantize.float32(rows, Q8_0, wrong)
    with pytest.raises(ValueError, match="does not know tensor type 99"):
        dequantize.float32(rows, 99, 32)  # past ggml's table: refused, not read


def test_an_architecture_it_does_not_know_is_named(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "alien.gguf", arch="qdiffnet")
    with pytest.raises(
        exact.UnsupportedArchitectureError,
        match=f"supports {', '.join(exact.ARCHITECTURES)}, not 'qdiffnet'",
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


def test_the_readme_names_the_architectures_of_the_table() -> None:
    text = " ".join((REPO / "README.md").read_text().split())
    sentence = re.search(r"The exact reference follows the architectures (.*?), read from", text)
    assert sentence is not None
    assert re.findall(r"`(\w+)`", sentence.group(1)) == list(exact.ARCHITECTURES)


def test_layer_by_layer_is_the_same_arithmetic_in_less_memory(
    tiny: Callable[[str], Path],
) -> None:
    """Every sequence through a layer before the next, that layer's float64 weights then
    dropped: bit for bit what keeping them gives, and a smaller estimate."""
    path = tiny("qwen2")
    sequences = [[1, 5, 9, 20, 33], [1, 7, 7]]
    kept, by_layer = (exact.ExactModel(path, layer_by_layer=s) for s in (False, True))
    for a, b in zip(kept.hidden(sequences), by_layer.hidden(sequences), strict=True):
        assert np.array_equal(a, b)
    assert not any(name.startswith("blk.") for name in by_layer.weights._cache)
    work = Workload(logit_rows=1, longest=5, tokens=8)
    assert memory_needed(path, work, layer_by_layer=True) < memory_needed(path, work)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("batch_tokens", [512, 8])
def test_sequences_batched_through_a_layer_are_computed_as_each_alone(
    tiny: Callable[[str], Path], name: str, batch_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences share a layer's products but never attend across each other: each comes
    out as it does alone (to float64 rounding: the products' shapes differ), in order, all
    in one batch or across several, with and without flash attention's one-row path (the
    70-token sequence's last ubatch of 6 rows takes it, its first 64 rows do not)."""
    monkeypatch.setattr("qdiff.exact.model.BATCH_TOKENS", batch_tokens)
    model = exact.ExactModel(tiny(name))
    long = [(7 * i) % 200 + 1 for i in range(70)]
    sequences = [[1, 5, 9, 20, 33], [1, 7, 7], long, [2, 4, 6, 8, 10, 12, 14]]
    flash = Roundings(kv_f16=True, flash_cpu=True, n_ubatch=64)
    results = {}
    for roundings in (Roundings(), flash):
        model.roundings = roundings
        together = model.hidden(sequences)
        for seq, batched in zip(sequences, together, strict=True):
            assert np.allclose(batched, model.hidden([seq])[0], rtol=1e-11, atol=1e-12)
        results[roundings] = together
    for i in (1, 2):
        assert not np.allclose(results[Roundings()][i], results[flash][i], rtol=1e-6)


def test_batches_keep_the_order_and_hold_at_most_batch_tokens() -> None:
    from qdiff.exact.model import BATCH_TOKENS, _batches

    assert BATCH_TOKENS == 512
    assert _batches([300, 300, 100, 600, 5]) == [[0], [1, 2], [3], [4]]
    assert _batches([10] * 60) == [list(range(51)), list(range(51, 60))]
    assert _batches([]) == []
    assert _batches([0, 3]) == [[0, 1]]


def test_the_reference_holds_one_layer_at_a_time_and_the_emulations_keep_what_fits(
    tiny: Callable[[str], Path],
) -> None:
    """The reference reads each weight once, so it holds one layer's weights whatever the
    memory; the emulations read them once per set of roundings, so they keep them all where
    that fits, and go layer by layer only where it does not."""
    path = tiny("llama")
    run = {"prompts": [{"prompt_tokens": [1, 5, 9], "tokens": [20, 33]}]}
    plain = ExactInputs(model=path, info={}, run=run, forced_data=None, forced=None, top_k=4)
    emulating = dataclasses.replace(plain, configs={"kv_f16": {"kv_f16": True}})
    kept = memory_needed(path, emulating.workload())
    assert memory_plan(plain, max_memory_gib=64) == (
        memory_needed(path, plain.workload(), layer_by_layer=True),
        True,
    )
    assert memory_plan(emulating, max_memory_gib=64) == (kept, False)
    assert memory_plan(emulating, max_memory_gib=(kept - 1) / 2**30)[1] is True


def test_what_the_engine_does_not_read_is_named(tmp_path: Path) -> None:
    """A file with what no entry of the table follows (a MoE file's expert count and
    router): the engine names the key and the tensor its answer leaves out."""
    path = write_tiny_model(tmp_path / "moe.gguf", "llama", variant=Variant("llama", router=True))
    model = exact.ExactModel(path)
    model.forward([1, 5, 9], slice(-1, None))
    assert model.hp.unread_keys == ("llama.expert_count",)
    assert model.weights.unread() == ["blk.*.ffn_gate_inp.weight"]


def _peak_of_a_forward(path: Path, tokens: list[int]) -> int:
    """The child's peak resident memory over one forward pass, in bytes: the high-water
    mark is reset once the model is loaded (writing 5 to /proc/self/clear_refs), so an
    earlier transient peak (imports, the reader) does not hide the pass's."""
    model = exact.ExactModel(path)
    Path("/proc/self/clear_refs").write_text("5")
    model.forward(tokens, slice(-1, None))
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def test_the_memory_estimate_covers_a_long_sequences_activations(
    tiny: Callable[[str], Path],
) -> None:
    """4,000 tokens through 4 heads: the activations grow the child's peak by about 110 MiB
    over a 16-token sequence's (the full (heads, n, n) scores alone would be 512 MB; the
    engine takes a block of queries at a time). The estimate holds the peak, and its
    growth with the length is at least the measured one and at most twice it."""
    work, peak = {}, {}
    for n in (16, 4000):
        tokens = [1] + [5 + i % 300 for i in range(n - 1)]
        peak[n] = in_child(_peak_of_a_forward, tiny("llama"), tokens)
        work[n] = memory_needed(tiny("llama"), Workload(1, n, n))
        assert peak[n] <= work[n], (n, peak[n], work[n])
    grown, estimated = peak[4000] - peak[16], work[4000] - work[16]
    assert grown < 2**28 and grown <= estimated <= 2 * grown, (grown, estimated)


@pytest.mark.parametrize(
    "variant",
    [
        # llama.cpp reads soft-caps for Gemma alone: on a llama they are keys it ignores
        pytest.param(Variant("llama", softcaps=True), id="llama with soft-cap keys"),
        # qwen2.cpp adds output.bias whether the output is its own or the embeddings
        pytest.param(
            Variant("qwen2", qkv_bias=True, tied_output=True, output_bias=True),
            id="qwen2, tied, with an output bias",
        ),
        # a fused attn_qkv with separate Q/K/V biases (llama-model.cpp loads and adds them)
        pytest.param(
            Variant("phi3", fused_qkv=True, fused_gate_up=True, qkv_bias=True),
            id="phi3, fused QKV with separate biases",
        ),
    ],
)
def test_rarer_files_agree_with_llama_cpp(tmp_path: Path, variant: Variant) -> None:
    path = write_tiny_model(tmp_path / "rare.gguf", variant.arch, variant=variant)
    assert gap(path) < FLOAT32_BOUND
    model = exact_model(path)
    model.forward([1, 5, 9], slice(-1, None))
    assert model.weights.unread() == []
    ignored = ("llama.attn_logit_softcapping", "llama.final_logit_softcapping")
    assert model.hp.unread_keys == (ignored if variant.softcaps else ())


@pytest.mark.parametrize("n", [1, 127, 128, 129, 300])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("rounded", [False, True])
def test_attention_by_blocks_of_queries_is_the_whole_matrixs(
    n: int, window: int | None, rounded: bool
) -> None:
    """The engine's attention, block by block of queries over the keys they see, against
    softmax over the whole (heads, n, n) matrix of scores: causal and sliding-window masks,
    across the blocks' edges, with the weights rounded to f16 or not."""
    from qdiff.exact.model import _softmax_attention
    from qdiff.exact.roundings import Scores, f16

    rng = np.random.default_rng(n)
    q, k, v = (rng.normal(size=(n, 3, 8)) for _ in range(3))
    positions = np.arange(n)
    masked = positions[None, :] > positions[:, None]
    if window:
        masked |= positions[None, :] <= positions[:, None] - window
    how = Scores(0.3, 5.0)
    scores = how(q.transpose(1, 0, 2) @ k.transpose(1, 2, 0))
    scores[:, masked] = -np.inf
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if rounded:
        probs = f16(probs)
    whole = (probs @ v.transpose(1, 0, 2)).transpose(1, 0, 2)
    weighted_sum = (lambda p, values: f16(p) @ values) if rounded else np.matmul
    blocks = _softmax_attention(q, k, v, masked, how, weighted_sum)
    np.testing.assert_allclose(blocks, whole, rtol=0, atol=1e-3 if rounded else 1e-14)
