"""The float64 forward pass: weights dequantized as llama.cpp dequantizes them, and the
model's definition computed exactly (``ExactModel``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from qdiff.exact.architectures import read_hparams


class Weights:
    """The file's tensors, dequantized on first use to float64 and kept."""

    def __init__(self, path: Path) -> None:
        import gguf

        self._gguf = gguf
        self.reader = gguf.GGUFReader(path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._cache: dict[str, np.ndarray] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def float32(self, name: str) -> np.ndarray:
        """A tensor as llama.cpp dequantizes it (float32), numpy's row-major shape."""
        t = self._tensors[name]
        return np.asarray(self._gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = self.float32(name).astype(np.float64)
        return self._cache[name]

    def types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            counts[t.tensor_type.name.lower()] = counts.get(t.tensor_type.name.lower(), 0) + 1
        return counts


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (ggml_gelu, Gemma's gelu_pytorch_tanh), exactly."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def gelu_fp16_table(x: np.ndarray) -> np.ndarray:
    """llama.cpp's CPU GELU (ggml-cpu/vec.h, GGML_GELU_FP16): the input rounded to fp16, the
    value read from a table of fp16 results; zero below -10, the identity above 10. Not the
    exact answer: for measuring how much of a CPU run's distance from exact it explains."""
    table = gelu_tanh(np.asarray(x, dtype=np.float16).astype(np.float64)).astype(np.float16)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, table.astype(np.float64)))


def _f16(x: np.ndarray) -> np.ndarray:
    """Rounded to fp16 (round to nearest even, as ggml's conversions) and back."""
    return np.asarray(x, dtype=np.float16).astype(np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope(
    x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, scale: float, neox: bool
) -> np.ndarray:
    """ggml_rope_ext without YaRN: pair i of each head turns by pos * scale * base^(-2i/n_rot)."""
    half = n_rot // 2
    theta = positions[:, None] * scale * base ** (-2.0 * np.arange(half) / n_rot)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # over heads
    out = x.copy()
    if neox:
        first, second = slice(0, half), slice(half, n_rot)
    else:
        first, second = slice(0, n_rot, 2), slice(1, n_rot, 2)
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x1 * sin + x2 * cos
    return out


class ExactModel:
    """One GGUF, evaluated exactly (see the module's docstring)."""

    def __init__(self, path: Path, cpu_gelu_table: bool = False, cpu_f16_kv: bool = False) -> None:
        """Two of llama.cpp's CPU roundings, to measure how much of a CPU run's distance
        from exact each explains (not exact):
        - ``cpu_gelu_table``: GELU read from llama.cpp's fp16 table;
        - ``cpu_f16_kv``: attention as the CPU computes it with an f16 KV cache and no flash
          attention: K and V stored in f16, Q rounded to f16 for the K product, the softmax
          weights rounded to f16 for the V product (ggml's f16 dot products)."""
        self.weights = Weights(path)
        self.hp = read_hparams(self.weights.reader)
        self.gelu = gelu_fp16_table if cpu_gelu_table else gelu_tanh
        self.f16_kv = cpu_f16_kv
        self.output_name = (
            "output.weight" if "output.weight" in self.weights else "token_embd.weight"
        )

    def _attention(self, x: np.ndarray, layer: int, positions: np.ndarray) -> np.ndarray:
        hp, w, p = self.hp, self.weights, f"blk.{layer}."
        n, d = len(x), hp.head_dim
        q = (x @ w[p + "attn_q.weight"].T).reshape(n, hp.n_head, d)
        k = (x @ w[p + "attn_k.weight"].T).reshape(n, hp.n_head_kv, d)
        v = (x @ w[p + "attn_v.weight"].T).reshape(n, hp.n_head_kv, d)
        if hp.arch.qk_norm:
            q = rms_norm(q, w[p + "attn_q_norm.weight"], hp.eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], hp.eps)
        base, scale = hp.rope(layer)
        q = rope(q, positions, hp.n_rot, base, scale, hp.arch.neox_rope)
        k = rope(k, positions, hp.n_rot, base, scale, hp.arch.neox_rope)
        scale = 1.0 / math.sqrt(d)
        if hp.arch.query_scale:  # Gemma scales Q, llama the scores: the same in float64
            q = q * scale
        if self.f16_kv:
            q, k, v = (_f16(t) for t in (q, k, v))
        distance = positions[:, None] - positions[None, :]
        masked = distance < 0
        if hp.swa_layers[layer]:
            masked |= distance >= hp.n_swa
        group = hp.n_head // hp.n_head_kv
        out = np.empty((n, hp.n_head, d))
        for h in range(hp.n_head):
            scores = q[:, h] @ k[:, h // group].T
            if not hp.arch.query_scale:
                scores = scores * scale
            scores[masked] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            if self.f16_kv:
                probs = _f16(probs)
            out[:, h] = probs @ v[:, h // group]
        y = out.reshape(n, hp.n_head * d) @ w[p + "attn_output.weight"].T
        if p + "attn_output.bias" in w:
            y = y + w[p + "attn_output.bias"]
        return y

    def _feed_forward(self, x: np.ndarray, layer: int) -> np.ndarray:
        w, p = self.weights, f"blk.{layer}."
        gate = x @ w[p + "ffn_gate.weight"].T
        act = self.gelu(gate) if self.hp.arch.activation == "gelu" else silu(gate)
        return (act * (x @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T

    def forward(self, tokens: list[int], outputs: slice) -> np.ndarray:
        """Logits (float64, full vocabulary) at the positions ``outputs`` of ``tokens``, from
        an empty context (positions 0, 1, ...)."""
        hp, w = self.hp, self.weights
        x = w["token_embd.weight"][np.asarray(tokens)]
        if hp.arch.embed_scale:
            x = x * math.sqrt(hp.n_embd)
        positions = np.arange(len(tokens), dtype=np.float64)
        for layer in range(hp.n_layer):
            p = f"blk.{layer}."
            attn = self._attention(rms_norm(x, w[p + "attn_norm.weight"], hp.eps), layer, positions)
            if hp.arch.post_norms:
                attn = rms_norm(attn, w[p + "post_attention_norm.weight"], hp.eps)
            x = x + attn
            ffn = self._feed_forward(rms_norm(x, w[p + "ffn_norm.weight"], hp.eps), layer)
            if hp.arch.post_norms:
                ffn = rms_norm(ffn, w[p + "post_ffw_norm.weight"], hp.eps)
            x = x + ffn
        x = rms_norm(x[outputs], w["output_norm.weight"], hp.eps)
        logits = x @ w[self.output_name].T
        if hp.softcap:
            logits = hp.softcap * np.tanh(logits / hp.softcap)
        return logits
