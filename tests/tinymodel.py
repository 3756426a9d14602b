"""Write tiny but real GGUF models for tests: a random-weight llama with an SPM vocab.

llama.cpp loads and runs these like any other model; they take milliseconds per token.
The vocabulary is synthetic (byte fallback tokens plus common pieces), so no vocab file
has to be fetched.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

WORDS = [
    "the",
    "is",
    "a",
    "of",
    "and",
    "to",
    "in",
    "What",
    "Rust",
    "capital",
    "France",
    "Once",
    "upon",
    "time",
    "there",
    "was",
    "def",
    "return",
    "number",
    "question",
    "answer",
    "colors",
    "plants",
    "dragon",
    "village",
    "mountain",
    "Die",
    "Hauptstadt",
    "ist",
]


def spm_vocab(duplicate_piece: bool = False) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁"] + [c for c in string.printable if c.isprintable() and c != " "]
    pieces += [f"▁{w}" for w in WORDS] + WORDS
    pieces = list(dict.fromkeys(pieces))  # llama.cpp aborts on duplicate pieces
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # SPM merges pieces by score: longer pieces win
    scores = [0.0] * (3 + 256) + [float(len(p)) for p in pieces]
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(
    path: Path,
    seed: int = 0,
    n_embd: int = 128,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 256,
    n_ctx: int = 512,
    arch: str = "llama",
    n_head_kv: int | None = None,
    licence: str | None = "cc0-1.0",
) -> Path:
    """Write an F32 GGUF with random weights at ``path``: a llama (or, with ``arch``, a
    file that claims another architecture and has llama's tensors)."""
    return write_tiny_model(
        path, arch, seed, n_embd, n_layer, n_head, n_ff, n_ctx, n_head_kv, licence=licence
    )


def write_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    """Write an F32 gemma3 GGUF with random weights (VARIANTS["gemma3"])."""
    return write_variant(path, "gemma3", seed)


@dataclass(frozen=True)
class Variant:
    """A tiny model of one architecture as its converter writes it (convert_hf_to_gguf.py and
    conversion/*.py at the vendored commit): the tensors and keys that make it that kind."""

    arch: str
    qkv_bias: bool = False  # Qwen2's Q/K/V biases
    fused_qkv: bool = False  # one attn_qkv (Phi-3)
    fused_gate_up: bool = False  # ffn_up holds the gate's rows, then the up rows (Phi-3)
    qk_norm: bool = False  # per-head Q and K norms (Qwen3, Gemma 3)
    post_norms: bool = False  # Gemma's norms after attention and the feed-forward
    tied_output: bool = False  # no output.weight: the embeddings (Gemma, Qwen2.5 small)
    rope_freqs: bool = False  # Llama 3's frequency factors
    longrope: bool = False  # Phi-3's long and short factors, attention factor
    softcaps: bool = False  # Gemma 2's attention and final logit soft-caps
    n_swa: int = 0
    swa_pattern: int = 0
    n_head_kv: int | None = None
    n_layer: int = 2
    router: bool = False  # a MoE file's expert count and router, which no entry follows
    head_dim: int | None = None  # key_length other than n_embd / n_head (Qwen3, Gemma)
    rope_dims: int | None = None  # partial rotary: fewer RoPE dimensions than a head's
    rope_linear: float = 0.0  # linear RoPE scaling of the global layers (Gemma 3's 8)
    output_bias: bool = False


GEMMA3 = Variant(
    "gemma3",
    n_head_kv=1,
    qk_norm=True,
    post_norms=True,
    tied_output=True,
    n_swa=4,
    swa_pattern=2,
    n_layer=3,
)

# one entry per architecture the exact engine knows (tests/test_exact.py checks that every
# entry of qdiff.exact.ARCHITECTURES has one), and llama 3 for its RoPE factors
VARIANTS = {
    "llama": Variant("llama", n_head_kv=2),
    "llama3": Variant("llama", n_head_kv=2, rope_freqs=True),
    "qwen2": Variant("qwen2", n_head_kv=2, qkv_bias=True, tied_output=True),
    "qwen3": Variant("qwen3", n_head_kv=2, qk_norm=True, head_dim=48),
    # one KV head and windows short enough that a test's prompt crosses them; every second
    # layer global (Gemma 3's own pattern is 6: this keeps the model shallow)
    "gemma2": Variant(
        "gemma2", n_head_kv=1, post_norms=True, tied_output=True, softcaps=True, n_swa=4
    ),
    "gemma3": GEMMA3,
    # Gemma 3 4B and larger: linear ×8 RoPE scaling on the global layers only (2 layers:
    # the fp16 GELU table's boundary flips compound with depth)
    "gemma3-4b": dataclasses.replace(GEMMA3, n_layer=2, rope_linear=8.0),
    # Phi-4-mini's partial rotary (3/4 of a head) and grouped KV heads
    "phi3": Variant(
        "phi3",
        n_head_kv=2,
        fused_qkv=True,
        fused_gate_up=True,
        longrope=True,
        n_swa=8,
        rope_dims=24,
    ),
}
SOFTCAPS = (5.0, 3.0)  # attention, final
LONGROPE_ORIGINAL_CONTEXT = 64  # shorter than the tests' context: the long factors apply


def write_variant(path: Path, name: str, seed: int = 0) -> Path:
    v = VARIANTS[name]
    return write_tiny_model(
        path,
        v.arch,
        seed,
        n_layer=v.n_layer,
        n_head_kv=v.n_head_kv,
        n_swa=v.n_swa,
        swa_pattern=v.swa_pattern,
        variant=v,
    )


def write_tiny_model(
    path: Path,
    arch: str,
    seed: int = 0,
    n_embd: int = 128,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 256,
    n_ctx: int = 512,
    n_head_kv: int | None = None,
    n_swa: int = 0,
    swa_pattern: int = 0,
    licence: str | None = "cc0-1.0",  # weights of our own making; the report shows it
    variant: Variant | None = None,
) -> Path:
    n_head_kv = n_head_kv or n_head
    v = variant or VARIANTS.get(arch, VARIANTS["llama"])
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"qdiff-tiny-{seed}" if arch == "llama" else f"qdiff-tiny-{arch}-{seed}")
    if licence is not None:
        writer.add_license(licence)
    shape = Shape(n_embd, n_layer, n_head, n_head_kv, n_ff, v.head_dim, v.rope_dims)
    _hyperparameters(writer, arch, shape, n_ctx, n_swa, swa_pattern, v)
    n_vocab = _tokenizer(writer, arch)
    _tensors(writer, np.random.default_rng(seed), n_vocab, shape, v)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    key_length: int | None = None
    rope_dims: int | None = None

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def n_rot(self) -> int:
        return self.rope_dims or self.head_dim


