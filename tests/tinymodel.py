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

WORDS = (
    "the is a of and to in What Rust capital France Once upon time there was def return "
    "number question answer colors plants dragon village mountain Die Hauptstadt ist"
).split()


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
) -> Path:
    """Write an F32 llama GGUF with random weights at ``path``."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = spm_vocab()
    n_vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"qdiff-tiny-{seed}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd) * float(np.sqrt(n_embd) / 4))
    writer.add_tensor("output_norm.weight", norm(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd) * 4.0)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm(n_embd))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm(n_embd))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", matrix(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", matrix(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
