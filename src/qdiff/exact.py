"""The exact answer of a GGUF's weights: a plain forward pass in float64 (numpy).

llama.cpp is not exact even on f32 weights: the CPU backend evaluates GELU through an fp16
table, the KV cache is f16 by default, and every backend sums in its own order. This module
computes the model's mathematical definition instead, in float64 throughout: the weights
dequantized exactly as llama.cpp dequantizes them (gguf-py's ``gguf.quants``, checked bit
for bit against the f32 copy llama.cpp writes), RMS norms, RoPE angles, the attention
softmax and the activation (Gemma: the tanh-approximated GELU, computed exactly), with no
KV-cache rounding. float64 has 2^29 times finer rounding than float32, so against any
llama.cpp run its own error is nil.

It follows llama.cpp's graph for each architecture it supports (``ARCHITECTURES``; the
source of truth is llama.cpp's ``src/models/<arch>.cpp``), and reads the hyperparameters
with llama.cpp's defaults, so the same file means the same model. An architecture it does
not support raises ``UnsupportedArchitecture``: the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class Architecture:
    name: str
    neox_rope: bool  # rotate (i, i + d/2) pairs; else adjacent (2i, 2i + 1) pairs
    activation: str  # of the gated feed-forward: "silu" or "gelu" (tanh approximation)
    embed_scale: bool  # multiply the embeddings by sqrt(n_embd)
    qk_norm: bool  # RMS-normalise each head of Q and K (before RoPE)
    post_norms: bool  # RMS norms after attention and after the feed-forward (Gemma)
    sliding_window: bool  # local layers see only the last n_swa positions (every 6th is global)
    query_scale: bool  # Q scaled by 1/sqrt(head_dim) before attention (Gemma), not the scores


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture(
            "llama",
            neox_rope=False,
            activation="silu",
            embed_scale=False,
            qk_norm=False,
            post_norms=False,
            sliding_window=False,
            query_scale=False,
        ),
        Architecture(
            "gemma3",
            neox_rope=True,
            activation="gelu",
            embed_scale=True,
            qk_norm=True,
            post_norms=True,
            sliding_window=True,
            query_scale=True,
        ),
    )
}
GEMMA3_SWA_PATTERN = 6  # llama.cpp: load_swa_pattern(ml, 6) when the file names none


@dataclass(frozen=True)
class Hparams:
    arch: Architecture
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    eps: float
    rope_base: float
    rope_scale: float  # llama.cpp's freq_scale: 1 / the linear scaling factor
    rope_base_swa: float
    n_swa: int  # 0: no sliding window
    swa_layers: tuple[bool, ...]
    softcap: float  # final logit soft-capping; 0: none

    def rope(self, layer: int) -> tuple[float, float]:
        """(base, scale) of a layer's RoPE: local (sliding-window) layers have their own base."""
        if self.swa_layers[layer]:
            return self.rope_base_swa, 1.0
        return self.rope_base, self.rope_scale


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise UnsupportedArchitectureError(f"the file has no {key}")
        return default
    values = [field.parts[i] for i in field.data]
    if len(values) == 1:
        value = values[0]
        return value.tobytes().decode() if value.dtype == np.uint8 else value.item()
    return [v.item() for v in values]


