"""llama.cpp's Vulkan backend on a device with f16 arithmetic and no matrix cores
(``fp16: 1 | int dot: 0 | matrix cores: none`` in ggml_vulkan's device line: Mesa's
lavapipe; with ``int dot: 1``, the q8_1 path at the end), as the float64 engine follows it
(issue 31); a GPU with that line may still fuse its f16 ``fma`` or split mul_mm's K
(K >= 2048 on NVIDIA, AMD and Intel), which the engine does not follow. Read in the
vendored ggml-vulkan (``ggml-vulkan.cpp``, ``vulkan-shaders/mul_mm.comp``,
``dot_product_funcs.glsl``) and held to lavapipe's tensors (docs/results/vulkan-roundings):
the weights' matmuls bit for bit, softmax·V bit for bit from the run's softmax weights,
K·Q and flash attention at float32's level on most values; with integer dot products the
quantized weights' matmuls at float32's level.

- A matmul takes the matrix-vector shaders (float32 throughout) for one token, or for up to
  MAT_VEC_MAX_TOKENS when the batch is one matrix (a weight's matmul;
  ``ggml_vk_mul_mat``); otherwise ``mul_mm.comp``'s scalar path, which stores both
  operands in f16 (``FLOAT_TYPE``) and sums each output's products along K in blocks of
  BK_STEP (4 for f32 and f16 matrices, 2 for quantized ones), each block's last product
  first (``dot_product``'s nested ``fma``): in float32 for f32 matrices and for K·Q
  (``GGML_PREC_F32``), in f16 otherwise (the ``f16acc`` pipelines), where lavapipe rounds
  each product and each sum to f16 (its f16 ``fma`` is not fused).
- Attention's products are batched over heads, so they take ``mul_mm`` from two tokens on:
  K·Q with Q in f16 and float32 sums (which the engine takes in float64: their order is
  within the floor); softmax·V with the softmax weights in f16 and f16 sums over the cells,
  from the cache's first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qdiff.core.roundings import NotEmulatedError
from qdiff.exact.blocks import Q8_1, QK, by_rows, q6_k_integers
from qdiff.exact.roundings import f16

if TYPE_CHECKING:
    from qdiff.exact.model import Weights

# ggml-vulkan.cpp mul_mat_vec_max_cols: a weight's matmul of at most this many tokens takes
# the matrix-vector shaders
MAT_VEC_MAX_TOKENS = 8
# the weight types the engine follows on this path (the scalar mul_mm pipelines' types
# whose dequantization it holds bit for bit: the tiny models' captures)
FOLLOWED = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def block_step(kind: str) -> int:
    """mul_mm.comp's BK_STEP: the products one ``dot_product`` call sums for a matrix of
    ``kind`` (four for f32 and f16, two for quantized types)."""
    return 4 if kind in ("f32", "f16") else 2


F16_NORMAL_MIN = np.float32(2.0**-14)  # below it f16 holds multiples of 2**-24


def round_to_f16(a: np.ndarray) -> None:
    """Round the float32 array ``a`` in place to the nearest f16 value, ties to even (as
    a conversion to f16 and back, about four times faster than numpy's casts): the
    mantissa cut to 10 bits by integer arithmetic, f16's subnormals to multiples of
    2**-24. Values beyond f16's largest (65504) are not made infinite."""
    small = np.abs(a) < F16_NORMAL_MIN
    tiny = a[small] if small.any() else None
    bits = a.view(np.uint32)
    carry = np.right_shift(bits, 13) & np.uint32(1)  # ties to even: add 0xFFF or 0x1000
    carry += np.uint32(0xFFF)
    bits += carry
    bits &= np.uint32(0xFFFFE000)
    if tiny is not None:
        a[small] = np.rint(tiny * np.float32(2.0**24)) * np.float32(2.0**-24)


def ordered_sum(a: np.ndarray, b: np.ndarray, step: int, f16_sums: bool) -> np.ndarray:
    """Σ_k a[k] · b[k] over the operands' leading axis (f16 values; the rest broadcast)
    as mul_mm's scalar path adds them: blocks of ``step`` products along k, each block's
    last product first; with ``f16_sums`` each product and each sum rounded to f16
    (lavapipe's unfused f16 ``fma``), else each sum rounded to float32. In float32, where
    the products of f16 values and the sums of two f16 values are exact or round as the
    direct rounding to f16 would."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    acc = np.zeros(np.broadcast_shapes(a.shape[1:], b.shape[1:]), np.float32)
    product = np.empty_like(acc)
    n = len(a)
    for start in range(0, n, step):
        for k in reversed(range(start, min(start + step, n))):
            np.multiply(a32[k], b32[k], out=product)
            if f16_sums:
                round_to_f16(product)
            acc += product
            if f16_sums:
                round_to_f16(acc)
    return acc.astype(np.float64)


def mul_mm(x: np.ndarray, w: np.ndarray, kind: str) -> np.ndarray:
    """x @ wᵀ as mul_mm.comp's scalar path computes it for weights of ``kind`` (their
    values ``w``, as the file holds them): both operands in f16, f32 weights' products
    summed in float32, the others' in f16."""
    a = np.ascontiguousarray(f16(x).T)[:, :, None]  # (K, rows, 1)
    b = np.ascontiguousarray(f16(w).T)[:, None, :]  # (K, 1, outputs)
    return ordered_sum(a, b, block_step(kind), kind != "f32")


