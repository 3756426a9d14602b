"""The float64 forward pass: weights dequantized as llama.cpp dequantizes them, and the
model's definition computed exactly (``ExactModel``)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from qdiff.core.gguffile import GGUFFile
from qdiff.core.roundings import NotEmulatedError, Roundings
from qdiff.core.threads import in_shares, shared_rows, sharing
from qdiff.exact import cuda, dequantize, vulkan
from qdiff.exact.architectures import read_hparams
from qdiff.exact.blocks import BLOCK_BYTES
from qdiff.exact.roundings import (
    CPU_VEC_DOT_TYPE,
    Scores,
    f16,
    flash_one_row,
    flash_rows_one_by_one,
    jittered,
    q8_1_sum_error,
    round_activations,
    soft_capped,
)

EXACT = Roundings()  # no rounding source: the exact answer
DEQUANTIZE_VALUES = 2**22  # values dequantized at once (16 MiB of float32)


class Weights:
    """The file's tensors, dequantized on first use to float64 and kept."""

    def __init__(self, path: Path) -> None:
        self.file = GGUFFile(path)
        self._tensors = {t.name: t for t in self.file.tensors}
        self._cache: dict[str, np.ndarray] = {}
        self.read: set[str] = set()  # the tensors a forward pass used
        self.dequantize_s = 0.0  # seconds spent dequantizing, a one-off cost of each tensor

    def unread(self) -> list[str]:
        """The file's tensors no forward pass has used so far, one name for a tensor of
        every layer (``blk.*.name``)."""
        return sorted({re.sub(r"^blk\.\d+\.", "blk.*.", n) for n in set(self._tensors) - self.read})

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def _rows(self, name: str) -> np.ndarray:
        """A tensor's bytes in numpy's row-major shape: (..., the bytes of one row)."""
        t = self._tensors[name]
        return self.file.data(t).reshape(*reversed(t.shape[1:]), -1)

    def float32(self, name: str) -> np.ndarray:
        """A tensor as llama.cpp dequantizes it (float32), numpy's row-major shape."""
        t = self._tensors[name]
        return dequantize.float32(self._rows(name), t.ggml_type, t.shape[0])

    def float64(self, name: str) -> np.ndarray:
        """``float32``'s values in float64, converted DEQUANTIZE_VALUES at a time: a large
        tensor (Gemma 3's 168M-value embeddings) never has a whole float32 copy beside its
        float64 one."""
        t = self._tensors[name]
        rows = self._rows(name)
        flat = rows.reshape(-1, rows.shape[-1])
        out = np.empty((len(flat), t.shape[0]), dtype=np.float64)
        step = max(1, DEQUANTIZE_VALUES // t.shape[0])

        def convert(chunks: slice) -> None:  # ggml's conversion releases the GIL (ctypes)
            for start in range(chunks.start * step, min(chunks.stop * step, len(flat)), step):
                chunk = flat[start : start + step]
                out[start : start + step] = dequantize.float32(chunk, t.ggml_type, t.shape[0])

        # chunks of DEQUANTIZE_VALUES shared among threads: each holds one float32 chunk
        in_shares(convert, -(-len(flat) // step), step * t.shape[0])
        return out.reshape(*rows.shape[:-1], t.shape[0])

    def __getitem__(self, name: str) -> np.ndarray:
        self.read.add(name)
        if name not in self._cache:
            start = time.perf_counter()
            self._cache[name] = self.float64(name)
            self.dequantize_s += time.perf_counter() - start
        return self._cache[name]

    def release(self, prefix: str) -> None:
        """Forget the float64 copies of the tensors whose names start with ``prefix``."""
        for name in [n for n in self._cache if n.startswith(prefix)]:
            del self._cache[name]

    def blocks(self, name: str) -> np.ndarray:
        """A tensor of a BLOCK_BYTES type as its blocks' bytes, (rows, blocks, bytes)."""
        rows = self._rows(name)
        return rows.reshape(len(rows), -1, BLOCK_BYTES[self.type_of(name).lower()])

    def block_minimums(self, name: str) -> np.ndarray:
        """A Q4_1 or Q5_1 tensor's minimum per block of 32 (the fp16 ``m`` that follows each
        block's scale), (rows, blocks) in float64."""
        blocks = self.blocks(name)
        return blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)

    def type_of(self, name: str) -> str:
        return self._tensors[name].type_name

    def types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    def norm(rows: np.ndarray) -> np.ndarray:
        return rows / np.sqrt(np.mean(rows * rows, axis=-1, keepdims=True) + eps) * weight

    return shared_rows(norm, x)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (ggml_gelu, Gemma's gelu_pytorch_tanh), exactly."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def gelu_fp16_table(x: np.ndarray) -> np.ndarray:
    """llama.cpp's CPU GELU (ggml-cpu/vec.h, GGML_GELU_FP16): the input rounded to fp16, the
    value read from a table of fp16 results; zero below -10, the identity above 10. Not the
    exact answer: for measuring how much of a CPU run's distance from exact it explains."""
    table = gelu_tanh(np.asarray(x, dtype=np.float16).astype(np.float64)).astype(np.float16)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, table.astype(np.float64)))


BATCH_TOKENS = 512  # rows a batch of sequences holds (one longer sequence goes alone)


def _ubatch_sizes(n_tokens: int, n_ubatch: int) -> np.ndarray:
    """For each of a sequence's tokens, the size of the ubatch llama.cpp computes it in."""
    sizes = np.full(n_tokens, n_ubatch)
    last = n_tokens % n_ubatch
    if last:
        sizes[n_tokens - last :] = last
    return sizes


def _batches(lengths: list[int]) -> list[list[int]]:
    """The sequences' indices in order, in consecutive batches of at most BATCH_TOKENS rows
    (a longer sequence alone)."""
    batches: list[list[int]] = []
    rows = 0
    for i, n in enumerate(lengths):
        if not batches or rows + n > BATCH_TOKENS:
            batches.append([])
            rows = 0
        batches[-1].append(i)
        rows += n
    return batches


def _spans(lengths: list[int]) -> list[slice]:
    """The rows of each sequence of a batch."""
    ends = np.cumsum(lengths)
    return [slice(int(e - n), int(e)) for e, n in zip(ends, lengths, strict=True)]


ATTENTION_BLOCK = 128  # query rows per block: the keys every row of a block masks are skipped


def _softmax_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    masked: np.ndarray,
    how: Scores,
    weighted_sum: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul,
) -> np.ndarray:
    """softmax(scores(Q·Kᵀ), masked)·V per head (q, k, v: (n, heads, d)); the product with V
    as ``weighted_sum`` (softmax weights (heads, queries, keys), V (heads, keys, d)) computes
    it, where a backend rounds the weights or the sum. Block by block of
    queries, each over the keys some row of the block sees: a causal mask then costs about
    half the full matrix (a masked key adds an exact 0 to the sum it is left out of)."""
    n = len(q)
    out = np.empty((n, q.shape[1], v.shape[2]))
    qh, kh, vh = q.transpose(1, 0, 2), k.transpose(1, 2, 0), v.transpose(1, 0, 2)
    for start in range(0, n, ATTENTION_BLOCK):
        rows = slice(start, min(start + ATTENTION_BLOCK, n))
        seen = np.flatnonzero(~masked[rows].all(axis=0))
        # a backend's rounded sum depends on where each cell lies in the cache: from its
        # first cell then (a masked cell weighs an exact 0)
        first = seen[0] if weighted_sum is np.matmul else 0
        keys = slice(first, seen[-1] + 1) if seen.size else slice(0, masked.shape[1])
        scores = qh[:, rows] @ kh[:, :, keys]  # (heads, queries, keys)
        mask = masked[rows, keys]

        def softmax(heads: slice, scores: np.ndarray = scores, mask: np.ndarray = mask) -> None:
            s = how(scores[heads])
            np.copyto(s, -np.inf, where=mask)
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            scores[heads] = s

        in_shares(softmax, len(scores), scores[0].size)  # element-wise: heads among threads
        out[rows] = weighted_sum(scores, vh[:, keys]).transpose(1, 0, 2)
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return shared_rows(lambda rows: rows / (1.0 + np.exp(-rows)), x)