def read_hparams(reader: Any) -> Hparams:
    """The hyperparameters as llama.cpp reads them, with llama.cpp's defaults."""
    name = _field(reader, "general.architecture")
    if name not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"qdiff's exact engine supports {', '.join(ARCHITECTURES)}, not {name!r}"
        )
    arch = ARCHITECTURES[name]

    def key(k: str, default: Any = None) -> Any:
        return _field(reader, f"{name}.{k}", default)

    n_embd, n_head, n_layer = (
        key("embedding_length"),
        key("attention.head_count"),
        key("block_count"),
    )
    head_dim = key("attention.key_length", n_embd // n_head)
    scaling = key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0)
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise UnsupportedArchitectureError(f"RoPE scaling {scaling_type!r} is not supported")
    n_swa = key("attention.sliding_window", 0) if arch.sliding_window else 0
    pattern = key("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN) if n_swa else 0
    if isinstance(pattern, list):
        swa_layers = tuple(bool(x) for x in pattern)
    else:
        swa_layers = tuple(bool(n_swa) and (il % pattern < pattern - 1) for il in range(n_layer))
    vocab = reader.fields.get("tokenizer.ggml.tokens")
    return Hparams(
        arch=arch,
        n_vocab=key("vocab_size", len(vocab.data) if vocab else 0),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=key("attention.head_count_kv", n_head),
        head_dim=head_dim,
        n_rot=key("rope.dimension_count", head_dim),
        eps=key("attention.layer_norm_rms_epsilon"),
        rope_base=key("rope.freq_base", 10000.0),
        rope_scale=1.0 / scaling if scaling else 1.0,
        rope_base_swa=key("rope.freq_base_swa", 10000.0),  # llama_hparams' default
        n_swa=n_swa,
        swa_layers=swa_layers,
        softcap=key("final_logit_softcapping", 0.0),
    )


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


def reference(
    model: Path, teacher_run: dict[str, Any], teacher_slices: np.ndarray | None, top_k: int
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The exact logits along the teacher's text: full-vocabulary first-step logits per
    prompt, and at every position the forced passes keep (the teacher's ``teacher_slices``
    token ids, or the exact top-``top_k`` without them) the same summaries as a forced pass
    (qdiff.forcing), in float64. The prompts' tokens are llama.cpp's, from the teacher's run.

    Also the first step with two of llama.cpp's CPU roundings applied
    (``first_logits_cpu_roundings``): the fp16 GELU table where the model uses GELU, and the
    f16 KV cache as the CPU's attention without flash attention uses it. How much of a CPU
    f32 run's distance from exact they explain is then measured, not assumed."""
    import resource
    import time

    from qdiff.forcing import ForcedRecorder

    start = time.perf_counter()
    exact = ExactModel(model)
    prompts = teacher_run["prompts"]
    max_len = max((len(p["tokens"]) for p in prompts), default=0)
    k = teacher_slices.shape[-1] if teacher_slices is not None else min(top_k, exact.hp.n_vocab)
    recorder = ForcedRecorder(len(prompts), max_len, k, dtype=np.float64)
    first = np.zeros((len(prompts), exact.hp.n_vocab))
    first_cpu = np.zeros_like(first)
    forward_s = 0.0
    for p, prompt in enumerate(prompts):
        tokens, forced = prompt["prompt_tokens"], prompt["tokens"]
        sequence = tokens + forced[:-1]  # the last forced token predicts nothing kept
        began = time.perf_counter()
        logits = exact.forward(sequence, slice(len(tokens) - 1, len(sequence)))
        forward_s += time.perf_counter() - began
        first[p] = logits[0]
        recorder.begin_prompt(p, len(tokens), forced)
        for t in range(len(forced)):
            recorder.add(p, t, logits[t], None if teacher_slices is None else teacher_slices[p, t])
        exact.gelu, exact.f16_kv = gelu_fp16_table, True
        first_cpu[p] = exact.forward(tokens, slice(len(tokens) - 1, len(tokens)))[0]
        exact.gelu, exact.f16_kv = gelu_tanh, False
    hp = exact.hp
    record = {
        "architecture": hp.arch.name,
        "hparams": {
            "n_embd": hp.n_embd,
            "n_layer": hp.n_layer,
            "n_head": hp.n_head,
            "n_head_kv": hp.n_head_kv,
            "head_dim": hp.head_dim,
            "n_vocab": hp.n_vocab,
            "rope_base": hp.rope_base,
            "rope_base_swa": hp.rope_base_swa,
            "n_swa": hp.n_swa,
            "swa_layers": list(hp.swa_layers),
        },
        "weight_types": exact.weights.types(),
        "prompt_ids": [p["id"] for p in prompts],
        "n_positions": int(recorder.arrays["lengths"].sum()),
        "top_k": int(k),
        "timings": {
            "total_s": round(time.perf_counter() - start, 3),
            "forward_s": round(forward_s, 3),
        },
        # Linux reports kilobytes
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    return record, {
        **recorder.arrays,
        "first_logits": first,
        "first_logits_cpu_roundings": first_cpu,
    }


BASE_MEMORY = 256 * 2**20  # the interpreter and numpy, before any weight
READER_BYTES_PER_TOKEN = 2560  # gguf-py's reader holds every vocabulary entry as arrays


def memory_needed(model: Path, n_prompts: int, max_positions: int) -> int:
    """Bytes ``reference`` needs for ``model`` along ``n_prompts`` prompts of at most
    ``max_positions`` tokens, read off the file's tensor shapes before anything is loaded:
    every weight in float64 (they are kept), the float32 copy of the largest one while it
    is converted, the full-vocabulary logits it keeps and computes, the GGUF reader (which
    parses the whole vocabulary: about 2.5 KiB a token, measured on Gemma 3's 262,144) and
    a base. tests/test_gemma.py checks it against the peak resident memory of the default
    experiment's models: never below, and within 1.5x."""
    import gguf

    reader = gguf.GGUFReader(model)
    sizes = [int(t.n_elements) for t in reader.tensors]
    vocab = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(vocab.data) if vocab is not None else 0
    logits = 8 * n_vocab * (2 * n_prompts + max_positions)
    reader_bytes = READER_BYTES_PER_TOKEN * n_vocab
    return 8 * sum(sizes) + 4 * max(sizes, default=0) + logits + reader_bytes + BASE_MEMORY


def main(argv: list[str]) -> int:
    """``python -m qdiff.exact SPEC OUT``: ``reference`` in a process of its own, so that
    the kernel's out-of-memory killer ends this process alone and its supervisor records
    it (workflow/scripts/exact_reference.py). Writes ``OUT/record.json`` and
    ``OUT/exact.npz``, or ``OUT/error.json`` (with ``kind`` "unsupported" for an
    architecture the engine does not have)."""
    from qdiff.io import load_arrays, read_json, save_arrays, write_json

    spec, out = read_json(Path(argv[0])), Path(argv[1])
    run = read_json(Path(spec["teacher_run"]))
    slices = load_arrays(Path(spec["teacher_data"]))["slice_ids"] if spec["teacher_data"] else None
    try:
        record, arrays = reference(Path(spec["model"]), run, slices, spec["top_k"])
    except UnsupportedArchitectureError as exc:
        write_json(out / "error.json", {"kind": "unsupported", "message": str(exc)})
        return 3
    except MemoryError:
        write_json(
            out / "error.json",
            {"kind": "memory", "message": "the float64 engine ran out of memory (MemoryError)"},
        )
        return 1
    save_arrays(out / "exact.npz", arrays)
    write_json(out / "record.json", record)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
