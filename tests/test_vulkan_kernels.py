"""The float64 engine's Vulkan switches (qdiff.exact.vulkan) against llama.cpp's Vulkan
backend on Mesa's lavapipe (f16 arithmetic, no integer dot products, no matrix cores),
from the tensors captured there (docs/results/vulkan-roundings/lavapipe; capture.py of
docs/results/cuda-roundings, on the same tiny models as the H200's):

- each matmul of layer 0 from llama.cpp's own input: bit for bit above 8 tokens (mul_mm's
  f16 operands and ordered sums), at float32's level up to 8 (matrix-vector shaders);
- attention at the last token: softmax·V from the run's own softmax weights bit for bit,
  K·Q at float32's level on most scores; flash attention at float32's level on most values;
- whole first steps: the engine with the switches within the floor of the run, and under
  half as far from it as the exact answer;
- what decides the path: ggml_vulkan's device line, recorded by a run and read by the
  budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from conftest import captured_models
from qdiff.compare.budget import combination_budget
from qdiff.core.roundings import (
    JITTER_SEEDS,
    NotEmulatedError,
    Roundings,
    plan,
    sources_of,
    vulkan_path_problem,
)
from qdiff.core.settings import DeviceSettings
from qdiff.engine.llamalog import parse_placement
from qdiff.exact import blocks, vulkan
from qdiff.exact.model import ExactModel, rms_norm, rope
from qdiff.exact.reference import emulate
from test_cuda_kernels import MORE
from test_roundings import LAYER0

LAVAPIPE = Path(__file__).parents[1] / "docs/results/vulkan-roundings/lavapipe"
LAVAPIPE_FA = LAVAPIPE.with_name("lavapipe-fa")  # capture.py's ``fa`` mode
# capture.py's default captures with integer dot products (lavapipe.sh capture OUT int)
LAVAPIPE_INT = LAVAPIPE.with_name("lavapipe-int")
LAVAPIPE_KV32 = LAVAPIPE.with_name("lavapipe-kv32")  # capture.py's kv32 and kv32-wide modes
LENGTHS = [1, 5, 12, 40]  # capture.py's prompt lengths
STARTS = [0, 7, 19, 31]  # and where its whole-model prompts start in the text
MATMULS = [*LAYER0, *MORE]  # layer 0's weight matmuls: (input, output, weight)
TARGETS = ["f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k"]
LAVAPIPE_LINE = (
    "ggml_vulkan: 0 = llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe) | uma: 0 | fp16: 1 | "
    "bf16: 0 | fp4: 0 | warp size: 8 | shared memory: 32768 | int dot: 0 | matrix cores: none"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return captured_models(tmp_path_factory.mktemp("lavapipe"), LAVAPIPE / "files.tsv")


@pytest.fixture(scope="module")
def int_dot_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return captured_models(tmp_path_factory.mktemp("lavapipe-int"), LAVAPIPE_INT / "files.tsv")


def _share_equal(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The share of values within float32's level (1e-6 of the largest) of the run's."""
    return float(np.mean(np.abs(ours - theirs) <= 1e-6 * np.abs(theirs).max()))


def _relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("target", TARGETS)
def test_each_matmul_is_mul_mm_bit_for_bit_above_8_tokens(
    files: dict[str, Path], target: str
) -> None:
    """Above 8 tokens every weight's matmul equals vulkan.linear bit for bit (f16 operands;
    f16 sums in mul_mm's order, float32 for f32 weights), which the plain product misses
    by more than 1e-4 of the output; up to 8 tokens both are at float32's level."""
    model = ExactModel(files[target])
    for n in LENGTHS:
        tensors = np.load(LAVAPIPE / f"{target}-{n}.npz")
        for source, output, weight in MATMULS:
            x = tensors[source].reshape(1, -1).astype(np.float64)
            theirs = tensors[output].reshape(1, -1).astype(np.float64)
            w, kind = model.weights[weight], model.weights.type_of(weight).lower()
            ours = vulkan.linear(x, w, n, kind)
            if n > vulkan.MAT_VEC_MAX_TOKENS:
                assert np.array_equal(ours, theirs), (target, n, output)
                assert _relative(x @ w.T, theirs) > 1e-4, (target, n, output)
            else:
                assert _relative(ours, theirs) < 1e-6, (target, n, output)


