"""Write tiny but real GGUF models for tests: a random-weight llama with an SPM vocab.

llama.cpp loads and runs these like any other model; they take milliseconds per token.
The vocabulary is synthetic (byte fallback tokens plus common pieces), so no vocab file
has to be fetched.
"""

from __future__ import annotations

import string
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


def write_tiny_gemma3(path: Path, seed: int = 0, n_layer: int = 3, n_swa: int = 4) -> Path:
    """Write an F32 gemma3 GGUF with random weights: per-head Q/K norms, post-attention and
    post-feed-forward norms, GELU, one KV head, and a sliding window short enough that a
    test's prompt crosses it. Every second layer is global (layers 0 and 2 local, 1 global):
    Gemma's own pattern is 6, and this keeps the model shallow."""
    return write_tiny_model(
        path, "gemma3", seed, n_layer=n_layer, n_head_kv=1, n_swa=n_swa, swa_pattern=2
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
) -> Path:
    n_head_kv = n_head_kv or n_head
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"qdiff-tiny-{seed}" if arch == "llama" else f"qdiff-tiny-{arch}-{seed}")
    if licence is not None:
        writer.add_license(licence)
    _hyperparameters(
        writer, arch, n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx, n_swa, swa_pattern
    )
    n_vocab = _tokenizer(writer)
    _tensors(
        writer, np.random.default_rng(seed), arch, n_vocab, n_embd, n_layer, n_head, n_head_kv, n_ff
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hyperparameters(
    writer: gguf.GGUFWriter,
    arch: str,
    n_embd: int,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_ctx: int,
    n_swa: int,
    swa_pattern: int,
) -> None:
    head_dim = n_embd // n_head
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(1e6)  # global layers; local layers use llama.cpp's 1e4
        writer.add_sliding_window(n_swa)
        if swa_pattern:
            writer.add_uint32(f"{arch}.attention.sliding_window_pattern", swa_pattern)
    writer.add_file_type(0)  # all F32


def _tokenizer(writer: gguf.GGUFWriter) -> int:
    """A llama-spm vocabulary; its size."""
    tokens, scores, types = spm_vocab()
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
    writer: gguf.GGUFWriter,
    rng: np.random.Generator,
    arch: str,
    n_vocab: int,
    n_embd: int,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
) -> None:
    head_dim = n_embd // n_head
    gemma = arch == "gemma3"

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    # gemma scales the embeddings by sqrt(n_embd) itself
    embedding = matrix(n_vocab, n_embd) * float(np.sqrt(n_embd) / 4)
    writer.add_tensor("token_embd.weight", embedding / (float(np.sqrt(n_embd)) if gemma else 1.0))
    writer.add_tensor("output_norm.weight", norm(n_embd))
    if not gemma:  # gemma ties the output to the embeddings
        writer.add_tensor("output.weight", matrix(n_vocab, n_embd) * 4.0)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm(n_embd))
        writer.add_tensor(f"blk.{i}.attn_q.weight", matrix(n_head * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", matrix(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", matrix(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", matrix(n_embd, n_head * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm(n_embd))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", matrix(n_embd, n_ff))
        if gemma:
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", norm(head_dim))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", norm(head_dim))
            writer.add_tensor(f"blk.{i}.post_attention_norm.weight", norm(n_embd))
            writer.add_tensor(f"blk.{i}.post_ffw_norm.weight", norm(n_embd))
