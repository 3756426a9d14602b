"""Quantized weights and activations as llama.cpp's integer-dot-product kernels see them
(CUDA's MMVQ and MMQ, Vulkan's mul_mat_vecq and mul_mmq): a weight's rows as A·n + B per
block of 32 values (integers n, a scale A and an offset B, read from the blocks' bytes and
ggml's dequantized values), and activations quantized to q8_1 (integers q per block of 32,
the scale the dot products take and the block sum the offsets meet). Which kernel rounds
what is in qdiff.exact.cuda and qdiff.exact.vulkan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from qdiff.exact.model import Weights

QK = 32  # values per q8_1 block
ROWS_AT_ONCE = 4096  # weight rows whose integers are recovered at once (by_rows)
# bytes per block of the types whose block fields are read (ggml-common.h): an fp16 d
# first; q4_1 and q5_1 then an fp16 m; q4_K and q5_K an fp16 dmin and 12 bytes of scales;
# q6_K 128 bytes of low bits, 64 of high bits, 16 int8 scales, then d
BLOCK_BYTES = {
    "q4_0": 18,
    "q5_0": 22,
    "q4_1": 20,
    "q5_1": 24,
    "q4_k": 144,
    "q5_k": 176,
    "q6_k": 210,
}
OFFSET_TYPES = ("q4_0", "q5_0", "q4_1", "q5_1", "q4_k", "q5_k")  # A·n + B with B != 0


def f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).astype(np.float64)


@dataclass(frozen=True)
class Q8_1:
    """A batch of rows quantized to q8_1 as one kernel keeps them: (tokens, blocks, 32)
    integers ``q``, the scale the dot products take (tokens, blocks), and the f16 block
    sum that the weights' offsets meet (tokens, blocks)."""

    q: np.ndarray
    scale: np.ndarray
    sum: np.ndarray

    @property
    def values(self) -> np.ndarray:
        """The activations as the integer dot products see them, (tokens, values)."""
        v = self.q * self.scale[..., None]
        return v.reshape(len(v), -1)

    def products(self, n: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """Σ over blocks of the integer products scaled, scale·n·q·self.scale, plus the
        offset times the block sum ``self.sum`` (where a kernel takes d·Σq, the sum is
        self.scale·Σq and the result is the plain product): (tokens, rows), for weight rows
        given as integers ``n`` (rows, blocks, 32), ``scale`` and ``offset`` (rows, blocks)."""
        y = self.values @ (scale[..., None] * n + offset[..., None]).reshape(len(n), -1).T
        return y + (self.sum - self.scale * self.q.sum(axis=-1)) @ offset.T


def half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, (rows, blocks) in float64."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_K or q5_K blocks' sub-block scales d·sc and offsets dmin·m, each in float32 as
    ggml computes them (``get_scale_min_k4``), (rows, sub-blocks of 32)."""
    d, dmin = half(blocks, 0), half(blocks, 2)
    s = blocks[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    rows = len(d)
    scale = (d[..., None].astype(np.float32) * sc.astype(np.float32)).reshape(rows, -1)
    offset = (dmin[..., None].astype(np.float32) * m.astype(np.float32)).reshape(rows, -1)
    return scale.astype(np.float64), offset.astype(np.float64)


def q6_k_scales(blocks: np.ndarray) -> np.ndarray:
    """q6_K blocks' scales d·sc of each 16 values (exact in float32: an f16 times an int8),
    (rows, groups of 16)."""
    d = half(blocks, 208)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float64)
    return (d[..., None] * sc).reshape(len(d), -1)


def affine(
    weights: Weights, name: str, rows: slice = slice(None)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of a weight of an OFFSET_TYPES type as A·n + B per block of 32: the integers n
    (rows, blocks, 32), the scale A and the offset B (rows, blocks), recovered from ggml's
    dequantized values."""
    kind = weights.type_of(name).lower()
    blocks = weights.blocks(name)[rows]
    if kind in ("q4_k", "q5_k"):
        scale, offset = k_scales(blocks)
        offset = -offset
    elif kind in ("q4_1", "q5_1"):
        scale, offset = half(blocks, 0), half(blocks, 2)
    else:  # q4_0, q5_0: the integers are centred on 8, 16
        scale = half(blocks, 0)
        offset = -scale * (8 if kind == "q4_0" else 16)
    w = weights[name][rows].reshape(len(scale), -1, QK)
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(scale[..., None] != 0, np.rint((w - offset[..., None]) / scale[..., None]), 0)
    return n, scale, offset


def by_rows(
    weights: Weights,
    name: str,
    n_tokens: int,
    products: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray:
    """``products(n, scale, offset)`` of the weight's affine form (``affine``) taken
    ROWS_AT_ONCE rows at a time (each a float64 copy of those rows): (tokens, rows)."""
    n_rows = len(weights.blocks(name))
    y = np.empty((n_tokens, n_rows))
    for start in range(0, n_rows, ROWS_AT_ONCE):
        rows = slice(start, start + ROWS_AT_ONCE)
        y[:, rows] = products(*affine(weights, name, rows))
    return y


def q6_k_integers(weights: Weights, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A q6_K weight as its integers n (q - 32; rows, groups, 16) and the scale d·sc of
    each group of 16 (rows, groups), recovered from ggml's dequantized values."""
    scale = q6_k_scales(weights.blocks(name))
    w = weights[name].reshape(len(scale), -1, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(scale[..., None] != 0, np.rint(w / scale[..., None]), 0)
    return n, scale