QUANTIZED = TARGETS[2:]  # the files whose matmuls integer dot products change


def int_dot_figures(model: ExactModel, target: str, n: int) -> dict[str, tuple[float, float]]:
    """Per shader (vulkan.int_dot_kernel) of the quantized matmuls of layer 0 at ``n``
    tokens on lavapipe-int: the largest |Δ| relative to the output's largest value of the
    engine's int_dot_linear and of the plain (float64) product."""
    tensors = np.load(LAVAPIPE_INT / f"{target}-{n}.npz")
    out: dict[str, tuple[float, float]] = {}
    for source, output, weight in MATMULS:
        kind = model.weights.type_of(weight).lower()
        if kind not in vulkan.INT_DOT_TYPES:
            continue
        x = tensors[source].reshape(1, -1).astype(np.float64)
        theirs = tensors[output].reshape(1, -1).astype(np.float64)
        w = model.weights[weight]
        ours = vulkan.int_dot_linear(x, w, n, model.weights, weight)
        key = f"{kind} {vulkan.int_dot_kernel(n, kind)}"
        old = out.get(key, (0.0, 0.0))
        out[key] = (max(old[0], _relative(ours, theirs)), max(old[1], _relative(x @ w.T, theirs)))
    return out


@pytest.mark.parametrize("target", QUANTIZED)
def test_with_integer_dot_products_each_quantized_matmul_takes_q8_1_activations(
    int_dot_files: dict[str, Path], target: str
) -> None:
    """On lavapipe reporting its integer dot products, every quantized weight's matmul of
    layer 0 is int_dot_linear at float32's level (within 5e-7 of the output's largest
    value; the order of its float32 sums is not followed) at 1, 5, 12 and 40 tokens,
    which the plain product misses by more than 1e-4, except q6_K up to 8 tokens (the
    float32 matrix-vector shader); each rounding it follows is needed: without the f16
    block sum, with float32 scales of the K-quants in mul_mmq, or of q6_K there, it is
    off by more than 1e-4 on some matmul."""
    model = ExactModel(int_dot_files[target])
    for n in LENGTHS:
        for key, (ours, plain) in int_dot_figures(model, target, n).items():
            assert ours < 5e-7, (n, key, ours)
            assert (plain < 1e-6) if key == "q6_k mat_vec" else (plain > 1e-4), (n, key, plain)
    # each rounding left out in turn, on Q at 40 tokens (a weight of the file's type)
    tensors = np.load(LAVAPIPE_INT / f"{target}-40.npz")
    source, output, weight = MATMULS[0]
    x = tensors[source].reshape(1, -1).astype(np.float64)
    theirs = tensors[output].reshape(1, -1).astype(np.float64)
    kind, w = model.weights.type_of(weight).lower(), model.weights[weight]
    quantize, kernel_of = vulkan.quantize_q8_1, vulkan.int_dot_kernel

    def plain_sum(v: np.ndarray) -> blocks.Q8_1:
        a = quantize(v)
        return blocks.Q8_1(a.q, a.scale, a.scale * a.q.sum(axis=-1))

    def mmvq_for_k_quants(n_tokens: int, k: str) -> str:
        return "mmvq" if k in ("q4_k", "q5_k") else kernel_of(n_tokens, k)

    left_out = []
    if kind in blocks.OFFSET_TYPES:
        left_out.append(("quantize_q8_1", plain_sum))
    if kind in ("q4_k", "q5_k"):
        left_out.append(("int_dot_kernel", mmvq_for_k_quants))
    for attribute, replacement in left_out:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(vulkan, attribute, replacement)
            assert _relative(vulkan.int_dot_linear(x, w, 40, model.weights, weight), theirs) > 1e-4
    if kind == "q6_k":
        n, scale = blocks.q6_k_integers(model.weights, weight)
        float32_scales = quantize(x).values @ (scale[..., None] * n).reshape(len(n), -1).T
        assert _relative(float32_scales, theirs) > 1e-4


