"""CUDA's matmuls as float64 arithmetic (qdiff.exact.cuda), on this CPU machine.

- Against llama.cpp's CUDA tensors, captured on an H200 (docs/results/cuda-roundings/h200,
  by capture.py there): every matmul of layer 0 of tiny models of eight quantized types
  and f32, prompts of 1, 5, 12 and 40 tokens, equals the engine's emulation of its kernel
  to float32's level, and the other kernel's emulation does not.
- Attention without flash attention (``cuda_attention``), against the H200's tensors of
  prompts in one-token ubatches (docs/results/cuda-roundings/h200-ub1): softmax·V as MMVF's
  f16 products and per-thread f16 sums, and whole first steps at float32's level; and
  against prompts of 40 tokens in one ubatch, softmax·V (and f16 weights' matmuls) as
  cuBLAS's f16 sums of runs of 16 products, exactly.
- Attention with an f32 KV cache (``cuda_attention_kv_f32``), against the H200's tensors of
  prompts of 1-40 tokens in one ubatch (docs/results/cuda-roundings/h200-kv32): K·Q and
  softmax·V in float32, truncated TF32 or rounded TF32 by the kernel the ubatch takes,
  and the quantized files' whole first steps at float32's level.
- f16 weights (``cuda_f16``): layer 0's matmuls by the kernel of each matmul's size.
- Flash attention (``cuda_flash``), against the H200's tensors (docs/results/cuda-roundings/
  h200-fa): VEC's float32 for one token, MMA_F16's f16 arithmetic within one tile of KV
  cells, and the quantized files' first steps of 3 tokens at float32's level.
- The weights read as the kernels read them, the engine's vectorised form against each
  kernel's per-block formula as the source writes it, and the cases where a CUDA kernel's
  arithmetic is the CPU's, against llama.cpp's own CPU tensors."""

from __future__ import annotations

import dataclasses
import hashlib
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from conftest import captured_models, in_child, quantize_in_child
from qdiff.compare.budget import combination_budget
from qdiff.core.roundings import (
    NOT_FOLLOWED_LABELS,
    NotEmulatedError,
    Roundings,
    config_id,
    plan,
    sources_of,
    together,
)
from qdiff.core.settings import DeviceSettings
from qdiff.exact import blocks, cuda
from qdiff.exact.blocks import OFFSET_TYPES
from qdiff.exact.model import ExactModel, _ubatch_sizes, rms_norm, rope
from qdiff.exact.reference import _changes_anything, emulate
from test_roundings import LAYER0, captured_layer0
from tinymodel import write_tiny_llama

H200 = Path(__file__).parents[1] / "docs/results/cuda-roundings/h200"
LENGTHS = [1, 5, 12, 40]  # capture.py's prompts: MMVQ/MMVF, MMVQ/MMF, MMQ/MMF, MMQ/cuBLAS
# matmuls of layer 0 (input, output, weight) beyond test_roundings.LAYER0's
MORE = [
    ("kqv_out-0", "attn_out-0", "blk.0.attn_output.weight"),
    ("ffn_swiglu-0", "ffn_out-0", "blk.0.ffn_down.weight"),
]
TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k_m", "q5_k_m", "q6_k"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models capture.py made on the H200, made again (conftest.captured_models)."""
    return captured_models(tmp_path_factory.mktemp("cuda"), H200 / "files.tsv")


@pytest.mark.parametrize("target", TYPES)
def test_each_quantized_matmul_is_its_kernels_emulation_on_h200_tensors(
    files: dict[str, Path], target: str
) -> None:
    model = ExactModel(files[target])
    for n in LENGTHS:
        tensors = np.load(H200 / f"{target}-{n}.npz")
        own = cuda.kernel_for(n)
        other = "mmq" if own == "mmvq" else "mmvq"
        for given, made, weight in LAYER0 + MORE:
            x, theirs = tensors[given].astype(np.float64)[None], tensors[made].astype(np.float64)
            scale = np.abs(theirs).max()
            err = np.abs(cuda.linear(x, model.weights, weight, own)[0] - theirs).max() / scale
            err_other = np.abs(cuda.linear(x, model.weights, weight, other)[0] - theirs).max()
            assert err < 1e-6, (target, n, weight, err)
            assert err_other / scale > 50 * err, (target, n, weight, err, err_other / scale)


def test_f32_matmuls_are_float32_then_truncated_then_rounded_tf32_on_h200_tensors(
    files: dict[str, Path],
) -> None:
    """1 token: MMVF in float32; 5 and 12: MMF, the operands' bits cut to TF32; 40: cuBLAS,
    rounded to TF32 (to nearest even)."""
    model = ExactModel(files["f32"])
    for n in LENGTHS:
        tensors = np.load(H200 / f"f32-{n}.npz")
        for given, made, weight in LAYER0 + MORE:
            x, theirs = tensors[given].astype(np.float64)[None], tensors[made].astype(np.float64)
            w, scale = model.weights[weight], np.abs(theirs).max()
            errs = {
                name: np.abs(y[0] - theirs).max() / scale
                for name, y in {
                    "emulated": cuda.f32_linear(x, w, n),
                    "float32": x @ w.T,
                    "truncated": cuda.tf32(x, False) @ cuda.tf32(w, False).T,
                    "rounded": cuda.tf32(x, True) @ cuda.tf32(w, True).T,
                }.items()
            }
            assert errs["emulated"] < 1e-6, (n, weight, errs)
            others = [e for k, e in errs.items() if k != "emulated" and e > 1e-6]
            assert len(others) == 2 and min(others) > 50 * errs["emulated"], (n, weight, errs)


def _matmul_weights(model: ExactModel) -> list[str]:
    return [w for _, _, w in LAYER0] + ["blk.0.ffn_down.weight", "blk.0.attn_output.weight"]