def linear(x: np.ndarray, w: np.ndarray, n_tokens: int, kind: str) -> np.ndarray:
    """The rows ``x`` of a weight's matmul of ``n_tokens`` tokens: float32 (the engine's
    float64) up to MAT_VEC_MAX_TOKENS, mul_mm's scalar path above."""
    return x @ w.T if n_tokens <= MAT_VEC_MAX_TOKENS else mul_mm(x, w, kind)


# On a device with integer dot products (``int dot: 1``) and no matrix cores, a quantized
# weight's matmul first quantizes its activations to q8_1 (``ggml_vk_mul_mat_q_f16``,
# ``ggml_vk_mul_mat_vec_q_f16``: ``quantize_y``), then sums exact integer dot products
# scaled in float32: mul_mat_vecq.comp up to MAT_VEC_MAX_TOKENS tokens (not for q6_K, which
# keeps the float32 matrix-vector shader: ``ggml_vk_should_use_mmvq``), mul_mmq.comp beyond.
# Read in the vendored shaders (quantize_q8_1.comp, mul_mat_vecq_funcs.glsl,
# mul_mmq_funcs.glsl) and held to lavapipe made to report its integer dot products
# (docs/results/vulkan-roundings, lavapipe-int).
INT_DOT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def quantize_q8_1(x: np.ndarray) -> Q8_1:
    """``x`` (tokens, values) as quantize_q8_1.comp keeps it, per block of 32: d = amax/127
    and q = round(x·(1/d)), both in float32 (GLSL's ``round``, ties to even as lavapipe
    rounds them), the scale f16(d) and the sum f16(d·Σq) of the rounded values."""
    if x.shape[-1] % QK:
        raise NotEmulatedError(f"rows of {x.shape[-1]} values do not split into blocks of 32")
    b = np.asarray(x, dtype=np.float32).reshape(len(x), -1, QK)
    d = np.abs(b).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        d_inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(b * d_inv[..., None])
    total = d * q.sum(axis=-1, dtype=np.float32)
    return Q8_1(q.astype(np.float64), f16(d), f16(total))


def int_dot_kernel(n_tokens: int, kind: str) -> str:
    """The shader a ``kind`` weight's matmul of ``n_tokens`` tokens takes on a device with
    integer dot products: ``mmvq`` (mul_mat_vecq), ``mmq`` (mul_mmq) or ``mat_vec`` (the
    float32 matrix-vector shader). One token takes mmvq as on a device of no vendor that
    ggml_vk_should_use_mmvq names (lavapipe): NVIDIA, AMD and Intel take it for one token
    only for some types and K."""
    if n_tokens > MAT_VEC_MAX_TOKENS:
        return "mmq"
    return "mat_vec" if kind == "q6_k" else "mmvq"