def _hyperparameters(
    writer: gguf.GGUFWriter,
    arch: str,
    shape: Shape,
    n_ctx: int,
    n_swa: int,
    swa_pattern: int,
    v: Variant,
) -> None:
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.n_rot)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch in ("gemma2", "gemma3", "qwen3"):
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if v.rope_linear:  # Gemma 3 4B and larger: linear ×8 on the global layers only
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(v.rope_linear)
        writer.add_rope_freq_base_swa(1e4)
    if arch in ("gemma2", "gemma3", "qwen2", "qwen3"):
        writer.add_rope_freq_base(1e6)  # gemma3's local layers use 1e4, gemma2's this
    if arch == "llama" and v.rope_freqs:
        writer.add_rope_freq_base(5e5)
    if n_swa:
        writer.add_sliding_window(n_swa)
    if swa_pattern:
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", swa_pattern)
    if v.softcaps:  # Gemma 2 has 50 and 30; the tiny model's scores and logits are smaller
        writer.add_attn_logit_softcapping(SOFTCAPS[0])
        writer.add_final_logit_softcapping(SOFTCAPS[1])
    if v.router:
        writer.add_expert_count(4)
    if v.longrope:
        writer.add_rope_scaling_orig_ctx_len(LONGROPE_ORIGINAL_CONTEXT)
        scale = n_ctx / LONGROPE_ORIGINAL_CONTEXT  # conversion/phi.py's attention factor
        writer.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(scale) / np.log(LONGROPE_ORIGINAL_CONTEXT)))
        )
    writer.add_file_type(0)  # all F32


