"""CUDA's matmuls on an H200 (compute capability 9.0), in float64: what llama.cpp's kernels
compute, up to the order and rounding of their float32 sums; its attention without flash
attention at the end (attention_kernel).

Read in the source llama-cpp-python 0.3.36 vendors (ggml/src/ggml-cuda/; the lines are in
docs/gpu-arithmetic.md). A matmul of 1-8 tokens runs MMVQ, of more MMQ (on this GPU never
cuBLAS); both first quantize each token's activations to q8_1, per block of 32 values:
- MMVQ (``quantize_q8_1``): d = amax/127, q = roundf(x/d) (half away from zero); the dot
  products take the scale rounded to f16, and the block's float32 sum of the *unrounded*
  values, rounded to f16, where the weight has an offset (q4_0, q5_0, q4_1, q5_1). For
  q4_1 and q5_1 the products d_w·d_a and m_w·s_a are themselves rounded to f16 (``__hmul2``).
- MMQ (``quantize_mmq_q8_1``): d_inv = 127/amax, q = roundf(x·d_inv), d = 1/d_inv, kept in
  float32 for q5_0, q8_0 and q6_K (layout D4), in f16 with the f16 sum for q4_0 (its sum
  unused), q4_1, q5_1, q4_K and q5_K (DS4). For q4_K and q5_K the weight's sub-block scale
  d·sc and offset dmin·m are rounded to f16 (``load_tiles``: ``dm * half2(sc, m)``).
The integer dot products are exact. The build's ``-use_fast_math`` makes the two divisions
approximate (within 2 ulp): a value that far from a rounding tie may round the other way,
which the floor of the error budget (``jittered``) covers.

An f32 weight's matmul of 1-3 tokens runs MMVF in float32; of 4-16 MMF, whose TF32
tensor-core products take the float32 bits as they are (the low 13 mantissa bits of both
operands dropped: measured, docs/results/cuda-roundings); of more, cuBLAS in TF32 mode,
which rounds both operands to TF32 to nearest even (measured likewise). Each case was
matched to float32's level on layer 0 of tiny models captured on an H200. Attention with an
f32 KV cache takes these f32 kernels too (kv_f32_operand).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from qdiff.core.roundings import NotEmulatedError
from qdiff.exact.blocks import OFFSET_TYPES, Q8_1, QK, by_rows, f16

if TYPE_CHECKING:
    from qdiff.exact.model import Weights

MMVQ_MAX_TOKENS = 8  # mmvq.cuh MMVQ_MAX_BATCH_SIZE: more tokens take MMQ
MMVF_MAX_TOKENS = 3  # mmvf.cu ggml_cuda_should_use_mmvf, f32 weights on Ampere and later
MMF_MAX_TOKENS = 16  # mmf.cu ggml_cuda_should_use_mmf: more tokens take cuBLAS
# weight types whose q8_1 scale MMQ keeps in float32 (mmq.cuh mmq_get_q8_1_ds_layout: D4)
MMQ_FLOAT_SCALE = {"q5_0", "q8_0", "q6_k"}
# where a kernel's dot products take the activations' block sum, not d·Σq
USES_SUM = {
    "mmvq": {"q4_0", "q5_0", "q4_1", "q5_1"},
    "mmq": {"q4_1", "q5_1", "q4_k", "q5_k"},
}
EMULATED = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"}
FOLLOWED = EMULATED | {"f32", "f16"}  # the matmul weights whose CUDA kernels the engine follows


def kernel_for(n_tokens: int) -> str:
    """The kernel a quantized weight's matmul of ``n_tokens`` tokens runs on this GPU."""
    return "mmvq" if n_tokens <= MMVQ_MAX_TOKENS else "mmq"


