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
from qdiff.exact import vulkan
from qdiff.exact.model import ExactModel, rms_norm, rope
from qdiff.exact.reference import emulate
from test_cuda_kernels import MORE
from test_roundings import LAYER0

LAVAPIPE = Path(__file__).parents[1] / "docs/results/vulkan-roundings/lavapipe"
LAVAPIPE_FA = LAVAPIPE.with_name("lavapipe-fa")  # capture.py's ``fa`` mode
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
    the run's own softmax weights bit for bit by vulkan.f16_weighted_sum, where the
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
        ours = vulkan.f16_weighted_sum(vulkan.f16(p)[:, None], v16.transpose(1, 0, 2))[:, 0]
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


def first_step_figures(
    model: ExactModel, prompts: list[list[int]], run: np.ndarray, switches: Roundings = VULKAN
) -> tuple[float, float, float]:
    """Medians over the prompts of the run's first steps' largest |Δ| from the exact
    answer and from the engine with Vulkan's ``switches`` (the residual), and the budget's
    floor: the larger of two jittered emulations' distances from the emulation."""
    model.roundings = Roundings()
    exact = model.first_steps(prompts)
    model.roundings = switches
    emulated = model.first_steps(prompts)
    jittered = []
    for seed in JITTER_SEEDS:
        model.roundings = dataclasses.replace(switches, jitter=seed)
        jittered.append(np.abs(model.first_steps(prompts) - emulated).max(axis=1))
    floor = float(np.median(np.max(jittered, axis=0)))
    return (
        float(np.median(np.abs(run - exact).max(axis=1))),
        float(np.median(np.abs(run - emulated).max(axis=1))),
        floor,
    )


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
        prompts = [runs[f"{n}-{s}-tokens"].tolist() for s in STARTS]
        run = np.stack([runs[f"{n}-{s}"] for s in STARTS]).astype(np.float64)
        exact, residual, floor = first_step_figures(model, prompts, run)
        assert residual <= floor and 2 * residual < exact, (n, residual)
        if n == 3 and target != "q4_k_m":
            assert residual < 1e-5, residual


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
            prompts = [runs[f"{n}-{s}-tokens"].tolist() for s in STARTS]
            run = np.stack([runs[f"{n}-{s}"] for s in STARTS]).astype(np.float64)
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
    only for a device whose line reads as lavapipe's: another's (matrix cores, integer dot
    products) or none recorded is "not emulated", saying why."""
    placement = parse_placement(LAVAPIPE_LINE + "\nggml_vulkan: Found 1 Vulkan devices:\n")
    (device,) = placement.vulkan_devices
    assert device["device"] == "Vulkan0" and device["matrix cores"] == "none"
    assert device["name"] == "llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe)"
    used = [{"name": "Vulkan0"}]
    assert vulkan_path_problem({"used_devices": used, "vulkan_devices": [device]}) is None
    h200 = device | {"name": "NVIDIA H200", "int dot": "1", "matrix cores": "NV_coopmat2"}
    why = vulkan_path_problem({"used_devices": used, "vulkan_devices": [h200]})
    assert why is not None and "NV_coopmat2" in why and "int dot: 1" in why
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
    on); the f32 copy's matmuls all of f32; an f32 cache not emulated (yet), by name."""
    sources = sources_of(DeviceSettings(backend="vulkan").as_dict(), "none")
    assert set(sources) == {"vulkan_matmul", "kv_f16", "vulkan_attention"}
    assert not sources["vulkan_matmul"].f32_copy
    assert sources_of(DeviceSettings(backend="vulkan").as_dict(), "f32")["vulkan_matmul"].f32_copy
    flash = sources_of(DeviceSettings(backend="vulkan", flash_attn=True).as_dict(), "none")
    assert set(flash) == {"vulkan_matmul", "kv_f16", "vulkan_flash"}
    with pytest.raises(NotEmulatedError, match="f32 KV cache"):
        sources_of(DeviceSettings(backend="vulkan", kv_cache_type="f32").as_dict(), "none")
    _, entries = plan({"vulkan.none": (DeviceSettings(backend="vulkan").as_dict(), "none")})
    assert "sources" in entries["vulkan.none"]


def test_every_vulkan_source_is_computed_for_a_model(files: dict[str, Path]) -> None:
    """emulate computes each of a Vulkan combination's sources (none is taken for one
    that cannot change the model), and each moves the first step of a 12-token prompt."""
    combos = {
        f"vulkan.{d}": (DeviceSettings(backend="vulkan").as_dict(), d) for d in ("none", "f32")
    }
    configs, entries = plan(combos)
    prompts = [{"id": "p", "prompt_tokens": list(range(3, 15))}]
    record, arrays = emulate(
        files["q8_0"], {"generation": {"n_ctx": 64}, "prompts": prompts}, configs
    )
    assert all(record["applies"].values()), record["applies"]
    exact = ExactModel(files["q8_0"], n_ctx=64)
    exact.first_step_only = True
    plain = exact.first_steps([prompts[0]["prompt_tokens"]])
    for entry in entries.values():
        for name, config in entry["sources"].items():
            assert np.abs(arrays[config] - plain).max() > 1e-6, name


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
