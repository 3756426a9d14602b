"""llama.cpp's rounding sources, as switches of the float64 engine (qdiff.exact.model).

Each switch applies one rounding that a backend's kernels apply, read from llama.cpp's
source at the commit llama-cpp-python 0.3.36 vendors, and nothing else, so the engine with
a combination's switches on computes what that combination computes up to the order of its
float32 sums. What each switch follows:

- ``activations`` (CPU): a matmul with a quantized weight first quantizes its input rows to
  the weight type's ``vec_dot_type`` (ggml-cpu/ggml-cpu.c ``type_traits_cpu``): Q8_0 for
  Q4_0, Q5_0, Q8_0, IQ4_NL (blocks of 32, ``quantize_row_q8_0``: d = amax/127 stored in
  fp16, round to nearest even); Q8_1 for Q4_1, Q5_1 (the values of Q8_0, and a block sum
  rounded to fp16 that meets the weight's block minimum: ``q8_1_sum_error``); Q8_K for the
  K-quants (blocks of 256, ``quantize_row_q8_K_ref``: iscale = -127/max of the block's
  largest magnitude, d = 1/iscale in float32, values clamped at 127); an f16 or bf16 weight
  rounds its input to f16 or bf16. The integer dot products that follow are exact.
- ``kv_f16``: K and V stored in an f16 KV cache, or cast to f16 for flash attention from an
  f32 one (llama-graph.cpp ``build_attn_mha``).
- ``qp_f16`` (CPU, no flash attention): Q·Kᵀ and P·V are ``ggml_mul_mat`` with an f16
  first operand, so Q and the softmax weights P are rounded to f16 (its vec_dot_type).
- ``flash_cpu`` (CPU flash attention, ggml-cpu/ops.cpp ``ggml_compute_forward_flash_attn_
  ext_f16``): a ubatch of fewer than ``GGML_FA_TILE_Q`` (64) query rows takes the one-row
  path, which rounds Q to f16 and accumulates P·V in an f16 accumulator, rounded after
  every key (``ggml_vec_mad_f16``, ``ggml_vec_scale_f16``); a larger ubatch takes the
  tiled path, float32 throughout but for the stored K and V.
- ``gelu_table`` (CPU): GELU read from an fp16 table (ggml-cpu/vec.h, GGML_GELU_FP16).

CUDA's ``cuda_activations``, ``cuda_tf32``, ``cuda_f16`` (its matmuls), ``cuda_attention`` and
``cuda_attention_kv_f32`` (its attention without flash attention, with an f16 or an f32 KV
cache) and ``cuda_flash`` (its flash attention within one tile of KV cells), each by the
number of tokens of the ubatch, are followed in qdiff.exact.cuda.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qdiff.core.backends import CPU_VEC_DOT_TYPE
from qdiff.core.roundings import FA_TILE_Q, JITTER, NotEmulatedError


def jittered(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x`` with each value moved by up to JITTER (relative), at random: an input llama.cpp
    could as well have computed, in float32 and another order of its sums. Where an input
    lies that close to a rounding boundary (of Q8_0, of f16), the rounding goes either way:
    how much that moves the logits is the floor below which no emulation can be told apart
    from the run (measured on tiny models: the emulation of every CPU source is that far
    from llama.cpp, and so is a jittered emulation from the plain one)."""
    return x * (1.0 + JITTER * rng.uniform(-1.0, 1.0, x.shape))


def f16(x: np.ndarray) -> np.ndarray:
    """Rounded to fp16 (round to nearest even, as ggml's conversions) and back."""
    return np.asarray(x, dtype=np.float16).astype(np.float64)


def bf16(x: np.ndarray) -> np.ndarray:
    """Rounded to bf16 (ggml_compute_fp32_to_bf16: round to nearest even) and back."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32).astype(np.float64)


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    if x.shape[-1] % size:
        raise NotEmulatedError(f"rows of {x.shape[-1]} values do not split into blocks of {size}")
    return np.asarray(x, dtype=np.float32).reshape(*x.shape[:-1], -1, size)


def q8_0(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_0`` (x86 AVX: id = 127/amax) and back: per block of 32, the scale
    d = amax/127 kept in fp16, each value rounded to the nearest integer multiple of it."""
    b = _blocks(x, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0))
    q = np.rint(b * inverse)
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape).astype(np.float64)