def round_half_away(v: np.ndarray) -> np.ndarray:
    """CUDA's ``roundf``: to the nearest integer, halves away from zero."""
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def quantize_q8_1(x: np.ndarray, kernel: str, weight_type: str) -> Q8_1:
    """``x`` (tokens, values) quantized as ``kernel`` does before a ``weight_type`` weight."""
    if x.shape[-1] % QK:
        raise NotEmulatedError(f"rows of {x.shape[-1]} values do not split into blocks of 32")
    b = np.asarray(x, dtype=np.float32).reshape(len(x), -1, QK)
    amax = np.abs(b).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kernel == "mmvq":
            d = amax / np.float32(127)
            q = np.where(amax[..., None] > 0, round_half_away(b / d[..., None]), 0)
            scale = f16(d)
        else:
            d_inv = np.float32(127) / amax
            q = np.where(amax[..., None] > 0, round_half_away(b * d_inv[..., None]), 0)
            d = np.where(amax > 0, np.float32(1) / d_inv, np.float32(0))
            scale = d.astype(np.float64) if weight_type in MMQ_FLOAT_SCALE else f16(d)
    total = b.sum(axis=-1, dtype=np.float32)
    return Q8_1(q.astype(np.float64), scale, f16(total))


def linear(x: np.ndarray, weights: Weights, name: str, kernel: str) -> np.ndarray:
    """x @ Wᵀ as ``kernel`` (``mmvq`` or ``mmq``) computes it on an H200, for a weight of
    one of the EMULATED types; x is (tokens, values)."""
    kind = weights.type_of(name).lower()
    if kind not in EMULATED:
        raise NotEmulatedError(f"CUDA's kernels for {kind} weights")
    a = quantize_q8_1(x, kernel, kind)
    if kind not in OFFSET_TYPES:  # q8_0, q6_K: d·n exactly, no offset
        return a.values @ weights[name].T
    return by_rows(weights, name, len(x), partial(_block_products, a, kind, kernel))


def _block_products(
    a: Q8_1, kind: str, kernel: str, n: np.ndarray, scale: np.ndarray, offset: np.ndarray
) -> np.ndarray:
    if kernel == "mmvq" and kind in ("q4_1", "q5_1"):
        return _mmvq_rounded_products(a, n, scale, offset)
    if kernel == "mmq" and kind in ("q4_k", "q5_k"):
        scale, offset = f16(scale), f16(offset)
    if kind not in USES_SUM[kernel]:  # the offset meets d·Σq: the plain products
        a = Q8_1(a.q, a.scale, a.scale * a.q.sum(axis=-1))
    # the kernel's integer products scaled per block: A·n + B exactly, not ggml's float32
    return a.products(n, scale, offset)


def _mmvq_rounded_products(
    a: Q8_1, n: np.ndarray, scale: np.ndarray, offset: np.ndarray, rows_at_once: int = 256
) -> np.ndarray:
    """MMVQ's q4_1 and q5_1 dot product, Σ_blocks f16(d_w·d_a)·Σ n·q + f16(m_w·s_a)."""
    y = np.empty((len(a.q), len(n)))
    for start in range(0, len(n), rows_at_once):
        part = slice(start, start + rows_at_once)
        sums = np.einsum("tbj,rbj->trb", a.q, n[part])
        d = f16(a.scale[:, None, :] * scale[part][None])
        m = f16(a.sum[:, None, :] * offset[part][None])
        y[:, part] = (d * sums + m).sum(axis=-1)
    return y