@dataclass(frozen=True)
class Rope:
    """One layer's ggml_rope_ext without YaRN: pair i of each head turns by
    pos·scale·base^(-2i/n_rot)/factors[i], and the turned pairs are multiplied by
    ``attn_factor`` (rope_yarn's mscale)."""

    n_rot: int
    base: float
    scale: float
    neox: bool
    factors: np.ndarray | None = None
    attn_factor: float = 1.0


def rope(x: np.ndarray, positions: np.ndarray, r: Rope) -> np.ndarray:
    n_rot, half = r.n_rot, r.n_rot // 2
    theta = positions[:, None] * r.scale * r.base ** (-2.0 * np.arange(half) / n_rot)
    if r.factors is not None:
        theta = theta / r.factors
    cos = r.attn_factor * np.cos(theta)[:, None, :]  # over heads
    sin = r.attn_factor * np.sin(theta)[:, None, :]
    out = x.copy()
    if r.neox:
        first, second = slice(0, half), slice(half, n_rot)
    else:
        first, second = slice(0, n_rot, 2), slice(1, n_rot, 2)
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x1 * sin + x2 * cos
    return out


class ExactModel:
    """One GGUF, evaluated exactly (see the module's docstring)."""

    def __init__(
        self,
        path: Path,
        roundings: Roundings = EXACT,
        n_ctx: int | None = None,
        layer_by_layer: bool = False,
    ) -> None:
        """``roundings``: llama.cpp's rounding sources to apply (qdiff.exact.roundings), to
        measure how much of a run's distance from exact each explains; none by default.
        ``n_ctx``: the context the runs give a sequence (it picks LongRoPE's factors).
        ``layer_by_layer``: hold one layer's weights in float64 at a time, not all of them
        (``hidden`` takes every sequence through a layer before the next)."""
        self.layer_by_layer = layer_by_layer
        self.n_ctx = n_ctx
        self.weights = Weights(path)
        self.hp = read_hparams(self.weights.file.fields, set(self.weights.names()), n_ctx)
        # LongRoPE's other set of factors is left out by choice, as llama.cpp leaves it
        self.weights.read |= {"rope_factors_long.weight", "rope_factors_short.weight"}
        self.roundings = roundings
        # how many tokens the run's matmul holds, per row of the batch in hand (CUDA's
        # kernels differ by it); and whether the run asks for each prompt's last logits
        # only, so that its last layer's feed-forward and output see one row a prompt
        self.row_tokens: np.ndarray = np.empty(0)
        self.first_step_only = False
        self.output_name = (
            "output.weight" if "output.weight" in self.weights else "token_embd.weight"
        )

    @property
    def roundings(self) -> Roundings:
        return self._roundings

    @roundings.setter
    def roundings(self, value: Roundings) -> None:
        self._roundings, self.rng = value, np.random.default_rng(value.jitter)
        # what the passes with these roundings met and did not follow of the backend's
        # arithmetic (keys of roundings.NOT_FOLLOWED_LABELS)
        self.not_followed: set[str] = set()

    def rounded(self, x: np.ndarray, rounding: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """``rounding(x)``; with ``jitter``, of an input moved by a float32 ulp at random."""
        return rounding(jittered(x, self.rng) if self._roundings.jitter else x)

    def gelu(self, x: np.ndarray) -> np.ndarray:
        if self._roundings.gelu_table:
            return self.rounded(x, gelu_fp16_table)
        return shared_rows(gelu_tanh, x)

    def linear(self, x: np.ndarray, name: str, bias: str | None = None) -> np.ndarray:
        """x @ Wᵀ (+ the bias where the file has one, as llama.cpp's loader takes it: the
        weight's own ``.bias``, or ``bias``), the input rounded as the CPU rounds it for this
        weight's type when the ``activations`` switch is on, as CUDA's kernels do when
        ``cuda_activations`` is (quantized weights), ``cuda_tf32`` (f32 weights) or
        ``cuda_f16`` (f16 weights), as Vulkan's shaders do when ``vulkan_int_dot`` is
        (quantized weights) or ``vulkan_matmul`` (the others, or all of them)."""
        bias = bias or name.removesuffix("weight") + "bias"
        r = self._roundings
        kind = "f32" if r.f32_copy else self.weights.type_of(name)
        if (r.cuda_activations or r.cuda_tf32 or r.cuda_f16) and kind.lower() not in cuda.FOLLOWED:
            raise NotEmulatedError(f"CUDA's matmuls of {kind} weights")
        if r.vulkan_matmul and kind.lower() not in vulkan.FOLLOWED:
            raise NotEmulatedError(f"Vulkan's matmuls of {kind} weights")
        if r.cuda_activations and kind.lower() in cuda.EMULATED:
            y = self._cuda_linear(self.rounded(x, lambda v: v), name)
        elif r.cuda_tf32 and kind == "f32":
            y = self._by_tokens(self.rounded(x, lambda v: v), name, cuda.f32_linear)
        elif r.cuda_f16 and kind.lower() == "f16":
            y = self._by_tokens(self.rounded(x, lambda v: v), name, cuda.f16_linear)
        elif r.vulkan_int_dot and kind.lower() in vulkan.INT_DOT_TYPES:
            kernel = partial(vulkan.int_dot_linear, weights=self.weights, name=name)
            y = self._by_tokens(self.rounded(x, lambda v: v), name, kernel)
        elif r.vulkan_matmul:
            kernel = partial(vulkan.linear, kind=kind.lower())
            y = self._by_tokens(self.rounded(x, lambda v: v), name, kernel)
        elif not r.activations:
            y = x @ self.weights[name].T
        else:
            x = self.rounded(x, lambda v: v)  # jittered once: both roundings below see it
            y = round_activations(x, kind) @ self.weights[name].T
            if CPU_VEC_DOT_TYPE.get(kind) == "q8_1":
                y += q8_1_sum_error(x) @ self.weights.block_minimums(name).T
        return y + self.weights[bias] if bias in self.weights else y

    def _tokens_of_rows(self, n_rows: int) -> np.ndarray:
        """How many tokens the run's matmul holds, per row (``row_tokens``; all of the
        rows where it is not set for them)."""
        rows = self.row_tokens
        return rows if len(rows) == n_rows else np.full(n_rows, n_rows)

    def _by_tokens(
        self,
        x: np.ndarray,
        name: str,
        kernel: Callable[[np.ndarray, np.ndarray, int], np.ndarray],
    ) -> np.ndarray:
        """x @ Wᵀ as ``kernel`` (cuda.f32_linear, cuda.f16_linear) computes the rows of
        each matmul size."""
        tokens = self._tokens_of_rows(len(x))
        y = np.empty((len(x), len(self.weights[name])))
        for n in np.unique(tokens):
            rows = tokens == n
            y[rows] = kernel(x[rows], self.weights[name], int(n))
        return y

    def _cuda_linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ Wᵀ as CUDA's MMVQ or MMQ computes each row, by how many tokens the run's
        matmul holds."""
        tokens = self._tokens_of_rows(len(x))
        few = tokens <= cuda.MMVQ_MAX_TOKENS
        if few.all() or not few.any():
            return cuda.linear(x, self.weights, name, "mmvq" if few.all() else "mmq")
        y_few = cuda.linear(x[few], self.weights, name, "mmvq")
        y = np.empty((len(x), y_few.shape[1]))
        y[few], y[~few] = y_few, cuda.linear(x[~few], self.weights, name, "mmq")
        return y

    def _qkv(self, x: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q, K and V, (n, heads, head_dim): from a fused ``attn_qkv`` (its rows Q, then K,
        then V; llm_graph_context::build_qkv) or from three matrices."""
        hp, p, n = self.hp, f"blk.{layer}.", len(x)
        sizes = (hp.n_head, hp.n_head_kv, hp.n_head_kv)
        if p + "attn_qkv.weight" in self.weights:
            fused = self.linear(x, p + "attn_qkv.weight")
            parts = np.split(fused, np.cumsum([s * hp.head_dim for s in sizes])[:-1], axis=1)
            separate = [p + f"attn_{w}.bias" for w in "qkv"]  # a fused weight's own biases
            if p + "attn_qkv.bias" not in self.weights and all(b in self.weights for b in separate):
                parts = [part + self.weights[b] for part, b in zip(parts, separate, strict=True)]
        else:
            parts = [self.linear(x, p + f"attn_{w}.weight") for w in "qkv"]
        q, k, v = (part.reshape(n, s, hp.head_dim) for part, s in zip(parts, sizes, strict=True))
        return q, k, v

    def _rope_of(self, layer: int) -> Rope:
        hp = self.hp
        base, scale = hp.rope(layer)
        factors = self.weights[hp.rope_factors] if hp.rope_factors else None
        return Rope(hp.n_rot, base, scale, hp.arch.neox_rope, factors, hp.rope_attn_factor)

    def _attention(self, x: np.ndarray, layer: int, lengths: list[int]) -> np.ndarray:
        """Self-attention of a batch of sequences (``x``: their rows one after another, of
        ``lengths``), each from position 0 and seeing only itself."""
        hp, w, p = self.hp, self.weights, f"blk.{layer}."
        n, d = len(x), hp.head_dim
        positions = np.concatenate([np.arange(m, dtype=np.float64) for m in lengths])
        q, k, v = self._qkv(x, layer)
        if hp.arch.qk_norm:
            q = rms_norm(q, w[p + "attn_q_norm.weight"], hp.eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], hp.eps)
        turn = self._rope_of(layer)
        q, k = (shared_rows(partial(rope, r=turn), x, positions) for x in (q, k))
        scale = hp.attn_scale
        if hp.arch.query_scale:  # Gemma and Phi-3 scale Q, llama the scores: float64 agrees
            q, scale = q * scale, 1.0
        r = self._roundings
        if r.kv_f16:
            k, v = self.rounded(k, f16), self.rounded(v, f16)
        heads = np.arange(hp.n_head) // hp.gqa_ratio  # each query head's K/V
        k, v = k[:, heads], v[:, heads]
        scores = Scores(scale, hp.attn_softcap)
        kernels = np.empty(n, dtype=object)
        if r.cuda_attention or r.cuda_attention_kv_f32:
            tokens = self._tokens_of_rows(n)
            kernels = np.array([cuda.attention_kernel(t, r.cuda_attention) for t in tokens])
        elif r.cuda_flash:
            tokens, cells = self._tokens_of_rows(n), cuda.kv_cells(positions)
            kernels = np.array(
                [
                    cuda.flash_kernel(t, d, hp.gqa_ratio, c)
                    for t, c in zip(tokens, cells, strict=True)
                ]
            )
            if ((kernels == "mma") & (positions >= cuda.FLASH_TILE_MIN)).any():
                self.not_followed.add("cuda_flash_tiles")
        elif r.vulkan_attention or r.vulkan_attention_kv_f32:  # mat-vec for one token, mul_mm above
            kernels = np.where(self._tokens_of_rows(n) == 1, "mat_vec", "mul_mm")
        out = np.empty_like(q)
        for rows in _spans(lengths):
            at = positions[rows]
            # (m, m) booleans from the positions' broadcast: no (m, m) array of distances
            masked = at[None, :] > at[:, None]
            if hp.swa_layers[layer]:
                masked |= at[None, :] <= at[:, None] - hp.n_swa
            out[rows] = self._sequence_attention(
                q[rows], k[rows], v[rows], masked, scores, kernels[rows]
            )
        return self.linear(out.reshape(n, hp.n_head * d), p + "attn_output.weight")

    def _sequence_attention(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        masked: np.ndarray,
        scores: Scores,
        kernels: np.ndarray,
    ) -> np.ndarray:
        """One sequence's attention with the switches' roundings (``kernels``: CUDA's, by
        the ubatch of each row)."""
        r = self._roundings
        if r.cuda_attention:
            return self._cuda_attention(q, k, v, masked, scores, kernels)
        if r.cuda_attention_kv_f32:
            return self._cuda_attention_kv_f32(q, k, v, masked, scores, kernels)
        if r.cuda_flash:
            return self._cuda_flash(q, k, v, masked, scores, kernels)
        if r.vulkan_attention or r.vulkan_attention_kv_f32:
            return self._vulkan_attention(q, k, v, masked, scores, kernels)
        if r.vulkan_flash:
            return self._vulkan_flash(q, k, v, masked, scores)
        if r.qp_f16:
            out = _softmax_attention(self.rounded(q, f16), k, v, masked, scores, self._f16_weights)
        else:
            out = _softmax_attention(q, k, v, masked, scores)
        if r.flash_cpu:
            one_by_one = flash_rows_one_by_one(len(q), r.n_ubatch)
            if one_by_one.any():
                q_in = self.rounded(q, np.asarray)  # jittered, rounded to f16 inside
                out[one_by_one] = flash_one_row(q_in, k, v, masked, scores)[one_by_one]
        return out

    def _vulkan_attention(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        masked: np.ndarray,
        scores: Scores,
        kernels: np.ndarray,
    ) -> np.ndarray:
        """One sequence's attention as Vulkan computes each row (qdiff.exact.vulkan):
        nothing rounded in a one-token ubatch (the device's float32, taken in float64);
        above, Q in f16 for K·Q and the softmax weights in f16, summed in f16 over the
        cells, and an f32 cache's K and V copied to f16 (``vulkan_attention_kv_f32``)."""
        out = np.empty((len(q), q.shape[1], v.shape[2]))
        single = kernels == "mat_vec"
        if single.any():
            out[single] = _softmax_attention(q[single], k, v, masked[single], scores)
        if single.all():
            return out
        batched = ~single
        if not self._roundings.vulkan_attention_kv_f32:
            q16 = self.rounded(q[batched], f16)
            out[batched] = _softmax_attention(
                q16, k, v, masked[batched], scores, self._vulkan_weights
            )
            return out
        # an f32 cache: mul_mm takes K and V in f16; V's sums are float32 where the ubatch
        # sees every cell of the cache (V's view then contiguous, read in place as an f32
        # matrix), else f16 (V copied to f16 first, then as an f16 cache's)
        k, v = self.rounded(k, f16), self.rounded(v, f16)
        q16 = self.rounded(q, f16)
        ubatch = np.arange(len(q)) // self._roundings.n_ubatch
        for u in np.unique(ubatch[batched]):
            rows = batched & (ubatch == u)
            seen = min(len(q), (u + 1) * self._roundings.n_ubatch)  # cells after the ubatch
            n_kv = -(-seen // cuda.KV_PAD) * cuda.KV_PAD  # those its graph reads
            weights = self._vulkan_weights if n_kv < self._cache_cells() else self._f32_v_weights
            out[rows] = _softmax_attention(q16[rows], k, v, masked[rows], scores, weights)
        return out

    def _cache_cells(self) -> int:
        """The cells of the run's KV cache (its context, padded as llama.cpp pads it)."""
        if self.n_ctx is None:
            raise NotEmulatedError("Vulkan's reading of an f32 KV cache needs the context's size")
        return -(-self.n_ctx // cuda.KV_PAD) * cuda.KV_PAD

    def _vulkan_flash(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, masked: np.ndarray, scores: Scores
    ) -> np.ndarray:
        """One sequence's flash attention as Vulkan's scalar shader computes it, ubatch by
        ubatch (its split of the cells by the ubatch's size and the cache's padded cells,
        qdiff.exact.vulkan.flash_split)."""
        hp, n = self.hp, len(q)
        out = np.empty((n, q.shape[1], v.shape[2]))
        q_in = self.rounded(q, np.asarray)  # jittered; rounded to f16 inside
        for start in range(0, n, self._roundings.n_ubatch):
            rows = slice(start, min(start + self._roundings.n_ubatch, n))
            seen = rows.stop  # the cells written by this ubatch and those before it
            n_kv = -(-seen // cuda.KV_PAD) * cuda.KV_PAD
            tiles = vulkan.flash_split(
                rows.stop - rows.start, n_kv, hp.n_head, hp.n_head_kv, hp.head_dim
            )
            out[rows] = vulkan.flash_attention(
                q_in[rows],
                k[:seen],
                v[:seen],
                masked[rows, :seen],
                scores.scale,
                scores.softcap,
                (*tiles, n_kv),
            )
        return out

    def _vulkan_weights(self, p: np.ndarray, v: np.ndarray) -> np.ndarray:
        return vulkan.weighted_sum(self.rounded(p, f16), v)

    def _f32_v_weights(self, p: np.ndarray, v: np.ndarray) -> np.ndarray:
        return vulkan.weighted_sum(self.rounded(p, f16), v, f16_sums=False)

    def _f16_weights(self, p: np.ndarray, v: np.ndarray) -> np.ndarray:
        """softmax·V with the weights rounded to f16 and float32 sums (the CPU's f16 V,
        CUDA's MMF)."""
        return self.rounded(p, f16) @ v

    def _cuda_attention(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        masked: np.ndarray,
        scores: Scores,
        kernels: np.ndarray,
    ) -> np.ndarray:
        """One sequence's attention as CUDA computes it without flash attention, each row by
        the kernels its ubatch takes (``kernels``; cuda.attention_kernel) and, on one
        token, the KV cells it sees."""
        out = np.empty_like(q)
        cells = np.where(kernels == "mmvf", cuda.kv_cells(np.arange(len(q))), 0)
        for kernel, n_cells in sorted(set(zip(kernels, cells, strict=True))):
            rows = (kernels == kernel) & (cells == n_cells)
            q_used, weigh = self._cuda_attention_inputs(q[rows], kernel, int(n_cells))
            out[rows] = _softmax_attention(q_used, k, v, masked[rows], scores, weigh)
        return out

    def _cuda_attention_inputs(
        self, q: np.ndarray, kernel: str, n_cells: int
    ) -> tuple[np.ndarray, Callable[[np.ndarray, np.ndarray], np.ndarray]]:
        """Q as ``kernel`` takes it into K·Q, and how it forms softmax·V."""
        if kernel == "mmvf":
            weigh = partial(self._mmvf_weights, n_cells=n_cells)
            # K·Q in MMVF, float32, up to MMVF_MAX_KV_CELLS cells; beyond, MMF's f16 Q
            return (q if n_cells <= cuda.MMVF_MAX_KV_CELLS else self.rounded(q, f16)), weigh
        if kernel == "mmf":
            return self.rounded(q, f16), self._f16_weights
        return self.rounded(q, partial(cuda.tf32, nearest=True)), self._cublas_weights

    def _cuda_attention_kv_f32(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        masked: np.ndarray,
        scores: Scores,
        kernels: np.ndarray,
    ) -> np.ndarray:
        """One sequence's attention as CUDA computes it with an f32 KV cache, each row by
        the kernels its ubatch takes (cuda.kv_f32_operand: Q, K, the softmax weights and V
        as they are, or in TF32)."""
        out = np.empty_like(q)
        for kernel in sorted(set(kernels)):
            rows = kernels == kernel
            operand = cuda.kv_f32_operand(str(kernel))
            if operand is None:
                out[rows] = _softmax_attention(q[rows], k, v, masked[rows], scores)
                continue
            q_used, k_used = self.rounded(q[rows], operand), self.rounded(k, operand)
            v_used = self.rounded(v, operand)

            def weigh(p: np.ndarray, v_part: np.ndarray, operand=operand) -> np.ndarray:
                return self.rounded(p, operand) @ v_part

            out[rows] = _softmax_attention(q_used, k_used, v_used, masked[rows], scores, weigh)
        return out

    def _cuda_flash(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        masked: np.ndarray,
        scores: Scores,
        kernels: np.ndarray,
    ) -> np.ndarray:
        """One sequence's flash attention as CUDA computes it (K and V in f16 already):
        rows of one-token ubatches by the VEC kernel (float32), the others by MMA_F16
        (cuda.mma_flash_query, cuda.mma_flash_sum), blocks of ATTENTION_BLOCK rows over the
        keys from the first cell to the last any of them sees."""
        out = np.empty_like(q)
        vec = kernels == "vec"
        if vec.any():
            out[vec] = _softmax_attention(q[vec], k, v, masked[vec], scores)
        mma = np.flatnonzero(~vec)
        qh = cuda.mma_flash_query(self.rounded(q, np.asarray), scores.scale, scores.softcap)
        qh, kh, vh = qh.transpose(1, 0, 2), k.transpose(1, 2, 0), v.transpose(1, 0, 2)
        for start in range(0, len(mma), ATTENTION_BLOCK):
            rows = mma[start : start + ATTENTION_BLOCK]
            keys = slice(0, int(np.flatnonzero(~masked[rows].all(axis=0)).max()) + 1)
            s = qh[:, rows] @ kh[:, :, keys]
            s = scores.softcap * np.tanh(s) if scores.softcap else s
            s = self.rounded(s, np.asarray)
            np.copyto(s, -np.inf, where=masked[rows, keys])
            out[rows] = cuda.mma_flash_sum(s, vh[:, keys]).transpose(1, 0, 2)
        return out

    def _mmvf_weights(self, p: np.ndarray, v: np.ndarray, n_cells: int) -> np.ndarray:
        return cuda.mmvf_weighted_sum(self.rounded(p, np.asarray), v, n_cells)

    def _cublas_weights(self, p: np.ndarray, v: np.ndarray) -> np.ndarray:
        return cuda.cublas_f16_weighted_sum(self.rounded(p, np.asarray), v)

    def _feed_forward(self, x: np.ndarray, layer: int) -> np.ndarray:
        p = f"blk.{layer}."
        if self.hp.arch.fused_gate_up:  # ggml_swiglu: silu of the first half times the second
            gate, up = np.split(self.linear(x, p + "ffn_up.weight"), 2, axis=1)
        else:
            gate, up = self.linear(x, p + "ffn_gate.weight"), self.linear(x, p + "ffn_up.weight")
        act = self.gelu(gate) if self.hp.arch.activation == "gelu" else silu(gate)
        return self.linear(act * up, p + "ffn_down.weight")

    def forward(self, tokens: list[int], outputs: slice) -> np.ndarray:
        """Logits (float64, full vocabulary) at the positions ``outputs`` of ``tokens``, from
        an empty context (positions 0, 1, ...)."""
        return self.logits(self.hidden([tokens])[0][outputs])

    def first_steps(self, prompts: list[list[int]]) -> np.ndarray:
        """The logits of each prompt's last position (its first step), (prompts, vocab): in
        one expression (np.array copies the last rows), so nothing of the prompts' hidden
        states outlives the call."""
        return self.logits(np.array([h[-1] for h in self.hidden(prompts)]))

    def hidden(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """Each sequence's last layer's output (before the output norm), every sequence
        through one layer before the next, each from an empty context. Sequences go through
        a layer in batches of about BATCH_TOKENS rows: one read of a weight serves them all."""
        with sharing():
            return self._hidden(sequences)

    def _hidden(self, sequences: list[list[int]]) -> list[np.ndarray]:
        hp, w = self.hp, self.weights
        xs = [w["token_embd.weight"][np.asarray(tokens)] for tokens in sequences]
        if hp.arch.embed_scale:
            xs = [x * math.sqrt(hp.n_embd) for x in xs]
        batches = _batches([len(x) for x in xs])
        for layer in range(hp.n_layer):
            xs = [y for batch in batches for y in self._layer([xs[i] for i in batch], layer)]
            if self.layer_by_layer:
                w.release(f"blk.{layer}.")
        return xs

    def _layer(self, xs: list[np.ndarray], layer: int) -> list[np.ndarray]:
        hp, w, p = self.hp, self.weights, f"blk.{layer}."
        lengths = [len(x) for x in xs]
        x = np.concatenate(xs)
        ubatch = self._roundings.n_ubatch
        self.row_tokens = np.concatenate([_ubatch_sizes(n, ubatch) for n in lengths])
        attn = self._attention(rms_norm(x, w[p + "attn_norm.weight"], hp.eps), layer, lengths)
        if hp.arch.post_norms:
            attn = rms_norm(attn, w[p + "post_attention_norm.weight"], hp.eps)
        x = x + attn
        if self.first_step_only and layer == hp.n_layer - 1:
            # llama.cpp's last layer takes only the output rows on (ggml_get_rows): one
            self.row_tokens = np.ones(len(x), dtype=int)
        ffn = self._feed_forward(rms_norm(x, w[p + "ffn_norm.weight"], hp.eps), layer)
        if hp.arch.post_norms:
            ffn = rms_norm(ffn, w[p + "post_ffw_norm.weight"], hp.eps)
        return np.split(x + ffn, np.cumsum(lengths)[:-1])

    def logits(self, x: np.ndarray) -> np.ndarray:
        """The full vocabulary's logits of last-layer outputs ``x`` (rows of ``hidden``)."""
        with sharing():
            return self._logits(x)

    def _logits(self, x: np.ndarray) -> np.ndarray:
        self.row_tokens = np.ones(len(x), dtype=int) if self.first_step_only else np.empty(0)
        x = rms_norm(x, self.weights["output_norm.weight"], self.hp.eps)
        logits = self.linear(x, self.output_name, bias="output.bias")  # tied or not
        return soft_capped(logits, self.hp.softcap)