def _tokenizer(writer: gguf.GGUFWriter, arch: str) -> int:
    """A llama-spm vocabulary; its size. For phi3, Phi-3's <|endoftext|> as well: llama.cpp
    sets its attributes when the model's name says phi3 (llama-vocab.cpp), and aborts
    without it."""
    tokens, scores, types = spm_vocab()
    if arch == "phi3":
        tokens, scores = [*tokens, "<|endoftext|>"], [*scores, 0.0]
        types = [*types, int(gguf.TokenType.CONTROL)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    return len(tokens)


def _tensors(
    writer: gguf.GGUFWriter, rng: np.random.Generator, n_vocab: int, s: Shape, v: Variant
) -> None:
    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def vector(size: int, centre: float = 1.0, spread: float = 0.1) -> np.ndarray:
        return (centre + spread * rng.standard_normal(size)).astype(np.float32)

    # Gemma scales the embeddings by sqrt(n_embd) itself
    embedding = matrix(n_vocab, s.n_embd) * float(np.sqrt(s.n_embd) / 4)
    gemma = v.arch.startswith("gemma")
    writer.add_tensor("token_embd.weight", embedding / (float(np.sqrt(s.n_embd)) if gemma else 1.0))
    writer.add_tensor("output_norm.weight", vector(s.n_embd))
    if not v.tied_output:
        writer.add_tensor("output.weight", matrix(n_vocab, s.n_embd) * 4.0)
    if v.output_bias:
        writer.add_tensor("output.bias", vector(n_vocab, 0.0, 1.0))
    half = s.n_rot // 2
    if v.rope_freqs:  # Llama 3.1's factors run from 1 (fast pairs) to 8 (slow ones)
        writer.add_tensor("rope_freqs.weight", np.geomspace(1, 8, half).astype(np.float32))
    if v.longrope:
        writer.add_tensor("rope_factors_long.weight", vector(half, 3.0, 1.0).clip(1.0))
        writer.add_tensor("rope_factors_short.weight", vector(half, 1.0, 0.05))
    for i in range(s.n_layer):
        _layer_tensors(writer, f"blk.{i}.", matrix, vector, s, v)


def _layer_tensors(
    writer: gguf.GGUFWriter,
    b: str,
    matrix: Callable[[int, int], np.ndarray],
    vector: Callable[[int, float, float], np.ndarray],
    s: Shape,
    v: Variant,
) -> None:
    q_rows, kv_rows = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    writer.add_tensor(b + "attn_norm.weight", vector(s.n_embd, 1.0, 0.1))
    if v.fused_qkv:
        writer.add_tensor(b + "attn_qkv.weight", matrix(q_rows + 2 * kv_rows, s.n_embd))
    for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        if not v.fused_qkv:
            writer.add_tensor(b + f"attn_{name}.weight", matrix(rows, s.n_embd))
        if v.qkv_bias:  # a fused weight may have them too (llama-model.cpp loads them)
            writer.add_tensor(b + f"attn_{name}.bias", vector(rows, 0.0, 0.5))
    writer.add_tensor(b + "attn_output.weight", matrix(s.n_embd, q_rows))
    writer.add_tensor(b + "ffn_norm.weight", vector(s.n_embd, 1.0, 0.1))
    if v.fused_gate_up:
        writer.add_tensor(b + "ffn_up.weight", matrix(2 * s.n_ff, s.n_embd))
    else:
        writer.add_tensor(b + "ffn_gate.weight", matrix(s.n_ff, s.n_embd))
        writer.add_tensor(b + "ffn_up.weight", matrix(s.n_ff, s.n_embd))
    writer.add_tensor(b + "ffn_down.weight", matrix(s.n_embd, s.n_ff))
    if v.router:
        writer.add_tensor(b + "ffn_gate_inp.weight", matrix(4, s.n_embd))
    norms = (["attn_q_norm", "attn_k_norm"] if v.qk_norm else []) + (
        ["post_attention_norm", "post_ffw_norm"] if v.post_norms else []
    )
    for norm in norms:
        size = s.head_dim if norm.startswith("attn_") else s.n_embd
        writer.add_tensor(b + f"{norm}.weight", vector(size, 1.0, 0.1))