def tf32(x: np.ndarray, nearest: bool) -> np.ndarray:
    """float32 values as TF32 keeps them (10 mantissa bits): the low 13 bits dropped, or
    rounded to nearest even."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    if nearest:
        bits = bits + 0xFFF + ((bits >> 13) & 1)
    return (bits & 0xFFFFE000).astype(np.uint32).view(np.float32).astype(np.float64)


def f32_linear(x: np.ndarray, w: np.ndarray, n_tokens: int) -> np.ndarray:
    """x @ wᵀ for an f32 weight ``w`` as CUDA computes a matmul of ``n_tokens`` tokens:
    MMVF in float32, MMF with truncated TF32 operands, cuBLAS with rounded ones."""
    if n_tokens <= MMVF_MAX_TOKENS:
        return x @ w.T
    nearest = n_tokens > MMF_MAX_TOKENS
    return tf32(x, nearest) @ tf32(w, nearest).T


def f16_linear(x: np.ndarray, w: np.ndarray, n_tokens: int) -> np.ndarray:
    """x @ wᵀ for an f16 weight ``w`` as CUDA computes a matmul of ``n_tokens`` tokens at
    the default precision (ggml_cuda_mul_mat, measured on layer 0 of a tiny model,
    docs/results/cuda-roundings): MMVF with f16 accumulators for one token (every product
    rounded to f16, each thread's products summed in f16: mmvf_weighted_sum), MMF for 2-16
    (the activations rounded to f16, float32 sums), cuBLAS's f16 compute for more (runs of
    16 products added to an f16 accumulator: cublas_f16_weighted_sum)."""
    if n_tokens > MMF_MAX_TOKENS:
        return cublas_f16_weighted_sum(x[None], w.T[None])[0]
    if n_tokens > 1:
        return f16(x) @ w.T
    y = np.empty((len(x), len(w)))
    rows_at_once = max(1, F16_VALUES_AT_ONCE // (2 * mmvf_block_size(x.shape[1]) * len(w)))
    for start in range(0, len(x), rows_at_once):
        rows = slice(start, start + rows_at_once)
        y[rows] = mmvf_weighted_sum(x[None, rows], w.T[None], x.shape[1])[0]
    return y


F16_VALUES_AT_ONCE = 2**24  # MMVF's per-thread accumulators held at once (128 MiB)


# Attention without flash attention (an f16 KV cache): K·Q (``GGML_PREC_F32``) and
# softmax·V (the default precision) are ``ggml_mul_mat`` with the cache's f16 K or V as
# the first operand, so the ubatch's size picks their kernels (ggml_cuda_mul_mat):
# - one token, MMVF: K·Q in float32; softmax·V with f16 accumulators (mmvf_weighted_sum)
# - 2-16 tokens, MMF: Q and the softmax weights rounded to f16, float32 sums (the CPU's)
# - more, cuBLAS: K·Q with Q rounded to TF32; softmax·V with the weights in f16, summed by
#   CUBLAS_COMPUTE_16F in runs of 16 cells into an f16 accumulator (measured:
#   cublas_f16_weighted_sum)
KV_PAD = 256  # llama_kv_cache::get_n_kv: the cells a ubatch sees, padded to a multiple
MMVF_MAX_KV_CELLS = 512  # ggml_cuda_should_use_mmvf: K of more cells (and heads) takes MMF
WARP = 32


def attention_kernel(n_tokens: int, f16_cache: bool = True) -> str:
    """The kernel K·Q and softmax·V of a ubatch of ``n_tokens`` tokens take on this GPU,
    with an f16 KV cache or an f32 one (ggml_cuda_should_use_mmvf: f16 K and V take MMVF
    for one token, f32 ones for up to 3)."""
    if n_tokens <= (1 if f16_cache else MMVF_MAX_TOKENS):
        return "mmvf"
    return "mmf" if n_tokens <= MMF_MAX_TOKENS else "cublas"


# Attention with an f32 KV cache: K·Q and softmax·V take the f32 kernels of f32 weights
# (f32_linear): MMVF in float32, MMF with truncated TF32 operands, cuBLAS
# (ggml_cuda_mul_mat_cublas: compute type F32, the handle in TF32 mode) with rounded ones.
# Every kernel takes both operands as they are: Q and K, the softmax weights and V.
def kv_f32_operand(kernel: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """How ``kernel`` rounds each operand of attention's products with an f32 KV cache
    (None: not at all)."""
    if kernel == "mmvf":
        return None
    return partial(tf32, nearest=kernel == "cublas")


def kv_cells(positions: np.ndarray) -> np.ndarray:
    """The KV cells a one-token ubatch at each position sees (padded; a cache of at
    least that many cells, as every context of a multiple of 256)."""
    return (np.asarray(positions, dtype=np.int64) // KV_PAD + 1) * KV_PAD


def mmvf_block_size(n_cols: int) -> int:
    """launch_mul_mat_vec_f_cuda's threads per row on NVIDIA: the fewest iterations of
    two columns each, the fewest threads among equals."""
    best, fewest = WARP, -(-n_cols // (2 * WARP))
    for size in range(2 * WARP, 257, WARP):
        n_iter = -(-n_cols // (2 * size))
        if n_iter < fewest:
            best, fewest = size, n_iter
    return best


def mmvf_weighted_sum(p: np.ndarray, v: np.ndarray, n_cells: int) -> np.ndarray:
    """softmax·V of one-token rows as MMVF computes it with f16 accumulators (mul_mat_vec_f,
    ``type_acc`` half: the default precision on this GPU): the weights ``p`` (heads, rows,
    keys) rounded to f16; each of the row's threads takes every block-size-th pair of the
    ``n_cells`` cells and sums their products in half2, each product and sum rounded to
    f16 (taken as fused: a multiply and an add without rounding modifiers, which ptxas may
    fuse); the threads' sums added in float32. ``v`` (heads, keys, d) is the f16 cache. Up
    to 512 cells each thread holds one pair: every product rounded to f16, summed in
    float32, which the H200's one-token matmuls of f16 weights (the same kernel) match
    to float32's level (docs/results/cuda-roundings)."""
    heads, rows, keys = p.shape
    span = 2 * mmvf_block_size(n_cells)  # cells one pass of the threads covers
    n_iter = -(-max(n_cells, keys) // span)
    pad = n_iter * span - keys
    weights = np.pad(f16(p), ((0, 0), (0, 0), (0, pad))).reshape(heads, rows, n_iter, span)
    values = np.pad(v, ((0, 0), (0, pad), (0, 0))).reshape(heads, n_iter, span, v.shape[-1])
    out = np.empty((heads, rows, v.shape[-1]))
    for h in range(heads):  # (rows, span, d) at a time
        acc = np.zeros((rows, span, v.shape[-1]))
        for i in range(n_iter):
            acc = f16(acc + weights[h, :, i, :, None] * values[h, i][None])
        out[h] = acc.sum(axis=1)
    return out


# Flash attention (fattn.cu ggml_cuda_get_best_fattn_kernel, f16 K and V): a ubatch of one
# token takes the VEC kernel, in float32 on NVIDIA (fattn-vec.cuh without
# V_DOT2_F32_F16_AVAILABLE); more tokens the MMA_F16 kernel (fattn-mma-f16.cuh): Q in f16
# times the f16 scale (``scale_h2 * make_half2``), K·Q summed in float32, the softmax
# weights exp(S - max - FATTN_KQ_MAX_OFFSET) in float32, summed unrounded into the divisor,
# and rounded to f16 for P·V, whose tensor cores add each run of 16 cells' products to an
# f16 accumulator (``T_C_VKQ``: half2), in cell order; the divisor applied at the end.
# Matched on the H200's layer 0 for prompts of 2-40 tokens (docs/results/cuda-roundings,
# h200-fa/); rows that see more than a tile of cells (32-128 by head size and query
# columns: nbatch_fa) are split among blocks (stream-k), each block's tiles with a running
# maximum and f16 sum (one tile a block where the blocks suffice), the blocks' partials
# folded together in float32 (flash_attn_stream_k_fixup_*): not followed
# (ExactModel.not_followed; docs/results/cuda-roundings/explore-fa-tiles.py tries it).
FATTN_KQ_MAX_OFFSET = float(np.float32(3.0) * np.float32(0.6931))  # fattn-common.cuh
# the fewest KV cells a tile of the MMA kernel holds (nbatch_fa of fattn-mma-f16.cuh's
# configs: 32-128 by head size and query columns): a row at a position below it sees one
# tile, which the engine follows; beyond, by this bound, maybe more than one
FLASH_TILE_MIN = 32


VEC_HEADS = (64, 128, 256)  # fattn.cu:635 can_use_vector_kernel: at most 256, % 64, not 192
TILE_HEADS = (40, 72)  # fattn.cu:638: no tensor-core kernel; the TILE kernel


def flash_kernel(n_tokens: int, head_dim: int, gqa_ratio: int, n_kv_cells: int) -> str:
    """The flash-attention kernel a ubatch of ``n_tokens`` tokens takes on an Ada or later
    NVIDIA GPU (the H200) with f16 K and V and a cache padded to 256 cells
    (ggml_cuda_get_best_fattn_kernel, fattn.cu:541-720): VEC for one token with a head of
    64, 128 or 256, unless more than 4 query heads share each KV head and the head is 256
    or the cache holds 8,192 cells or more (fattn.cu:635-648; with a mask and no ALiBi, as
    the engine's models have: otherwise VEC, :660); MMA_F16 otherwise, heads of 80, 96 and
    112 for one token too. Heads of 40 and 72 take the TILE kernel: not followed."""
    if head_dim in TILE_HEADS:
        raise NotEmulatedError(f"CUDA's flash attention for a head of {head_dim} (its TILE kernel)")
    crowded = gqa_ratio > 4 and (head_dim >= 256 or n_kv_cells >= 8192)
    return "vec" if n_tokens == 1 and head_dim in VEC_HEADS and not crowded else "mma"


def mma_flash_query(q: np.ndarray, scale: float, softcap: float) -> np.ndarray:
    """Q as the MMA_F16 kernel takes it: rounded to f16, then times the f16 scale (the
    scale over the softcap where the model caps its scores) in f16."""
    factor = scale / softcap if softcap else scale
    return f16(f16(q) * f16(np.asarray(factor)))


def mma_flash_sum(scores: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The MMA_F16 kernel's output from its ``scores`` (heads, rows, keys; masked ones
    -inf; soft-capped already) and the f16 ``v`` (heads, keys, d): the weights against the
    row's maximum plus FATTN_KQ_MAX_OFFSET, in f16 and summed as cublas_f16_weighted_sum
    adds them, over the unrounded weights' sum."""
    weights = np.exp(scores - (scores.max(axis=-1, keepdims=True) + FATTN_KQ_MAX_OFFSET))
    return cublas_f16_weighted_sum(weights, v) / weights.sum(axis=-1)[..., None]


CUBLAS_F16_RUN = 16  # cells whose products one step of cuBLAS's f16 GEMM adds at once


def cublas_f16_weighted_sum(
    p: np.ndarray,
    v: np.ndarray,
    run_cells: int = CUBLAS_F16_RUN,
    acc: np.ndarray | None = None,
) -> np.ndarray:
    """softmax·V of more than MMF_MAX_TOKENS rows as cuBLAS computes it at the default
    precision (ggml_cuda_mul_mat_cublas_impl: CUBLAS_COMPUTE_16F, an f16 result that
    ggml converts to float32): the weights ``p`` (heads, rows, keys, from the cache's first
    cell) rounded to f16; the products of each run of ``run_cells`` cells summed, and each
    run's sum added in cell order to an f16 accumulator, every addition rounded to f16.
    cuBLAS's source is not public: this is what the H200 gives at 40 tokens and 256 cells,
    exactly on 7 of 9 tiny models' layer 0 and within one output of 256 on the others, and
    what its f16 matmuls of 40 tokens give, exactly (docs/results/cuda-roundings); for other
    shapes cuBLAS may pick another kernel (split K), not measured. Other ``run_cells``
    are the alternatives the measurement rules out. ``acc`` (heads, rows, values) is an f16
    accumulator to go on from, as a flash-attention tile goes on from the last (zero when
    not given)."""
    heads, rows, keys = p.shape
    n_runs = -(-keys // run_cells)
    pad = n_runs * run_cells - keys
    weights = np.pad(f16(p), ((0, 0), (0, 0), (0, pad)))
    values = np.pad(v, ((0, 0), (0, pad), (0, 0)))
    if acc is None:
        acc = np.zeros((heads, rows, v.shape[-1]))
    for start in range(0, n_runs * run_cells, run_cells):
        run = slice(start, start + run_cells)
        acc = f16(acc + weights[:, :, run] @ values[:, run])
    return acc
