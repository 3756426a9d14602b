"""The architectures the exact engine follows, one entry each, and their hyperparameters as
llama.cpp reads them from a GGUF's metadata (with llama.cpp's defaults where a key is absent).
The source of truth is llama.cpp's ``src/models/<arch>.cpp``."""

from __future__ import annotations

from dataclasses import dataclass
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
