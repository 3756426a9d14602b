"""llama.cpp's Vulkan backend on a device with f16 arithmetic and neither matrix cores nor
integer dot products (``fp16: 1 | int dot: 0 | matrix cores: none`` in ggml_vulkan's
device line: Mesa's lavapipe, and GPUs without those extensions), as the float64 engine
follows it (issue 31). Read in the vendored ggml-vulkan (``ggml-vulkan.cpp``,
``vulkan-shaders/mul_mm.comp``, ``dot_product_funcs.glsl``) and matched bit for bit on
lavapipe's tensors (docs/results/vulkan-roundings):

- A matmul takes the matrix-vector shaders (float32 throughout) for one token, or for up to
  MAT_VEC_MAX_TOKENS when the batch is one matrix (a weight's matmul;
  ``ggml_vk_mul_mat``); otherwise ``mul_mm.comp``'s scalar path, which stores both
  operands in f16 (``FLOAT_TYPE``) and sums each output's products along K in blocks of
  BK_STEP (4 for f32 and f16 matrices, 2 for quantized ones), each block's last product
  first (``dot_product``'s nested ``fma``): in float32 for f32 matrices and for K·Q
  (``GGML_PREC_F32``), in f16 otherwise (the ``f16acc`` pipelines), where lavapipe rounds
  each product and each sum to f16 (its f16 ``fma`` is not fused).
- Attention's products are batched over heads, so they take ``mul_mm`` from two tokens on:
  K·Q with Q in f16 and float32 sums; softmax·V with the softmax weights in f16 and f16
  sums over the cells, from the cache's first.
"""

from __future__ import annotations

import numpy as np

from qdiff.exact.roundings import f16

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


def f16_weighted_sum(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax·V of more than one token (``p``: the weights, (heads, queries, cells) from
    the cache's first cell, already rounded to f16; ``v``: the f16 cache, (heads, cells,
    d)): mul_mm with V as its f16 matrix, the products summed in f16 over the cells."""
    a = np.ascontiguousarray(p.transpose(2, 0, 1))[..., None]  # (cells, heads, queries, 1)
    b = np.ascontiguousarray(v.transpose(1, 0, 2))[:, :, None, :]  # (cells, heads, 1, d)
    return ordered_sum(a, b, block_step("f16"), True)