def _layer0_qkv(model: ExactModel, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
    """Layer 0's Q, K and V of every position (positions, heads, d), through Vulkan's
    matmuls (the input's norm in float32, as the run computes it)."""
    w, hp, n = model.weights, model.hp, len(tokens)
    x = rms_norm(w["token_embd.weight"][tokens], w["blk.0.attn_norm.weight"], hp.eps)
    x = x.astype(np.float32).astype(np.float64)
    q, k, v = (
        vulkan.linear(
            x, w[f"blk.0.attn_{c}.weight"], n, w.type_of(f"blk.0.attn_{c}.weight").lower()
        ).reshape(n, -1, hp.head_dim)
        for c in "qkv"
    )
    positions, turn = np.arange(n, dtype=np.float64), model._rope_of(0)
    return rope(q, positions, turn), rope(k, positions, turn), v


@pytest.mark.parametrize("target", ["f32", "q8_0", "q4_k_m"])
def test_attention_rounds_q_and_the_softmax_weights_and_sums_in_f16(
    files: dict[str, Path], target: str
) -> None:
    """At the last of 5, 12 and 40 tokens (mul_mm: batched over heads): K·Q with Q in f16
    at float32's level where plain K·Q is not (ordered float32 sums), and softmax·V from
    the run's own softmax weights bit for bit by vulkan.weighted_sum, where the
    weights in f16 with exact sums miss; at 1 token, float32 (matrix-vector shaders)."""
    model = ExactModel(files[target])
    heads = model.hp.n_head
    for n in LENGTHS:
        tensors = np.load(LAVAPIPE / f"{target}-{n}.npz")
        q, k, v = _layer0_qkv(model, tensors["tokens"])
        k16, v16 = vulkan.f16(k), vulkan.f16(v)  # the f16 cache
        theirs_kq = tensors["kq-0"].reshape(heads, -1)[:, :n].astype(np.float64)
        plain_kq = np.einsum("hd,nhd->hn", q[-1], k16)
        q16_kq = np.einsum("hd,nhd->hn", vulkan.f16(q[-1]), k16)
        p = tensors["kq_soft_max-0"].reshape(heads, -1)[:, :n].astype(np.float64)
        theirs = tensors["kqv-0"].reshape(heads, -1).astype(np.float64)
        ours = vulkan.weighted_sum(vulkan.f16(p)[:, None], v16.transpose(1, 0, 2))[:, 0]
        if n == 1:
            assert _relative(plain_kq, theirs_kq) < 1e-6
            continue
        # Q is computed here within float32's error of the run's: where one of a head's
        # values lies at an f16 boundary, that head's scores all differ; most do not
        shares = [_share_equal(kq, theirs_kq) for kq in (q16_kq, plain_kq)]
        assert shares[0] >= 0.75 and shares[1] < 0.1, (target, n, shares)
        assert np.array_equal(ours, theirs), (target, n)
        exact_sums = np.einsum("hn,nhd->hd", vulkan.f16(p), v16)
        assert _relative(exact_sums, theirs) > 1e-4, (target, n)


VULKAN = Roundings(vulkan_matmul=True, kv_f16=True, vulkan_attention=True)
VULKAN_INT_DOT = dataclasses.replace(VULKAN, vulkan_int_dot=True)
VULKAN_KV32 = Roundings(vulkan_matmul=True, vulkan_attention_kv_f32=True)
KV32_TARGETS = ["f32", "q8_0", "q4_k_m"]  # the formats kept of capture.py's kv32 mode


def captured_first_steps(runs: np.lib.npyio.NpzFile, n: int) -> tuple[list[list[int]], np.ndarray]:
    """capture.py's first steps of prompts of ``n`` tokens (one from each of STARTS): the
    prompts' tokens and the run's logits, (prompts, vocabulary)."""
    prompts = [runs[f"{n}-{s}-tokens"].tolist() for s in STARTS]
    return prompts, np.stack([runs[f"{n}-{s}"] for s in STARTS]).astype(np.float64)


def run_distance(
    model: ExactModel, prompts: list[list[int]], run: np.ndarray, switches: Roundings
) -> float:
    """The median over the prompts of the run's first steps' largest |Δ| from the
    engine's with ``switches`` (left on the model)."""
    model.roundings = switches
    return float(np.median(np.abs(run - model.first_steps(prompts)).max(axis=1)))


def first_step_figures(
    model: ExactModel, prompts: list[list[int]], run: np.ndarray, switches: Roundings = VULKAN
) -> tuple[float, float, float]:
    """Medians over the prompts of the run's first steps' largest |Δ| from the exact
    answer and from the engine with Vulkan's ``switches`` (the residual), and the budget's
    floor: the larger of two jittered emulations' distances from the emulation."""
    exact = run_distance(model, prompts, run, Roundings())
    model.roundings = switches
    emulated = model.first_steps(prompts)
    jittered = []
    for seed in JITTER_SEEDS:
        model.roundings = dataclasses.replace(switches, jitter=seed)
        jittered.append(np.abs(model.first_steps(prompts) - emulated).max(axis=1))
    floor = float(np.median(np.max(jittered, axis=0)))
    return exact, float(np.median(np.abs(run - emulated).max(axis=1))), floor


@pytest.mark.parametrize("target", ["f32", "q8_0", "q4_k_m", "q6_k"])
def test_whole_first_steps_are_within_the_floor_with_the_switches(
    files: dict[str, Path], target: str
) -> None:
    """The first steps of prompts of 3, 5, 12 and 40 tokens (4 each) on lavapipe: the
    engine with Vulkan's switches is within its own jittered floor of the run (median over
    the prompts) and at most half as far as the exact answer (at 40 tokens the floor is
    0.5-0.7 of the distance for these formats); at 3 tokens (the matrix-vector shaders and
    attention's mul_mm) at float32's level but for Q4_K_M (2.97e-04, its floor 1.57e-03)."""
    runs = np.load(LAVAPIPE / f"{target}-logits.npz")
    model = ExactModel(files[target], n_ctx=256)
    model.first_step_only = True
    for n in (3, 5, 12, 40):
        prompts, run = captured_first_steps(runs, n)
        exact, residual, floor = first_step_figures(model, prompts, run)
        assert residual <= floor and 2 * residual < exact, (n, residual)
        if n == 3 and target != "q4_k_m":
            assert residual < 1e-5, residual


@pytest.mark.parametrize(("target", "at"), [("q8_0", 3), ("q4_k_m", 3), ("q6_k", 12)])
def test_whole_first_steps_with_integer_dot_products_are_within_the_floor(
    int_dot_files: dict[str, Path], target: str, at: int
) -> None:
    """The first steps on lavapipe-int: the engine with the switches of a device with
    integer dot products is within its floor of the run at 3, 5, 12 and 40 tokens (the
    floor is wide: a value moved by a float32 ulp can round to another q8_1 integer); at
    ``at`` tokens it is at float32's level where the switches of a device without them
    are more than 0.1 away."""
    runs = np.load(LAVAPIPE_INT / f"{target}-logits.npz")
    model = ExactModel(int_dot_files[target], n_ctx=256)
    model.first_step_only = True
    for n in (3, 5, 12, 40):
        prompts, run = captured_first_steps(runs, n)
        _, residual, floor = first_step_figures(model, prompts, run, VULKAN_INT_DOT)
        assert residual <= floor, (n, residual, floor)
        if n == at:
            scalar = run_distance(model, prompts, run, VULKAN)
            assert residual < 1e-5 and scalar > 0.1, (residual, scalar)


def attention_at_last_token(
    model: ExactModel, tensors: np.lib.npyio.NpzFile, n: int
) -> tuple[np.ndarray, ...]:
    """Layer 0's Q, K and V through Vulkan's matmuls, and the run's K·Q, softmax weights
    (per head, over the prompt's cells) and softmax·V at the last of ``n`` tokens."""
    heads = model.hp.n_head
    q, k, v = _layer0_qkv(model, tensors["tokens"])
    kq = tensors["kq-0"].reshape(heads, -1)[:, :n].astype(np.float64)
    p = tensors["kq_soft_max-0"].reshape(heads, -1)[:, :n].astype(np.float64)
    return q, k, v, kq, p, tensors["kqv-0"].reshape(heads, -1).astype(np.float64)


@pytest.mark.parametrize("target", KV32_TARGETS)
def test_with_an_f32_cache_attention_takes_k_and_v_in_f16_above_one_token(
    files: dict[str, Path], target: str
) -> None:
    """An f32 KV cache (lavapipe-kv32): for one token K·Q and softmax·V from the f32
    values at float32's level (matrix-vector shaders), which f16 K or V miss; above, K·Q
    with Q and K in f16 at float32's level on most scores, and softmax·V from the run's
    own softmax weights as mul_mm with f16 operands and float32 sums (bit for bit on 9 of
    the 12 and on 96.5% of values or more of the rest), where
    the ubatch reads every cell of the cache (a context of 256), but with f16 sums where it
    reads fewer (a context of 1,024, kv32-wide: V copied to f16 first), each missing the
    other's run by more than 1e-4."""
    model = ExactModel(files[target])
    for n in (1, 3, 5, 12, 40):
        q, k, v, theirs_kq, p, theirs = attention_at_last_token(
            model, np.load(LAVAPIPE_KV32 / f"{target}-kv32-{n}.npz"), n
        )
        k16, v16 = vulkan.f16(k), vulkan.f16(v)
        if n == 1:  # the matrix-vector shaders read the f32 cache as it is
            assert _relative(np.einsum("hd,nhd->hn", q[-1], k), theirs_kq) < 1e-6
            assert _relative(np.einsum("hd,nhd->hn", q[-1], k16), theirs_kq) > 1e-5
            assert _relative(np.einsum("hn,nhd->hd", p, v), theirs) < 1e-6
            assert _relative(np.einsum("hn,nhd->hd", p, v16), theirs) > 1e-5
            continue
        q16_kq = np.einsum("hd,nhd->hn", vulkan.f16(q[-1]), k16)
        shares = [_share_equal(kq, theirs_kq) for kq in (q16_kq, np.einsum("hd,nhd->hn", q[-1], k))]
        assert shares[0] >= 0.75 and shares[1] < 0.1, (n, shares)
        p16, v_cells = vulkan.f16(p)[:, None], v16.transpose(1, 0, 2)
        ours = vulkan.weighted_sum(p16, v_cells, f16_sums=False)[:, 0]
        # bit for bit but where one of V's values (computed here within float32's error of
        # the run's) lies at an f16 boundary: 96.5% of the values and more, within 2.2e-5
        assert np.mean(ours == theirs) >= 0.95 and _relative(ours, theirs) < 5e-5, n
        assert _relative(vulkan.weighted_sum(p16, v_cells)[:, 0], theirs) > 1e-4
    if target == "q4_k_m":
        return
    for n in (12, 300) if target == "f32" else (12,):
        _, _, v, _, p, theirs = attention_at_last_token(
            model, np.load(LAVAPIPE_KV32 / f"{target}-kv32-wide-{n}.npz"), n
        )
        p16, v_cells = vulkan.f16(p)[:, None], vulkan.f16(v).transpose(1, 0, 2)
        assert np.array_equal(vulkan.weighted_sum(p16, v_cells)[:, 0], theirs), n
        assert _relative(vulkan.weighted_sum(p16, v_cells, f16_sums=False)[:, 0], theirs) > 1e-4


@pytest.mark.parametrize("target", ["f32", "q8_0"])
def test_whole_first_steps_with_an_f32_cache_are_within_the_floor(
    files: dict[str, Path], target: str
) -> None:
    """The first steps with an f32 KV cache on lavapipe (a context of 256): the engine
    with the switches of an f32 cache within its floor of the run at 3, 5, 12 and 40
    tokens, at 3 at float32's level where those of an f16 cache are more than 1e-3 away;
    in a context of 1,024 the same prompt's softmax·V sums in f16 (the engine reads the
    context: its first step differs)."""
    runs = np.load(LAVAPIPE_KV32 / f"{target}-logits-kv32.npz")
    model = ExactModel(files[target], n_ctx=256)
    model.first_step_only = True
    for n in (3, 5, 12, 40):
        prompts, run = captured_first_steps(runs, n)
        _, residual, floor = first_step_figures(model, prompts, run, VULKAN_KV32)
        assert residual <= floor, (n, residual, floor)
        if n == 3:
            f16_cache = run_distance(model, prompts, run, VULKAN)
            assert residual < 1e-5 and f16_cache > 1e-3, (residual, f16_cache)
    prompts, _ = captured_first_steps(runs, 12)
    model.roundings = VULKAN_KV32
    in_256 = model.first_steps(prompts)
    wide = ExactModel(files[target], n_ctx=1024, roundings=VULKAN_KV32)
    wide.first_step_only = True
    assert np.abs(wide.first_steps(prompts) - in_256).max() > 1e-6


FLASH_LENGTHS = [1, 2, 5, 12, 40, 300]  # capture.py's FA_LAYER0


def flash_shares(model: ExactModel, target: str, n: int) -> tuple[float, float, tuple[int, int]]:
    """At the last of ``n`` tokens in one ubatch (lavapipe-fa): the shares of flash
    attention's output at float32's level of the run's, by vulkan.flash_attention and by
    plain softmax attention over the f16 cache, and the (tile, split) it took."""
    hp = model.hp
    tensors = np.load(LAVAPIPE_FA / f"{target}-fa-{n}.npz")
    q, k, v = _layer0_qkv(model, tensors["tokens"])
    k16, v16 = vulkan.f16(k), vulkan.f16(v)
    theirs = tensors["FLASH_ATTN_EXT (unnamed)"].reshape(hp.n_head, -1).astype(np.float64)
    n_kv = -(-n // 256) * 256
    tile, split = vulkan.flash_split(n, n_kv, hp.n_head, hp.n_head_kv, hp.head_dim)
    ours = vulkan.flash_attention(
        q[-1:], k16, v16, np.zeros((1, n), bool), hp.attn_scale, 0.0, (tile, split, n_kv)
    )[0]
    weights = np.exp(np.einsum("hd,nhd->hn", q[-1], k16) * hp.attn_scale)
    plain = np.einsum("hn,nhd->hd", weights / weights.sum(axis=1, keepdims=True), v16)
    return _share_equal(ours, theirs), _share_equal(plain, theirs), (tile, split)


@pytest.mark.parametrize("target", ["f32", "q8_0", "q4_k_m"])
def test_flash_attention_follows_the_scalar_shader(files: dict[str, Path], target: str) -> None:
    """Flash attention's output at the last of 1, 2, 5, 12, 40 and 300 tokens in one
    ubatch: vulkan.flash_attention (f16 Q, softmax weights and output, the cells' split by
    flash_split) at float32's level on most values; plain softmax attention over the f16
    cache on almost none beyond one token (where it is the one cell's V)."""
    model = ExactModel(files[target])
    for n in FLASH_LENGTHS:
        ours, plain, _ = flash_shares(model, target, n)
        assert ours >= 0.75, (target, n)
        assert n == 1 or plain < 0.1, (target, n)


@pytest.mark.parametrize("target", ["f32", "q8_0"])
def test_whole_first_steps_with_flash_attention_are_within_the_floor(
    files: dict[str, Path], target: str
) -> None:
    """First steps of 3, 5, 12 and 40 tokens with flash attention, in one ubatch and in
    one-token ubatches: the engine with vulkan_flash within its floor of the run and at
    most half as far as the exact answer."""
    model = ExactModel(files[target], n_ctx=256)
    model.first_step_only = True
    for name, n_ubatch in (("fa", 512), ("fa-ub1", 1)):
        runs = np.load(LAVAPIPE_FA / f"{target}-logits-{name}.npz")
        switches = Roundings(vulkan_matmul=True, kv_f16=True, vulkan_flash=True, n_ubatch=n_ubatch)
        for n in (3, 5, 12, 40):
            prompts, run = captured_first_steps(runs, n)
            exact, residual, floor = first_step_figures(model, prompts, run, switches)
            assert residual <= floor and 2 * residual < exact, (name, n, residual)


def test_flash_splits_the_cells_as_ggml_vulkan_on_this_device() -> None:
    """(cells of a tile, cells of a split) by ubatch size and heads: SmolLM2's 9 heads
    over 3 KV heads take grouped rows up to 8 tokens (one token: 8 splits of 32 cells; two:
    4 of 64), none above; the tiny models' 4 heads split by workgroups (5 tokens: 64 cells,
    12: 128, 40: none); a sparse or a shared-memory-bound layout, and the layouts of heads
    not checked on a capture, are not followed."""
    assert vulkan.flash_split(1, 256, 9, 3, 64) == (32, 32)
    assert vulkan.flash_split(2, 256, 9, 3, 64) == (32, 64)
    assert vulkan.flash_split(20, 256, 9, 3, 64) == (32, 256)
    assert vulkan.flash_split(1, 256, 4, 4, 64) == (64, 64)
    assert vulkan.flash_split(5, 256, 4, 4, 64) == (32, 64)
    assert vulkan.flash_split(12, 256, 4, 4, 64) == (32, 128)
    assert vulkan.flash_split(40, 256, 4, 4, 64) == (32, 256)
    with pytest.raises(NotEmulatedError, match="sparse"):
        vulkan.flash_split(1, 4096, 9, 3, 64)
    with pytest.raises(NotEmulatedError, match="1024 KV cells"):
        vulkan.flash_split(20, 1024, 9, 3, 64)
    # Gemma 3 270M's one token: its 4 query heads over one KV head make 4 rows of 256
    for n_tokens, n_head_kv, head_dim in ((1, 1, 256), (20, 4, 128), (1, 4, 80)):
        with pytest.raises(NotEmulatedError, match=f"a head of {head_dim}"):
            vulkan.flash_split(n_tokens, 256, 4, n_head_kv, head_dim)
    assert vulkan.flash_split(1, 256, 8, 8, 128) == (64, 64)


def test_a_run_records_its_vulkan_device_and_the_budget_reads_its_path() -> None:
    """ggml_vulkan's device line becomes the run's ``vulkan_devices``; a budget is made
    only for a device whose line reads as lavapipe's, with integer dot products or without:
    another's (matrix cores) or none recorded is "not emulated", saying why, as is an
    NVIDIA, AMD or Intel device with integer dot products in one-token ubatches (their
    one-token rule is not followed)."""
    placement = parse_placement(LAVAPIPE_LINE + "\nggml_vulkan: Found 1 Vulkan devices:\n")
    (device,) = placement.vulkan_devices
    assert device["device"] == "Vulkan0" and device["matrix cores"] == "none"
    assert device["name"] == "llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe)"
    used = [{"name": "Vulkan0"}]
    assert vulkan_path_problem({"used_devices": used, "vulkan_devices": [device]}) is None
    int_dot = {"used_devices": used, "vulkan_devices": [device | {"int dot": "1"}]}
    assert vulkan_path_problem(int_dot) is None and vulkan_path_problem(int_dot, 1) is None
    h200 = device | {"name": "NVIDIA H200", "int dot": "1", "matrix cores": "NV_coopmat2"}
    why = vulkan_path_problem({"used_devices": used, "vulkan_devices": [h200]})
    assert why is not None and "matrix cores: NV_coopmat2" in why
    rdna2 = device | {"name": "AMD Radeon RX 6800 (RADV NAVI21)", "int dot": "1"}
    rdna2_run = {"used_devices": used, "vulkan_devices": [rdna2]}
    assert vulkan_path_problem(rdna2_run) is None
    assert "one-token matmuls" in str(vulkan_path_problem(rdna2_run, 1))
    assert "did not record" in str(vulkan_path_problem({"used_devices": used}))
    settings = DeviceSettings(backend="vulkan").as_dict()
    record = {
        "settings": settings,
        "dequant": "none",
        "prompts": [{"id": "p", "prompt_tokens": [1, 2]}],
        "provenance": {"used_devices": used, "vulkan_devices": [h200]},
    }
    row = combination_budget(
        record, np.zeros((1, 4)), None, ({"status": "ok"}, {}), np.zeros((1, 4))
    )
    assert row["status"] == "n/a" and "NV_coopmat2" in row["reason"]


def test_vulkan_sources_are_its_matmuls_cache_and_attention() -> None:
    """A Vulkan combination's sources (flash attention in place of attention where it is
    on); the f32 copy's matmuls all of f32; with an f32 cache, attention as it reads that
    cache and no f16 K/V (flash attention then not emulated yet, by name); on a
    device with integer dot products the quantized file's matmuls take q8_1 activations,
    planned beside the others (the device is known from the run's record only), and the
    budget takes the set of the device its run recorded."""
    sources = sources_of(DeviceSettings(backend="vulkan").as_dict(), "none")
    assert set(sources) == {"vulkan_matmul", "kv_f16", "vulkan_attention"}
    assert not sources["vulkan_matmul"].f32_copy
    assert sources_of(DeviceSettings(backend="vulkan").as_dict(), "f32")["vulkan_matmul"].f32_copy
    flash = sources_of(DeviceSettings(backend="vulkan", flash_attn=True).as_dict(), "none")
    assert set(flash) == {"vulkan_matmul", "kv_f16", "vulkan_flash"}
    kv32 = sources_of(DeviceSettings(backend="vulkan", kv_cache_type="f32").as_dict(), "none")
    assert set(kv32) == {"vulkan_matmul", "vulkan_attention_kv_f32"}
    with pytest.raises(NotEmulatedError, match="flash attention with an f32 KV cache"):
        settings = DeviceSettings(backend="vulkan", kv_cache_type="f32", flash_attn=True)
        sources_of(settings.as_dict(), "none")
    int_dot = sources_of(DeviceSettings(backend="vulkan").as_dict(), "none", int_dot=True)
    assert set(int_dot) == {"vulkan_int_dot", "kv_f16", "vulkan_attention"}
    assert int_dot["vulkan_int_dot"].vulkan_matmul and int_dot["vulkan_int_dot"].vulkan_int_dot
    vk = DeviceSettings(backend="vulkan").as_dict()
    configs, entries = plan({"vulkan.none": (vk, "none"), "vulkan.f32": (vk, "f32")})
    assert "sources" in entries["vulkan.none"] and "int_dot" not in entries["vulkan.f32"]
    alternative = entries["vulkan.none"]["int_dot"]
    assert configs[alternative["together"]]["vulkan_int_dot"]
    assert not configs[entries["vulkan.none"]["together"]]["vulkan_int_dot"]
    # only the int-dot device's sets computed: its run gets a budget, the other's does not
    computed = {
        c: np.zeros((1, 4))
        for c in [
            *alternative["sources"].values(),
            alternative["together"],
            *alternative["jittered"],
        ]
    }
    emulation = {"status": "ok", "prompt_ids": ["p"], "applies": dict.fromkeys(configs, True)}
    for int_dot_device in ("0", "1"):
        record = {
            "settings": vk,
            "dequant": "none",
            "prompts": [{"id": "p", "prompt_tokens": [1, 2]}],
            "provenance": {
                "used_devices": [{"name": "Vulkan0"}],
                "vulkan_devices": [_lavapipe_device() | {"int dot": int_dot_device}],
            },
        }
        row = combination_budget(
            record, np.zeros((1, 4)), None, (emulation, computed), np.zeros((1, 4))
        )
        assert (row["status"] == "n/a") == (int_dot_device == "0"), row


def _lavapipe_device() -> dict[str, str]:
    (device,) = parse_placement(LAVAPIPE_LINE + "\n").vulkan_devices
    return device


def test_every_vulkan_source_is_computed_for_a_model(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """emulate computes each of a Vulkan combination's sources, for a device with integer
    dot products too (none is taken for one that cannot change the model), and each moves
    the first step of a 12-token prompt; it says how far it has come."""
    combos = {
        f"vulkan.{d}": (DeviceSettings(backend="vulkan").as_dict(), d) for d in ("none", "f32")
    }
    configs, entries = plan(combos)
    prompts = [{"id": "p", "prompt_tokens": list(range(3, 15))}]
    record, arrays = emulate(
        files["q8_0"], {"generation": {"n_ctx": 64}, "prompts": prompts}, configs
    )
    assert all(record["applies"].values()), record["applies"]
    said = capsys.readouterr().err  # a line per set, for a user watching the job's log
    assert f"[qdiff] roundings {len(configs)}/{len(configs)}: " in said
    exact = ExactModel(files["q8_0"], n_ctx=64)
    exact.first_step_only = True
    plain = exact.first_steps([prompts[0]["prompt_tokens"]])
    int_dot = entries["vulkan.none"]["int_dot"]["sources"]["vulkan_int_dot"]
    for entry in [*entries.values(), entries["vulkan.none"]["int_dot"]]:
        for name, config in entry["sources"].items():
            assert np.abs(arrays[config] - plain).max() > 1e-6, name
    # the q8_1 activations move it beyond the f16 operands of mul_mm alone
    scalar = entries["vulkan.none"]["sources"]["vulkan_matmul"]
    assert np.abs(arrays[int_dot] - arrays[scalar]).max() > 1e-3


def test_round_to_f16_is_numpys_conversion_to_f16_and_back() -> None:
    """The integer rounding of vulkan.round_to_f16 gives what a conversion to f16 gives,
    for normal values, ties, f16's subnormals and zeros of both signs."""
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(100_000) * 10.0 ** rng.uniform(-9, 4, 100_000),
            (np.arange(-4096, 4096) + 0.5) * 2.0**-10,  # ties at f16's spacing near 1
            (np.arange(-2048, 2048) + 0.5) * 2.0**-24,  # ties among f16's subnormals
            [0.0, -0.0, 2.0**-14, -(2.0**-14), 65504.0],
        ]
    ).astype(np.float32)
    ours = values.copy()
    vulkan.round_to_f16(ours)
    expected = values.astype(np.float16).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))