def int_dot_linear(
    x: np.ndarray, w: np.ndarray, n_tokens: int, weights: Weights, name: str
) -> np.ndarray:
    """The rows ``x`` of the matmul of ``n_tokens`` tokens with the weight ``name`` (of an
    INT_DOT_TYPES type; ``w``: its values) as a device with integer dot products computes
    them: its q8_1 activations and exact integer products, the offsets of q4_0, q5_0, q4_1,
    q5_1, q4_K and q5_K meeting the f16 block sum; in mul_mmq the K-quants' scales d·sc and
    offsets dmin·m in f16 (``FLOAT_TYPEV2`` on an fp16 device), in mul_mat_vecq float32."""
    kind = weights.type_of(name).lower()
    kernel = int_dot_kernel(n_tokens, kind)
    if kernel == "mat_vec":
        return x @ w.T
    a = quantize_q8_1(x)
    if kind == "q8_0":
        return a.values @ w.T
    if kind == "q6_k":  # mul_mmq only: d·sc of each 16 values in f16
        n, scale = q6_k_integers(weights, name)
        return a.values @ (f16(scale)[..., None] * n).reshape(len(n), -1).T
    if kernel == "mmq" and kind in ("q4_k", "q5_k"):
        return by_rows(weights, name, len(x), lambda n, d, m: a.products(n, f16(d), f16(m)))
    return by_rows(weights, name, len(x), a.products)


def weighted_sum(p: np.ndarray, v: np.ndarray, f16_sums: bool = True) -> np.ndarray:
    """softmax·V of more than one token (``p``: the weights, (heads, queries, cells) from
    the cache's first cell, already rounded to f16; ``v``: the cache's values in f16,
    (heads, cells, d)): mul_mm with V as its matrix, the products summed over the cells in
    f16 (an f16 matrix: an f16 cache, or an f32 one copied to f16), or in float32 (an f32
    cache read in place)."""
    a = np.ascontiguousarray(p.transpose(2, 0, 1))[..., None]  # (cells, heads, queries, 1)
    b = np.ascontiguousarray(v.transpose(1, 0, 2))[:, :, None, :]  # (cells, heads, 1, d)
    return ordered_sum(a, b, block_step("f16"), f16_sums)


# Flash attention's scalar shader (flash_attn.comp, FA_SCALAR: no matrix cores), read in
# the vendored source and matched on lavapipe's captures (docs/results/vulkan-roundings):
# Q·scale in f16; each score K·Q in float32, every lane of a row's D_SPLIT lanes summing
# its own runs of 4 dimensions (the last of each run first) before the lanes' xor
# butterfly; the cells of a tile of `block_cols` shared among the workgroup's column
# groups (cell c to group c % groups), each group with its own running maximum (plus
# FATTN_KQ_MAX_OFFSET), float32 sum L and f16 output O (rescaled in f16, the softmax weight
# and each product with V in f16); the groups then joined in group order, O in f16. Without
# a split O·f16(1/L) in f16; where the cells are split among workgroups (split_k), each
# split's O, L and maximum are joined in float32 (flash_attn_split_k_reduce.comp).
FATTN_KQ_MAX_OFFSET = np.float32(3.0) * np.float32(0.6931)  # flash_attn_base.glsl
WORKGROUP = 32  # lavapipe: a subgroup of 8, four subgroups (get_fa_tuning_params_scalar)
SUBGROUP = 8
CORES = 16  # the placeholder core count split_k assumes where the device gives none
SPARSE_MIN_CELLS = 4096  # from here, a sparse path for one token or grouped heads