@pytest.mark.parametrize("target", ["q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m"])
def test_a_weight_is_a_scale_times_integers_plus_an_offset_per_block(
    files: dict[str, Path], target: str
) -> None:
    model = ExactModel(files[target])
    seen = set()
    for name in _matmul_weights(model):
        kind = model.weights.type_of(name).lower()
        if kind not in OFFSET_TYPES:
            continue
        seen.add(kind)
        n, scale, offset = blocks.affine(model.weights, name)
        top = 15 if kind in ("q4_0", "q4_1", "q4_k") else 31
        assert n.min() >= 0 and n.max() <= top and n.max() >= top - 1, (name, kind)
        w = model.weights[name].reshape(n.shape)
        again = scale[..., None] * n + offset[..., None]
        assert np.abs(again - w).max() <= 2e-7 * np.abs(w).max(), (name, kind)
    assert seen, target


def _per_block(x: np.ndarray, model: ExactModel, name: str, kernel: str) -> np.ndarray:
    """The kernel's dot product block by block, as its source writes it
    (docs/gpu-arithmetic.md; vecdotq.cuh for MMVQ, mmq-vec-dot.cuh for MMQ)."""
    kind = model.weights.type_of(name).lower()
    a = cuda.quantize_q8_1(x, kernel, kind)
    f16 = cuda.f16
    if kind in OFFSET_TYPES:
        n, d_w, offset = blocks.affine(model.weights, name)
    else:  # q8_0, q6_k: the values as they are, no offset
        w = model.weights[name]
        n, d_w, offset = w.reshape(len(w), -1, 32), np.ones(w.shape[:1] + (w.shape[1] // 32,)), None
    y = np.zeros((len(x), len(n)))
    for t in range(len(x)):
        for r in range(len(n)):
            for b in range(n.shape[1]):
                dot = float(n[r, b] @ a.q[t, b])  # the integer dot product
                dh, sh = a.scale[t, b], a.sum[t, b]
                if kind in ("q8_0", "q6_k"):
                    y[t, r] += dot * dh * d_w[r, b]
                elif kernel == "mmvq" and kind in ("q4_0", "q5_0"):
                    y[t, r] += d_w[r, b] * (dh * dot + offset[r, b] / d_w[r, b] * sh)
                elif kernel == "mmvq" and kind in ("q4_1", "q5_1"):
                    y[t, r] += f16(d_w[r, b] * dh) * dot + f16(offset[r, b] * sh)
                elif kernel == "mmvq":  # K-quants: dmin·m meets dh·Σq
                    y[t, r] += d_w[r, b] * dh * dot + offset[r, b] * dh * a.q[t, b].sum()
                elif kind in ("q4_0", "q5_0"):  # MMQ: n - 8 (n - 16) taken as the integers
                    y[t, r] += d_w[r, b] * dh * (dot + offset[r, b] / d_w[r, b] * a.q[t, b].sum())
                elif kind in ("q4_1", "q5_1"):
                    y[t, r] += d_w[r, b] * dh * dot + offset[r, b] * sh
                else:  # MMQ q4_K, q5_K: f16(d·sc) and f16(-dmin·m)
                    y[t, r] += f16(d_w[r, b]) * dh * dot + f16(offset[r, b]) * sh
    return y


@pytest.mark.parametrize("kernel", ["mmvq", "mmq"])
@pytest.mark.parametrize("target", TYPES)
def test_the_engines_product_is_the_kernels_per_block_formula(
    files: dict[str, Path], target: str, kernel: str
) -> None:
    model = ExactModel(files[target])
    rng = np.random.default_rng(3)
    name = "blk.0.attn_q.weight"
    x = rng.standard_normal((2, 256))
    x[1, :32] = 0.0  # an all-zero block: q = 0, scale 0
    fast = cuda.linear(x, model.weights, name, kernel)
    slow = _per_block(x, model, name, kernel)
    assert np.abs(fast - slow).max() <= 1e-12 * np.abs(slow).max(), model.weights.type_of(name)


def test_mmvq_for_at_most_8_tokens_and_mmq_above() -> None:
    assert [cuda.kernel_for(n) for n in (1, 8, 9, 512)] == ["mmvq", "mmvq", "mmq", "mmq"]


def test_the_activations_scale_is_kept_as_each_kernel_keeps_it() -> None:
    x = np.linspace(-1.3, 0.7, 64)[None]
    amax = np.float32(1.3)
    mmvq = cuda.quantize_q8_1(x, "mmvq", "q8_0")
    mmq_float = cuda.quantize_q8_1(x, "mmq", "q8_0")
    mmq_half = cuda.quantize_q8_1(x, "mmq", "q4_k")
    assert mmvq.scale[0, 0] == np.float16(amax / np.float32(127))
    assert mmq_float.scale[0, 0] == np.float32(1) / (np.float32(127) / amax)
    assert mmq_half.scale[0, 0] == np.float16(mmq_float.scale[0, 0])
    assert mmq_float.scale[0, 0] != mmvq.scale[0, 0]
    # the f16 sum of the unrounded values
    assert mmvq.sum[0, 1] == np.float16(np.float32(x[0, 32:]).sum(dtype=np.float32))
    # roundf: halves away from zero
    assert list(cuda.round_half_away(np.array([-2.5, -0.5, 0.5, 1.5, 2.5]))) == [-3, -1, 1, 2, 3]


@pytest.mark.parametrize(("target", "kernel"), [("q8_0", "mmvq"), ("q4_0", "mmq")])
def test_where_a_cuda_kernel_rounds_as_the_cpu_it_matches_llama_cpps_cpu(
    files: dict[str, Path], target: str, kernel: str
) -> None:
    """MMVQ before a q8_0 weight and MMQ before a q4_0 weight keep f16 scales and no block
    sum, as the CPU's Q8_0 does: on llama.cpp's own CPU tensors they must agree as the CPU
    emulation does, to float32's level."""
    tensors = in_child(captured_layer0, files[target])
    model = ExactModel(files[target])
    for given, made, weight in LAYER0:
        x, theirs = tensors[given].astype(np.float64), tensors[made].astype(np.float64)
        ours = cuda.linear(x[None], model.weights, weight, kernel)[0]
        scale = np.abs(theirs).max()
        assert np.abs(ours - theirs).max() < 1e-5 * scale, (weight, target)


def test_the_engine_gives_each_row_the_kernel_of_its_ubatch(files: dict[str, Path]) -> None:
    """A row computed in a ubatch of at most 8 tokens takes MMVQ, in a larger one MMQ; a
    first-step emulation's last layer and output take one row a prompt (ggml_get_rows)."""
    assert list(_ubatch_sizes(70, 64)) == [64] * 64 + [6] * 6
    model = ExactModel(files["q4_1"], Roundings(cuda_activations=True))
    name = "blk.0.attn_q.weight"
    x = np.random.default_rng(5).standard_normal((45, 256))
    model.row_tokens = np.array([5] * 5 + [40] * 40)
    y = model.linear(x, name)
    assert np.array_equal(y[:5], cuda.linear(x[:5], model.weights, name, "mmvq"))
    assert np.array_equal(y[5:], cuda.linear(x[5:], model.weights, name, "mmq"))
    assert not np.allclose(y[5:], cuda.linear(x[5:], model.weights, name, "mmvq"), atol=1e-6)
    f32 = ExactModel(files["f32"], Roundings(cuda_tf32=True))
    f32.row_tokens = np.array([2] * 2 + [5] * 5 + [38] * 38)
    y = f32.linear(x, name)
    w = f32.weights[name]
    for rows, n in ((slice(0, 2), 2), (slice(2, 7), 5), (slice(7, 45), 38)):
        assert np.array_equal(y[rows], cuda.f32_linear(x[rows], w, n)), n
    # a first step: the prompt's layers in MMQ, the last layer's feed-forward and the
    # output in MMVQ (one row); the rest of the forward pass unchanged
    tokens = list(range(3, 43))
    full = model.logits(model.hidden([tokens])[0][-1:])
    model.first_step_only = True
    first = model.logits(model.hidden([tokens])[0][-1:])
    assert not np.allclose(first, full, atol=1e-7)
    exact = ExactModel(files["q4_1"]).forward(tokens, slice(-1, None))
    assert np.abs(first - exact).max() < 10 * np.abs(full - exact).max()


def test_tf32_drops_or_rounds_the_low_13_bits() -> None:
    one_and = np.float32(1.0) + np.float32(2.0**-10) * np.array([0.5, 0.25, 0.75, 1.5])
    assert list(cuda.tf32(one_and, False)) == [1.0, 1.0, 1.0, 1 + 2.0**-10]
    assert list(cuda.tf32(one_and, True)) == [1.0, 1.0, 1 + 2.0**-10, 1 + 2.0**-9]
    x = np.random.default_rng(0).standard_normal((3, 8))
    w = np.random.default_rng(1).standard_normal((4, 8))
    assert np.array_equal(cuda.f32_linear(x, w, 3), x @ w.T)
    assert np.array_equal(cuda.f32_linear(x, w, 16), cuda.tf32(x, False) @ cuda.tf32(w, False).T)
    assert np.array_equal(cuda.f32_linear(x, w, 17), cuda.tf32(x, True) @ cuda.tf32(w, True).T)


def test_a_sequence_batched_with_others_is_computed_as_alone(files: dict[str, Path]) -> None:
    """Each prompt is its own run: a 5-token prompt takes MMVQ even when the engine batches
    it with a 40-token one (each row's kernel by its own sequence's ubatch)."""
    model = ExactModel(files["q4_1"], Roundings(cuda_activations=True, kv_f16=True))
    short, long = list(range(3, 8)), list(range(10, 50))
    batched = model.hidden([short, long])
    for tokens, h in zip((short, long), batched, strict=True):
        alone = model.hidden([tokens])[0]
        assert np.abs(h - alone).max() <= 1e-12 * np.abs(alone).max(), len(tokens)


@pytest.mark.parametrize("target", TYPES)
def test_first_steps_of_short_prompts_are_the_h200s_to_float32s_level(
    files: dict[str, Path], target: str
) -> None:
    """Whole tiny models, prompts of 3 and 5 tokens (MMVQ throughout; attention's MMF with
    f16 Q and softmax weights): the engine with CUDA's roundings is within 1e-5 of the
    H200's logits at the median prompt, where the exact answer is 0.01 or more away."""
    runs = np.load(H200 / f"{target}-logits.npz")
    model = ExactModel(files[target])
    model.first_step_only = True
    cuda_run = Roundings(cuda_activations=True, cuda_tf32=True, kv_f16=True, qp_f16=True)
    for n in (3, 5):
        keys = [k for k in runs if k.startswith(f"{n}-") and not k.endswith("-tokens")]
        prompts = [list(runs[k + "-tokens"]) for k in keys]
        run = np.array([runs[k] for k in keys], dtype=np.float64)
        made = {}
        for name, r in (("exact", Roundings()), ("cuda", cuda_run)):
            model.roundings = r
            made[name] = model.first_steps(prompts)
        residual = np.median(np.abs(run - made["cuda"]).max(axis=1))
        distance = np.median(np.abs(run - made["exact"]).max(axis=1))
        assert len(keys) == 4 and residual < 1e-5 and distance > 1e-2, (n, residual, distance)


def test_weights_whose_cuda_kernel_is_not_followed_leave_that_budget_unmeasured(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    """A bf16 file: CUDA's sets raise NotEmulatedError (no silent fallback to plain
    products), the emulation job still computes the CPU's sets, and the CUDA combination's
    budget says why it has none."""
    path = tmp_path / "bf16.gguf"
    quantize_in_child(files["f32"], path, "bf16")
    with pytest.raises(NotEmulatedError, match="CUDA's matmuls of bf16 weights"):
        ExactModel(path, Roundings(cuda_tf32=True)).forward([3, 4, 5], slice(-1, None))
    settings = {
        "cpu.none": (DeviceSettings(backend="cpu").as_dict(), "none"),
        "cuda.none": (DeviceSettings(backend="cuda").as_dict(), "none"),
    }
    configs, entries = plan(settings)
    run = {"generation": {"n_ctx": 64}, "prompts": [{"id": "p", "prompt_tokens": [3, 4, 5]}]}
    record, arrays = emulate(path, run, configs)
    assert entries["cuda.none"]["together"] in record["not_emulated"]
    assert entries["cpu.none"]["together"] in arrays
    cpu = arrays[entries["cpu.none"]["together"]]  # stands in for the run and exact
    cuda_run = {"settings": settings["cuda.none"][0], "dequant": "none", "prompts": run["prompts"]}
    row = combination_budget(cuda_run, cpu, None, ({"status": "ok"} | record, arrays), cpu)
    assert row == {"status": "n/a", "reason": "not emulated: CUDA's matmuls of bf16 weights"}


def test_the_engine_notes_flash_attention_beyond_one_tile_where_a_row_meets_it(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    """The MMA kernel's tiles beyond the first are what the engine leaves out of CUDA's
    flash attention: it notes them where a row of an MMA ubatch sits at or beyond the
    smallest tile (cuda.FLASH_TILE_MIN cells), by the prompt's length, the head and the
    ubatch; VEC's one-token ubatches (heads of 64, 128, 256) are float32 throughout."""
    head_96 = write_tiny_llama(tmp_path / "head-96.gguf", n_embd=384, n_head=4)
    edge = cuda.FLASH_TILE_MIN
    cases = [  # (file, n_ubatch, prompt length, noted)
        (files["f32"], 512, edge, False),  # one ubatch (MMA), within the first tile
        (files["f32"], 512, edge + 1, True),
        (files["f32"], 16, edge + 1, False),  # the 33rd row is a ubatch of one: VEC
        (files["f32"], 16, edge + 2, True),  # the third ubatch (MMA) sees 33-34 cells
        (files["f32"], 1, 3 * edge, False),  # a head of 64: VEC for each token
        (head_96, 1, edge, False),  # a head of 96: MMA for one token too
        (head_96, 1, edge + 1, True),
    ]
    for path, n_ubatch, length, noted in cases:
        model = ExactModel(path, Roundings(cuda_flash=True, n_ubatch=n_ubatch))
        model.first_steps([list(range(3, 3 + length))])
        assert (model.not_followed == {"cuda_flash_tiles"}) == noted, (path, n_ubatch, length)
        model.roundings = Roundings()  # a new set: nothing met yet
        assert model.not_followed == set()
    # other sets never note it, however long the prompt
    for r in (Roundings(cuda_attention=True), Roundings(kv_f16=True, qp_f16=True)):
        model = ExactModel(files["f32"], r)
        model.first_steps([list(range(3, 3 + 3 * edge))])
        assert model.not_followed == set()


def test_a_flash_budget_names_the_tiles_where_the_emulation_met_them(
    files: dict[str, Path],
) -> None:
    """emulate records what each set met and did not follow; combination_budget names it
    for the run's set, by its label, and nothing where its prompts stayed within a tile."""
    settings = DeviceSettings(backend="cuda", flash_attn=True).as_dict()
    configs, entries = plan({"cuda-fa.none": (settings, "none")})
    label = NOT_FOLLOWED_LABELS["cuda_flash_tiles"]
    for length, named in ((cuda.FLASH_TILE_MIN, False), (cuda.FLASH_TILE_MIN + 1, True)):
        prompts = [{"id": "p", "prompt_tokens": list(range(3, 3 + length))}]
        run = {"generation": {"n_ctx": 64}, "prompts": prompts}
        record, arrays = emulate(files["f32"], run, configs)
        noted = entries["cuda-fa.none"]["together"] in record["not_followed"]
        assert noted == named, (length, record["not_followed"])
        logits = arrays[next(iter(arrays))]  # stands in for the run and exact
        cuda_run = {"settings": settings, "dequant": "none", "prompts": prompts}
        row = combination_budget(
            cuda_run, logits, None, ({"status": "ok"} | record, arrays), logits
        )
        assert (row["not_followed"] == [label]) == named, (length, row["not_followed"])


@pytest.mark.parametrize("target", ["f32", "q8_0", "q4_k_m"])
def test_a_set_that_changes_nothing_takes_the_plain_answer(
    files: dict[str, Path], target: str
) -> None:
    """emulate() computes the plain answer once for every set _changes_anything says
    cannot change this model (the GELU table of a SiLU model, activations before f32
    weights, CUDA's f16 kernels without f16 weights ...): each such set, computed anyway,
    is that answer bit for bit."""
    settings = {
        f"{device}.{dequant}": (DeviceSettings(**kw).as_dict(), dequant)
        for device, kw in (
            ("cpu", {"backend": "cpu"}),
            ("cuda", {"backend": "cuda"}),
            ("cuda-fa", {"backend": "cuda", "flash_attn": True}),
        )
        for dequant in ("none", "f32")
    }
    configs, _ = plan(settings)
    run = {"generation": {"n_ctx": 64}, "prompts": [{"id": "p", "prompt_tokens": [3, 4, 5, 6]}]}
    record, arrays = emulate(files[target], run, configs)
    idle = [name for name, applies in record["applies"].items() if not applies]
    assert idle, "no set that changes nothing: the test would test nothing"
    model = ExactModel(files[target], n_ctx=64)
    model.first_step_only = True
    for name in idle:
        model.roundings = Roundings.from_dict(configs[name])
        computed = model.first_steps([[3, 4, 5, 6]])
        assert np.array_equal(computed, arrays[name]), name


def test_cuda_sets_are_named_by_their_ubatch() -> None:
    assert config_id(Roundings(cuda_activations=True, n_ubatch=64)) == "cuda_activations@ub64"
    assert config_id(Roundings(kv_f16=True, n_ubatch=64)) == "kv_f16"


def test_the_f32_copy_takes_cudas_f32_kernels_for_every_matmul(files: dict[str, Path]) -> None:
    """A combination that runs a file's f32 copy multiplies every weight as f32 (MMVF, MMF or
    cuBLAS by its rows), the file's values: ``f32_copy`` on the file's engine. Without it
    the TF32 switch leaves a quantized file's matmuls alone, so it changes nothing there."""
    cuda_f32 = DeviceSettings(backend="cuda").as_dict()
    assert sources_of(cuda_f32, "f32")["cuda_tf32"].f32_copy
    assert not sources_of(cuda_f32, "none")["cuda_tf32"].f32_copy
    name, x = "blk.0.ffn_up.weight", np.random.default_rng(7).standard_normal((12, 256))
    copy = ExactModel(files["q8_0"], Roundings(cuda_tf32=True, f32_copy=True))
    w = copy.weights[name]
    assert np.array_equal(copy.linear(x, name), cuda.f32_linear(x, w, 12))
    assert not np.allclose(copy.linear(x, name), x @ w.T, rtol=0, atol=1e-7)
    the_file = ExactModel(files["q8_0"], Roundings(cuda_tf32=True))
    assert np.array_equal(the_file.linear(x, name), x @ w.T)
    matmul_types = {t for t in copy.weights.types() if t != "f32"}
    assert _changes_anything(copy.roundings, copy, matmul_types, has_f32=False)
    assert not _changes_anything(the_file.roundings, the_file, matmul_types, has_f32=False)


# Attention without flash attention (cuda.attention_kernel), against the H200's tensors of
# prompts computed in one-token ubatches (docs/results/cuda-roundings/h200-ub1: layer 0 at
# the last of 5, 40 and 600 tokens, and first steps)
H200_UB1 = H200.parent / "h200-ub1"


def _relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def test_one_token_matmuls_of_f16_weights_round_every_product_to_f16(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    """MMVF with f16 accumulators (an f16 weight, one token, the default precision): the
    activations and every product rounded to f16, the products summed in float32. Neither
    plain float32 products nor f16 activations alone come near."""
    path = tmp_path / "f16.gguf"
    quantize_in_child(files["f32"], path, "f16")
    captured = dict(line.split("\t") for line in (H200 / "files.tsv").read_text().splitlines())
    assert hashlib.sha256(path.read_bytes()).hexdigest() == captured["f16"]
    model, tensors = ExactModel(path), np.load(H200 / "f16-1.npz")
    for given, made, weight in LAYER0 + MORE:
        x, theirs = tensors[given].astype(np.float64), tensors[made].astype(np.float64)
        w = model.weights[weight]
        ours = cuda.mmvf_weighted_sum(x[None, None], w.T[None], len(x))[0, 0]
        assert _relative(ours, theirs) < 1e-6, weight
        for other in (w @ x, w @ x.astype(np.float16).astype(np.float64)):
            assert _relative(other, theirs) > 1e-4, weight


@pytest.mark.parametrize("n", LENGTHS)
def test_f16_weights_take_the_kernel_of_their_matmuls_size_on_h200_tensors(
    tmp_path: Path, files: dict[str, Path], n: int
) -> None:
    """The engine's ``cuda_f16`` (cuda.f16_linear) on layer 0's matmuls of the f16 model at
    the last of n tokens in one ubatch: MMVF's f16 products for one token, MMF's f16
    activations for 5 and 12, cuBLAS's f16 sums of runs of 16 for 40, each within 1e-6 of
    the H200's (measured: 0 to 3.4e-07); plain products 1e-4 or more away."""
    path = tmp_path / "f16.gguf"
    quantize_in_child(files["f32"], path, "f16")
    model, tensors = ExactModel(path, Roundings(cuda_f16=True)), np.load(H200 / f"f16-{n}.npz")
    model.row_tokens = np.array([n])  # the one row kept, of a matmul of n tokens
    for given, made, weight in LAYER0 + MORE:
        x, theirs = tensors[given].astype(np.float64)[None], tensors[made].astype(np.float64)
        w = model.weights[weight]
        ours = model.linear(x, weight)[0]
        assert np.array_equal(ours, cuda.f16_linear(x, w, n)[0]), weight
        assert _relative(ours, theirs) < 1e-6, weight
        assert _relative(x[0] @ w.T, theirs) > 1e-4, weight


def _values_of_layer0(model: ExactModel, tokens: np.ndarray, n_ubatch: int = 1) -> np.ndarray:
    """V of every position of layer 0, computed in ubatches of ``n_ubatch`` tokens, as the
    f16 cache keeps it, expanded to the query heads: (heads, positions, d)."""
    model.roundings = Roundings(cuda_activations=True, cuda_tf32=True, n_ubatch=n_ubatch)
    model.row_tokens = _ubatch_sizes(len(tokens), n_ubatch)
    w, hp = model.weights, model.hp
    x = rms_norm(w["token_embd.weight"][tokens], w["blk.0.attn_norm.weight"], hp.eps)
    v = model._qkv(x, 0)[2].astype(np.float16).astype(np.float64)
    return v[:, np.arange(hp.n_head) // (hp.n_head // hp.n_head_kv)].transpose(1, 0, 2)


@pytest.mark.parametrize("n", [5, 40, 600])
def test_one_token_softmax_v_is_mmvfs_f16_products_on_h200_tensors(
    files: dict[str, Path], n: int
) -> None:
    """softmax·V at the last of n tokens, each in its own ubatch, from the run's own softmax
    weights: equal to MMVF's f16 products summed in float32; with 768 KV cells (600
    tokens) each thread sums two products in f16 first, and only that matches. Q6_K: its
    V is integer products, exact in float64, so no stored value rounds the other way."""
    model = ExactModel(files["q6_k"])
    tensors = np.load(H200_UB1 / f"q6_k-ub1-{n}.npz")
    v = _values_of_layer0(model, tensors["tokens"])
    heads = model.hp.n_head
    cells = len(tensors["kq_soft_max-0"]) // heads
    assert cells == cuda.kv_cells(np.array([n - 1]))[0]
    p = tensors["kq_soft_max-0"].reshape(heads, cells)[:, :n].astype(np.float64)
    theirs = tensors["kqv-0"].reshape(heads, -1).astype(np.float64)
    ours = cuda.mmvf_weighted_sum(p[:, None], v, cells)[:, 0]
    f16 = p.astype(np.float16).astype(np.float64)
    one_pass = (f16[..., None] * v).astype(np.float16).astype(np.float64).sum(axis=1)
    assert _relative(ours, theirs) < 1e-6
    assert _relative(np.einsum("hn,hnd->hd", f16, v), theirs) > 5e-5  # MMF's, the CPU's
    assert (_relative(one_pass, theirs) > 5e-5) == (cells > cuda.MMVF_MAX_KV_CELLS)


def test_mmvf_threads_and_their_f16_sums_are_the_sources() -> None:
    """launch_mul_mat_vec_f_cuda's block size, and each thread's half2 sums over every
    block-size-th pair of cells, as the kernel's loop writes them (one value at a time)."""
    assert [cuda.mmvf_block_size(c) for c in (256, 512, 768, 1024)] == [128, 256, 192, 256]
    rng = np.random.default_rng(3)
    cells, keys, d = 768, 700, 4
    p = rng.dirichlet(np.ones(keys), size=(1, 2))  # (heads 1, rows 2, keys)
    v = rng.standard_normal((1, keys, d)).astype(np.float16).astype(np.float64)
    size = cuda.mmvf_block_size(cells)
    expected = np.zeros((2, d))
    for row in range(2):
        for thread in range(size):
            acc = np.zeros((2, d))  # the half2 accumulator: low and high cell of each pair
            for col2 in range(thread, cells // 2, size):
                for half in (0, 1):
                    cell = 2 * col2 + half
                    if cell < keys:
                        product = np.float16(p[0, row, cell]).astype(np.float64) * v[0, cell]
                        acc[half] = (acc[half] + product).astype(np.float16)
            expected[row] += acc.sum(axis=0)
    ours = cuda.mmvf_weighted_sum(p, v, cells)[0]
    assert np.abs(ours - expected).max() < 1e-12


@pytest.mark.parametrize("target", ["f32", "q8_0", "q4_0", "q4_k_m", "q6_k"])
def test_softmax_v_of_40_tokens_adds_runs_of_16_cells_in_f16_on_h200_tensors(
    files: dict[str, Path], target: str
) -> None:
    """softmax·V at the last of 40 tokens in one ubatch (cuBLAS, f16 compute), from the run's
    own softmax weights: the weights in f16, each run of 16 cells' products added to an f16
    accumulator in cell order, exactly. Float32 sums of the f16 products, an f16 result
    of them, and runs of 8 or 32 cells are all 1e-4 of the largest value or more away."""
    model = ExactModel(files[target])
    tensors = np.load(H200 / f"{target}-40.npz")
    v = _values_of_layer0(model, tensors["tokens"], n_ubatch=512)
    heads, n = model.hp.n_head, len(tensors["tokens"])
    cells = len(tensors["kq_soft_max-0"]) // heads
    p = tensors["kq_soft_max-0"].reshape(heads, cells)[:, None, :n].astype(np.float64)
    theirs = tensors["kqv-0"].reshape(heads, -1).astype(np.float64)
    assert _relative(cuda.cublas_f16_weighted_sum(p, v)[:, 0], theirs) == 0.0
    float32_sums = np.einsum("hrn,hnd->hd", cuda.f16(p), v)
    assert _relative(float32_sums, theirs) > 1e-4
    assert _relative(cuda.f16(float32_sums), theirs) > 1e-4
    for run in (8, 32):
        acc = cuda.cublas_f16_weighted_sum(p, v, run)[:, 0]
        assert _relative(acc, theirs) > 1e-4, run


def test_f16_weighted_sum_goes_on_from_a_given_accumulator() -> None:
    """A sum cut at a run boundary and continued from its first part's accumulator is the
    whole sum, bit for bit; continued from zero it is not (the f16 roundings differ)."""
    rng = np.random.default_rng(0)
    p, v = rng.random((2, 3, 64)), rng.standard_normal((2, 64, 8))
    whole = cuda.cublas_f16_weighted_sum(p, v)
    first = cuda.cublas_f16_weighted_sum(p[..., :32], v[:, :32])
    rest = cuda.cublas_f16_weighted_sum(p[..., 32:], v[:, 32:], acc=first)
    assert np.array_equal(rest, whole)
    separately = first + cuda.cublas_f16_weighted_sum(p[..., 32:], v[:, 32:])
    assert not np.array_equal(cuda.f16(separately), whole)


def test_f16_matmuls_of_40_tokens_add_runs_of_16_products_in_f16(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    """cuBLAS's f16 GEMM (an f16 weight, 40 tokens, the default precision) as the same sum:
    the activations in f16, runs of 16 products added to an f16 accumulator, exactly."""
    path = tmp_path / "f16.gguf"
    quantize_in_child(files["f32"], path, "f16")
    model, tensors = ExactModel(path), np.load(H200 / "f16-40.npz")
    for given, made, weight in LAYER0 + MORE:
        x, theirs = tensors[given].astype(np.float64), tensors[made].astype(np.float64)
        ours = cuda.cublas_f16_weighted_sum(x[None, None], model.weights[weight].T[None])[0, 0]
        assert _relative(ours, theirs) == 0.0, weight
        assert _relative(cuda.f16(model.weights[weight] @ cuda.f16(x)), theirs) > 1e-4, weight


def test_attention_rows_take_the_kernels_of_their_ubatch(files: dict[str, Path]) -> None:
    """With ``cuda_attention``, a prompt of 5 tokens in one ubatch takes MMF (the CPU's f16
    Q and softmax weights, to the bit); the same prompt in one-token ubatches takes MMVF;
    a prompt of 40, cuBLAS (Q rounded to TF32)."""
    tokens = list(range(3, 8))
    mmf = ExactModel(files["q8_0"], Roundings(cuda_attention=True, kv_f16=True))
    cpu = ExactModel(files["q8_0"], Roundings(qp_f16=True, kv_f16=True))
    assert np.array_equal(mmf.forward(tokens, slice(None)), cpu.forward(tokens, slice(None)))
    one = ExactModel(files["q8_0"], Roundings(cuda_attention=True, kv_f16=True, n_ubatch=1))
    assert not np.allclose(one.forward(tokens, slice(None)), cpu.forward(tokens, slice(None)))
    assert [cuda.attention_kernel(t) for t in (1, 2, 16, 17)] == ["mmvf", "mmf", "mmf", "cublas"]
    f32_cache = [cuda.attention_kernel(t, f16_cache=False) for t in (1, 3, 4, 16, 17)]
    assert f32_cache == ["mmvf", "mmvf", "mmf", "mmf", "cublas"]


def _first_step_residual(
    model: ExactModel, runs: np.lib.npyio.NpzFile, n: int, roundings: Roundings
) -> float:
    """The median over a capture's prompts of n tokens of max |Δ| between the H200's first
    step (``runs``: capture.py's first steps) and the engine's with ``roundings``."""
    keys = [k for k in runs if k.startswith(f"{n}-") and not k.endswith("-tokens")]
    prompts = [list(runs[k + "-tokens"]) for k in keys]
    run = np.array([runs[k] for k in keys], dtype=np.float64)
    model.roundings = roundings
    made = model.first_steps(prompts)
    return float(np.median(np.abs(run - made).max(axis=1)))


@pytest.mark.parametrize("target", ["q8_0", "q4_1", "q5_k_m", "q6_k"])
def test_first_steps_in_one_token_ubatches_are_the_h200s_to_float32s_level(
    files: dict[str, Path], target: str
) -> None:
    """Prompts of 3 and 5 tokens in one-token ubatches (MMVQ, and attention's MMVF): the
    sources the pipeline plans for such a device are within 1e-5 of the H200's logits at
    the median prompt; the matmuls' and the f16 cache's alone, as before attention was
    followed, are 0.01 or more away."""
    runs = np.load(H200_UB1 / f"{target}-logits-ub1.npz")
    model = ExactModel(files[target])
    model.first_step_only = True
    planned = together(sources_of(DeviceSettings(backend="cuda", n_ubatch=1).as_dict(), "none"))
    assert planned.cuda_attention and planned.n_ubatch == 1
    matmuls = dataclasses.replace(planned, cuda_attention=False)
    for n in (3, 5):
        residual = {
            name: _first_step_residual(model, runs, n, r)
            for name, r in (("planned", planned), ("matmuls", matmuls))
        }
        assert residual["planned"] < 1e-5 and residual["matmuls"] > 1e-2, (n, residual)


H200_KV32 = H200.parent / "h200-kv32"
KV32_LENGTHS = [1, 3, 5, 12, 40]  # capture.py's KV32_LAYER0: MMVF, MMVF, MMF, MMF, cuBLAS
TF32_OF_KERNEL = {
    "mmvf": np.asarray,
    "mmf": partial(cuda.tf32, nearest=False),
    "cublas": partial(cuda.tf32, nearest=True),
}


def _attention_inputs_of_layer0(
    model: ExactModel, tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer 0's Q at the last position (heads, d), and K and V of every position as an
    f32 cache keeps them, expanded to the query heads (heads, positions, d): the prompt
    in one ubatch, through CUDA's matmuls."""
    n = len(tokens)
    model.roundings = Roundings(cuda_activations=True, cuda_tf32=True)
    model.row_tokens = _ubatch_sizes(n, 512)
    w, hp = model.weights, model.hp
    x = rms_norm(w["token_embd.weight"][tokens], w["blk.0.attn_norm.weight"], hp.eps)
    q, k, v = model._qkv(x, 0)
    positions, turn = np.arange(n, dtype=np.float64), model._rope_of(0)
    q, k = rope(q, positions, turn), rope(k, positions, turn)
    heads = np.arange(hp.n_head) // (hp.n_head // hp.n_head_kv)
    return q[-1], k[:, heads].transpose(1, 0, 2), v[:, heads].transpose(1, 0, 2)


def _share_equal(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The share of values within float32's level (1e-6 of the largest) of the run's."""
    return float(np.mean(np.abs(ours - theirs) <= 1e-6 * np.abs(theirs).max()))


@pytest.mark.parametrize("target", ["f32", "q8_0", "q4_k_m"])
def test_attention_with_an_f32_cache_rounds_as_its_kernel_on_h200_tensors(
    files: dict[str, Path], target: str
) -> None:
    """K·Q and softmax·V at the last of 1, 3, 5, 12 and 40 tokens in one ubatch with an f32
    KV cache: MMVF's float32 for up to 3 tokens, MMF's truncated TF32 operands for 4-16,
    cuBLAS's rounded TF32 above (cuda.kv_f32_operand). Q, K and V are computed here,
    within float32's error of the run's, so a value next to a TF32 boundary may round the
    other way: at least 70% of the values equal the run's to float32's level (measured:
    75-100%), and at most 10% under either other rounding (measured: 0-4%)."""
    model = ExactModel(files[target])
    heads = model.hp.n_head
    for n in KV32_LENGTHS:
        tensors = np.load(H200_KV32 / f"{target}-kv32-{n}.npz")
        q, k, v = _attention_inputs_of_layer0(model, tensors["tokens"])
        cells = len(tensors["kq-0"]) // heads
        kq = tensors["kq-0"].reshape(heads, cells)[:, :n].astype(np.float64)
        p = tensors["kq_soft_max-0"].reshape(heads, cells)[:, :n].astype(np.float64)
        kqv = tensors["kqv-0"].reshape(heads, -1).astype(np.float64)
        kernel = cuda.attention_kernel(n, f16_cache=False)
        ours = cuda.kv_f32_operand(kernel) or np.asarray
        others = [f for name, f in TF32_OF_KERNEL.items() if name != kernel]
        for operand, lowest, highest in [(ours, 0.7, 1.0)] + [(f, 0.0, 0.1) for f in others]:
            products = np.einsum("hd,hnd->hn", operand(q), operand(k))
            weighted = np.einsum("hn,hnd->hd", operand(p), operand(v))
            for share in (_share_equal(products, kq), _share_equal(weighted, kqv)):
                assert lowest <= share <= highest, (n, kernel, share)


@pytest.mark.parametrize("target", ["q8_0", "q4_k_m"])
def test_first_steps_with_an_f32_cache_are_the_h200s_to_float32s_level(
    files: dict[str, Path], target: str
) -> None:
    """Prompts of 3 and 5 tokens in one ubatch with an f32 KV cache (MMVQ; attention's MMVF,
    then MMF): the sources the pipeline plans for such a device are within 1e-5 of the
    H200's logits at the median prompt; without the attention's switch the same at 3
    tokens (float32 products), 0.05 or more away at 5 (measured: 0.19-0.21). From 12 tokens,
    with MMQ's approximate divisions, 1.1e-06 to 0.22 (check-kv32.log): not asserted."""
    runs = np.load(H200_KV32 / f"{target}-logits-kv32.npz")
    model = ExactModel(files[target])
    model.first_step_only = True
    settings = DeviceSettings(backend="cuda", kv_cache_type="f32").as_dict()
    planned = together(sources_of(settings, "none"))
    assert planned.cuda_attention_kv_f32 and not planned.kv_f16
    matmuls = dataclasses.replace(planned, cuda_attention_kv_f32=False)
    for n in (3, 5):
        residual = {
            name: _first_step_residual(model, runs, n, r)
            for name, r in (("planned", planned), ("matmuls", matmuls))
        }
        assert residual["planned"] < 1e-5, (n, residual)
        assert (residual["matmuls"] > 0.05) == (n > cuda.MMVF_MAX_TOKENS), (n, residual)


H200_FA = H200.parent / "h200-fa"
FA_LENGTHS = [1, 2, 5, 12, 40]  # capture.py's FA_LAYER0 within one tile of KV cells: VEC, MMA


def _flash_kernel_of(model: ExactModel, n: int) -> str:
    """The flash-attention kernel a ubatch of a prompt's n tokens takes for ``model``."""
    hp = model.hp
    cells = cuda.kv_cells(np.array([n - 1]))[0]
    return cuda.flash_kernel(n, hp.head_dim, hp.gqa_ratio, cells)


def test_flash_attention_picks_its_kernel_by_tokens_head_and_heads_per_kv_head() -> None:
    """fattn.cu's choice on the H200 (Ada or later, f16 K and V, a padded cache): VEC for
    one token with a head of 64, 128 or 256 and at most 4 query heads per KV head (more
    with a head below 256 and under 8,192 cells); MMA_F16 for more tokens and for other
    heads; the TILE kernel of heads of 40 and 72 is not followed."""
    assert cuda.flash_kernel(1, 64, 3, 256) == "vec"  # SmolLM2
    assert cuda.flash_kernel(1, 256, 4, 256) == "vec"  # Gemma 3 270M
    assert cuda.flash_kernel(1, 64, 7, 4096) == "vec"  # Qwen2 0.5B
    assert cuda.flash_kernel(2, 64, 3, 256) == "mma"
    assert cuda.flash_kernel(1, 96, 1, 256) == "mma"  # Phi-3's head: no VEC instance
    assert cuda.flash_kernel(1, 256, 8, 256) == "mma"
    assert cuda.flash_kernel(1, 64, 7, 8192) == "mma"
    with pytest.raises(NotEmulatedError, match="TILE"):
        cuda.flash_kernel(1, 72, 1, 256)


def _flash_shares(model: ExactModel, target: str, n: int) -> tuple[float, float]:
    """The shares of the H200's flash-attention output at the last of n tokens (layer 0)
    equal to float32's level: to plain attention over the f16 K and V (VEC's float32), and
    to the MMA_F16 kernel's arithmetic (cuda.mma_flash_query, cuda.mma_flash_sum)."""
    tensors = np.load(H200_FA / f"{target}-fa-{n}.npz")
    q, k, v = _attention_inputs_of_layer0(model, tensors["tokens"])
    k, v = cuda.f16(k), cuda.f16(v)
    heads, scale = model.hp.n_head, model.hp.attn_scale
    theirs = tensors["FLASH_ATTN_EXT (unnamed)"].reshape(heads, -1).astype(np.float64)
    scores = np.einsum("hd,hnd->hn", q * scale, k)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    plain = np.einsum("hn,hnd->hd", p, v) / p.sum(axis=1, keepdims=True)
    mma_scores = np.einsum("hd,hnd->hn", cuda.mma_flash_query(q, scale, 0.0), k)
    mma = cuda.mma_flash_sum(mma_scores[:, None], v)[:, 0]
    return _share_equal(plain, theirs), _share_equal(mma, theirs)


@pytest.mark.parametrize("target", ["f32", "q8_0", "q4_k_m"])
def test_flash_attention_takes_its_kernels_arithmetic_on_h200_tensors(
    files: dict[str, Path], target: str
) -> None:
    """Flash attention's output at the last of n tokens in one ubatch (f16 K and V): one
    token, the VEC kernel, is plain float32 attention; 2-40 tokens, the MMA_F16 kernel, Q
    and the softmax weights (against the maximum plus FATTN_KQ_MAX_OFFSET) in f16, runs of
    16 cells added in f16, the unrounded weights' sum dividing at the end: at least 70% of
    the values equal to float32's level under the kernel's arithmetic (measured: 82-100%),
    at most 10% under the other (0-2%). At 300 tokens, beyond one tile of cells, neither
    (0-2%): not followed (ExactModel.not_followed)."""
    model = ExactModel(files[target])
    for n in FA_LENGTHS:
        plain, mma = _flash_shares(model, target, n)
        ours, other = (plain, mma) if _flash_kernel_of(model, n) == "vec" else (mma, plain)
        assert ours >= 0.7 and other <= 0.1, (n, plain, mma)
    assert max(_flash_shares(model, target, 300)) <= 0.1


@pytest.mark.parametrize("target", ["q8_0", "q4_k_m"])
def test_first_steps_with_flash_attention_are_the_h200s_to_float32s_level(
    files: dict[str, Path], target: str
) -> None:
    """Prompts of 3 tokens in one ubatch with flash attention (MMVQ; MMA_F16): the sources
    the pipeline plans for such a device within 1e-5 of the H200's logits at the median
    prompt, 0.05 or more away without the flash switch (measured: 0.19); prompts of 3 and 5
    tokens in one-token ubatches (VEC: float32) within 1e-5 with or without it."""
    model = ExactModel(files[target])
    model.first_step_only = True
    for name, n_ubatch, lengths in (("fa", 512, (3,)), ("fa-ub1", 1, (3, 5))):
        runs = np.load(H200_FA / f"{target}-logits-{name}.npz")
        settings = DeviceSettings(backend="cuda", flash_attn=True, n_ubatch=n_ubatch)
        planned = together(sources_of(settings.as_dict(), "none"))
        assert planned.cuda_flash and planned.kv_f16
        for n in lengths:
            residual = {
                switch: _first_step_residual(
                    model, runs, n, dataclasses.replace(planned, cuda_flash=switch)
                )
                for switch in (True, False)
            }
            assert residual[True] < 1e-5, (name, n, residual)
            assert (residual[False] > 0.05) == (n_ubatch > 1), (name, n, residual)