def q8_k(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_K_ref`` and back: per block of 256, iscale = -127/max (the value of
    largest magnitude, its sign kept), q = min(127, round(iscale·x)), d = 1/iscale."""
    b = _blocks(x, 256)
    first_largest = np.abs(b).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(b, first_largest, axis=-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(peak != 0, np.float32(-127) / peak, np.float32(0))
        d = np.where(peak != 0, np.float32(1) / iscale, np.float32(0))
    q = np.minimum(np.float32(127), np.rint(iscale * b))
    return (q * d).reshape(x.shape).astype(np.float64)


def q8_1_sum_error(x: np.ndarray) -> np.ndarray:
    """What ``quantize_row_q8_1`` adds to a Q4_1/Q5_1 dot product beyond its Q8_0 values:
    per block of 32, its sum is kept as s = fp16(d·Σq) with the unrounded d, and the dot
    product takes the weight's block minimum times s, not times fp16(d)·Σq. Returns s minus
    the latter, per block (rows, blocks)."""
    b = _blocks(x, 32)
    amax = np.abs(b).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0))
    total = np.rint(b * inverse[..., None]).sum(axis=-1)
    kept = (d * total).astype(np.float16).astype(np.float64)
    return kept - d.astype(np.float16).astype(np.float64) * total


ACTIVATION_ROUNDING = {"f32": None, "f16": f16, "bf16": bf16, "q8_0": q8_0, "q8_1": q8_0}
ACTIVATION_ROUNDING["q8_k"] = q8_k


def round_activations(x: np.ndarray, weight_type: str) -> np.ndarray:
    """A matmul's input as the CPU backend hands it to the dot products with a weight of
    ``weight_type`` (gguf's name, any case)."""
    kind = CPU_VEC_DOT_TYPE.get(weight_type.lower())
    if kind is None:
        raise NotEmulatedError(f"the CPU's activation format for {weight_type} weights")
    rounding = ACTIVATION_ROUNDING[kind]
    return x if rounding is None else rounding(x)


def soft_capped(x: np.ndarray, cap: float) -> np.ndarray:
    """cap·tanh(x/cap) (Gemma 2's attention and final logits); x itself when cap is 0."""
    return cap * np.tanh(x / cap) if cap else x


@dataclass(frozen=True)
class Scores:
    """Attention scores from Q·Kᵀ as llama.cpp forms them: scaled, then soft-capped where
    the architecture caps them (the exact engine and the flash emulation share it)."""

    scale: float
    softcap: float = 0.0

    def __call__(self, qk: np.ndarray) -> np.ndarray:
        return soft_capped(qk * self.scale, self.softcap)


def flash_rows_one_by_one(n_tokens: int, n_ubatch: int) -> np.ndarray:
    """Which of a prompt's rows CPU flash attention computes on its one-row path: those in a
    ubatch of fewer than FA_TILE_Q rows (a prompt is split into ubatches of n_ubatch)."""
    sizes = [min(n_ubatch, n_tokens - start) for start in range(0, n_tokens, n_ubatch)]
    return np.repeat(np.array([s < FA_TILE_Q for s in sizes], dtype=bool), sizes)


def flash_one_row(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, masked: np.ndarray, scores: Scores
) -> np.ndarray:
    """CPU flash attention's one-row path (``ggml_compute_forward_flash_attn_ext_f16_one_
    chunk`` with an f16 K and V): Q rounded to f16, an online softmax over the keys in order,
    and P·V accumulated in f16, rounded after every key. ``q`` (n, heads, d) and ``k``, ``v``
    (n, heads, d) already expanded to the query heads and stored as f16; ``masked`` (n, n)."""
    q = f16(q)
    n, heads, d = q.shape
    top = np.full((n, heads), -np.inf)
    total = np.zeros((n, heads))
    acc = np.zeros((n, heads, d))
    for key in range(n):
        live = ~masked[:, key]
        s = scores(np.einsum("nhd,hd->nh", q, k[key]))
        higher = live[:, None] & (s > top)
        ms = np.where(higher, np.exp(top - s), 1.0)  # exp(-inf) = 0 at the first key
        below = np.where(live[:, None] & ~higher, s - top, 0.0)
        vs = np.where(higher, 1.0, np.exp(below))
        top = np.where(higher, s, top)
        acc = np.where(higher[..., None], f16(acc * ms[..., None]), acc)
        acc = np.where(live[:, None, None], f16(acc + v[key][None] * vs[..., None]), acc)
        total = np.where(live[:, None], total * ms + vs, total)
    return acc / total[..., None]