def flash_layout(head_dim: int) -> tuple[int, int]:
    """(lanes a row's dimensions are split among, column groups of a workgroup):
    get_fa_tuning_params_scalar's d_split on this device, and WORKGROUP / d_split."""
    lowest = head_dim & -head_dim
    lanes = min(SUBGROUP, 8, lowest // 4)
    return lanes, WORKGROUP // lanes


def flash_split(
    n_tokens: int, n_kv: int, n_head: int, n_head_kv: int, head_dim: int
) -> tuple[int, int]:
    """(the cells of a tile, the cells of a split: n_kv where none) for a ubatch of
    ``n_tokens`` over ``n_kv`` cells (ggml_vk_flash_attn, get_fa_tuning_params_scalar,
    with four subgroups of 8 and no core count)."""
    ratio = n_head // n_head_kv
    if n_kv >= SPARSE_MIN_CELLS and (n_tokens == 1 or (n_tokens <= 8 and ratio > 1)):
        raise NotEmulatedError(f"Vulkan's sparse flash attention ({n_kv} KV cells)")
    rows, groups_y = n_tokens, n_head
    # up to 8 tokens the query heads of one KV head become a workgroup's rows
    max_gqa = min(_block_rows(512, head_dim, n_kv), 32)
    grouped = n_tokens <= 8 and 1 < ratio <= max_gqa
    if grouped:
        rows, groups_y = ratio, n_head_kv
    # matched on heads of 64: a head that is not a multiple of 32 splits its dimensions
    # among fewer lanes, and from 4 rows a head above 64 splits the workgroup by rows
    # (row_split 4, one column group), neither checked on a capture
    if head_dim % 32 or (rows >= 4 and head_dim > 64):
        raise NotEmulatedError(
            f"Vulkan's flash attention for a head of {head_dim} over {rows} rows"
        )
    block_cols = 64 if rows == 1 or head_dim & 8 else 32
    split_k = 1
    if grouped and n_tokens <= _block_rows(rows, head_dim, n_kv):
        split_k = 2 * CORES // (n_tokens * groups_y)
    elif not grouped:
        workgroups = -(-rows // _block_rows(rows, head_dim, n_kv)) * groups_y
        split_k = 2 * CORES // workgroups if workgroups < 2 * CORES else 1
    if split_k <= 1:
        return block_cols, n_kv
    split_kv = -(-max(1, n_kv // split_k) // block_cols) * block_cols
    return block_cols, split_kv


def _block_rows(rows: int, head_dim: int, n_kv: int) -> int:
    """get_fa_tuning_params_scalar's block_rows for ``rows`` query rows (row_split 1 below
    4 rows or for heads of at most 64). Where it would halve them for want of shared
    memory (a cache of 1,024 cells or more, a head without the bit 8) is not followed."""
    if rows == 1:
        return 1
    reduce_rows = bool(head_dim & 8) or n_kv < 1024
    if not reduce_rows:
        raise NotEmulatedError(f"Vulkan's flash attention over {n_kv} KV cells")
    if rows < 4 or head_dim <= 64:
        return 2 if rows == 2 else 4
    return 4 if rows <= 4 else 8


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to f16, kept in float32."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


NEG_FLT_MAX_OVER_2 = np.float32(-np.finfo(np.float32).max / 2)  # a running maximum's start


def _scores(q16: np.ndarray, k: np.ndarray, lanes: int) -> np.ndarray:
    """K·Q in float32 as the shader sums it, (rows, cells, heads): each of the ``lanes``
    lanes adds its runs of 4 dimensions (4·(i·lanes + lane) …, the last of a run first),
    then the lanes' sums meet in an xor butterfly."""
    d = q16.shape[-1]
    k32 = k.astype(np.float32)
    parts = []
    for lane in range(lanes):
        acc = np.zeros((len(q16), len(k), q16.shape[1]), np.float32)
        for run in range(d // (4 * lanes)):
            first = 4 * (run * lanes + lane)
            for dim in reversed(range(first, first + 4)):
                acc += q16[:, None, :, dim] * k32[None, :, :, dim]
        parts.append(acc)
    step = lanes // 2
    while step:
        parts = [parts[t] + parts[t ^ step] for t in range(lanes)]
        step //= 2
    return parts[0]


def _split_pass(
    s: np.ndarray, v16: np.ndarray, cells: range, groups: int, block_cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One split's maximum, sum L and output O (f16 values) per row and head, over
    ``cells`` of the scores ``s`` (rows, cells, heads; masked ones -inf)."""
    rows, _, heads = s.shape
    top = np.full((groups, rows, heads), NEG_FLT_MAX_OVER_2)
    total = np.zeros((groups, rows, heads), np.float32)
    out = np.zeros((groups, rows, heads, v16.shape[-1]), np.float32)
    seen = range(cells.start, min(cells.stop, s.shape[1]))
    for tile in range(cells.start, cells.stop, block_cols):
        for g in range(groups):
            mine = range(tile + g, min(tile + block_cols, seen.stop), groups)
            peak = s[:, mine].max(axis=1) if mine else np.full((rows, heads), -np.inf)
            peak = np.maximum(peak, NEG_FLT_MAX_OVER_2) + FATTN_KQ_MAX_OFFSET
            old = top[g].copy()
            top[g] = np.maximum(peak, old)
            scale = np.exp(old - top[g])
            total[g] *= scale
            out[g] = _f16(_f16(scale)[..., None] * out[g])
            for c in mine:
                p = _f16(np.exp(s[:, c] - top[g]))
                total[g] += p
                out[g] = _f16(out[g] + _f16(p[..., None] * v16[c]))
    # the groups joined in group order: L in float32, O in f16
    peak = top.max(axis=0)
    joined_l = np.zeros((rows, heads), np.float32)
    joined_o = np.zeros_like(out[0])
    for g in range(groups):
        scale = np.exp(top[g] - peak)
        joined_l = joined_l + scale * total[g]
        joined_o = _f16(joined_o + _f16(_f16(scale)[..., None] * out[g]))
    return peak, joined_l, joined_o


def flash_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    masked: np.ndarray,
    scale: float,
    softcap: float,
    split: tuple[int, int, int],
) -> np.ndarray:
    """The rows of one ubatch (``q``: (rows, heads, d)) over the cells ``k``, ``v``
    ((cells, heads, d), f16 values, expanded to the query heads; ``masked``: (rows,
    cells)) as flash_attn.comp's scalar path computes them; ``split`` = (cells of a
    tile, cells of a split, the cache's cells n_kv: flash_split)."""
    block_cols, split_kv, n_kv = split
    lanes, groups = flash_layout(q.shape[-1])
    factor = np.float32(scale / softcap if softcap else scale)
    s = _scores(_f16(q.astype(np.float32) * factor), k, lanes)
    if softcap:
        s = np.float32(softcap) * np.tanh(s)
    s[np.broadcast_to(masked[:, :, None], s.shape)] = -np.inf
    v16 = v.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if split_kv >= n_kv:
            _, total, out = _split_pass(s, v16, range(0, n_kv), groups, block_cols)
            rcp = np.where(total == 0, np.float32(0), np.float32(1) / total)
            return _f16(out * _f16(rcp)[..., None]).astype(np.float64)
        parts = [
            _split_pass(s, v16, range(lo, lo + split_kv), groups, block_cols)
            for lo in range(0, n_kv, split_kv)
        ]
        # flash_attn_split_k_reduce.comp, in float32: a subgroup's lanes take the splits in
        # turn, their L summed in a tree; O summed in split order
        peak = np.max([p[0] for p in parts], axis=0)
        lane_l = [np.zeros_like(peak) for _ in range(SUBGROUP)]
        for i, (m, total, _) in enumerate(parts):
            lane_l[i % SUBGROUP] = lane_l[i % SUBGROUP] + np.exp(m - peak) * total
        step = SUBGROUP // 2
        while step:
            lane_l = [
                lane_l[t] + lane_l[t + step] if t < step else lane_l[t] for t in range(SUBGROUP)
            ]
            step //= 2
        total = lane_l[0]
        out = np.zeros_like(parts[0][2])
        for m, _, o in parts:
            out = out + np.exp(m - peak)[..., None] * o
        rcp = np.where(total == 0, np.float32(0), np.float32(1) / total)
        return (out * rcp[..., None]).astype(np.float64)
