"""The architectures the exact engine follows, one entry each, and their hyperparameters as
llama.cpp reads them from a GGUF's metadata (with llama.cpp's defaults where a key is absent).
The source of truth is llama.cpp's ``src/models/<arch>.cpp`` and ``src/llama-model.cpp`` at
the vendored commit; what every architecture shares (optional biases on any matmul, a fused
``attn_qkv``, RoPE frequency factors, an output tied to the embeddings) follows the tensors
the file holds, as llama.cpp's loader does, and is not an entry's business."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class Architecture:
    name: str
    neox_rope: bool  # rotate (i, i + n_rot/2) pairs; else adjacent (2i, 2i + 1) pairs
    activation: str = "silu"  # of the gated feed-forward: "silu" or "gelu" (tanh approximation)
    embed_scale: bool = False  # multiply the embeddings by sqrt(n_embd)
    qk_norm: bool = False  # RMS-normalise each head of Q and K (before RoPE)
    post_norms: bool = False  # RMS norms after attention and after the feed-forward (Gemma)
    query_scale: bool = False  # Q scaled before attention (Gemma, Phi-3), not the scores
    fused_gate_up: bool = False  # ffn_up holds the gate's rows, then the up rows (Phi-3)
    attn_softcap: bool = False  # scores soft-capped: c·tanh(s/c) before the softmax
    final_softcap: float | None = None  # the final logit soft-cap when the file names none;
    #                                     None: the architecture reads no such key
    # sliding-window attention: the window when the file names none (0: only when it does),
    # every `swa_pattern`-th layer global, and the local layers' RoPE when the file names none
    sliding_window: bool = False
    default_n_swa: int = 0
    swa_pattern: int = 0
    swa_rope_from_global: bool = False  # else llama_hparams' default base 10000, scale 1
    large_scale_layers: int = 0  # the layer count of the variant that scales Q by
    #                              1/sqrt(n_embd/n_head), not 1/sqrt(head_dim) (Gemma 27B)
    ignored_keys: tuple[str, ...] = ()  # keys llama.cpp reads and then does not apply


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("llama", neox_rope=False),  # Llama 1-3 (3's rope_freqs), SmolLM, Mistral
        Architecture("qwen2", neox_rope=True),  # Q/K/V biases: tensors of the file
        Architecture("qwen3", neox_rope=True, qk_norm=True),
        Architecture(
            "gemma2",
            neox_rope=True,
            activation="gelu",
            embed_scale=True,
            post_norms=True,
            query_scale=True,
            attn_softcap=True,
            final_softcap=30.0,
            sliding_window=True,
            default_n_swa=4096,
            swa_pattern=2,
            swa_rope_from_global=True,
            large_scale_layers=46,
        ),
        Architecture(
            "gemma3",
            neox_rope=True,
            activation="gelu",
            embed_scale=True,
            qk_norm=True,
            post_norms=True,
            query_scale=True,
            sliding_window=True,
            swa_pattern=6,
            large_scale_layers=62,
            final_softcap=0.0,
        ),
        # sliding_window names a window llama.cpp does not apply (phi3.cpp: "Phi SWA is
        # currently disabled"), so the engine does not either
        Architecture(
            "phi3",
            neox_rope=True,
            query_scale=True,
            fused_gate_up=True,
            ignored_keys=("attention.sliding_window",),
        ),
    )
}
ATTN_SOFTCAP_DEFAULT = 50.0  # llama_hparams.f_attn_logit_softcapping
# keys the engine need not read: sizes its tensors' shapes give, and what changes no logit
NO_EFFECT_KEYS = ("context_length", "feed_forward_length", "rope.scaling.finetuned")
ROPE_SCALING_TYPES = ("none", "linear", "longrope")  # YaRN's ramp is not followed


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
    rope_scale_swa: float
    rope_attn_factor: float  # multiplies RoPE's cos and sin (LongRoPE's attention factor)
    rope_factors: str  # the tensor that divides each pair's frequency, "" for none
    n_swa: int  # 0: no sliding window
    swa_layers: tuple[bool, ...]
    attn_scale: float  # multiplies Q·Kᵀ (or Q, where the architecture scales Q)
    attn_softcap: float  # 0: none
    softcap: float  # final logit soft-capping; 0: none
    unread_keys: tuple[str, ...] = ()  # the file's keys of its architecture the engine ignores

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    def rope(self, layer: int) -> tuple[float, float]:
        """(base, scale) of a layer's RoPE: local (sliding-window) layers have their own."""
        if self.swa_layers[layer]:
            return self.rope_base_swa, self.rope_scale_swa
        return self.rope_base, self.rope_scale


def _field(fields: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value (qdiff.core.gguffile); an array of one value is that value."""
    value = fields.get(key)
    if value is None:
        if default is None:
            raise UnsupportedArchitectureError(f"the file has no {key}")
        return default
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def architecture_of(fields: dict[str, Any]) -> Architecture:
    name = _field(fields, "general.architecture")
    if name not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"qdiff's exact engine supports {', '.join(ARCHITECTURES)}, not {name!r}"
        )
    return ARCHITECTURES[name]


def read_hparams(
    fields: dict[str, Any], tensor_names: set[str], n_ctx: int | None = None
) -> Hparams:
    """The hyperparameters as llama.cpp reads them from a file's metadata (``fields``:
    qdiff.core.gguffile), with llama.cpp's defaults. ``n_ctx``:
    the context a run gives each sequence, which picks LongRoPE's long or short factors."""
    arch = architecture_of(fields)
    read = {f"{arch.name}.{k}" for k in (*NO_EFFECT_KEYS, *arch.ignored_keys)}

    def key(k: str, default: Any = None) -> Any:
        read.add(f"{arch.name}.{k}")
        return _field(fields, f"{arch.name}.{k}", default)

    n_embd, n_head, n_layer = (
        key("embedding_length"),
        key("attention.head_count"),
        key("block_count"),
    )
    head_dim = key("attention.key_length", n_embd // n_head)
    scaling = key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0)
    trained_scale = 1.0 / scaling if scaling else 1.0
    scaling_type = key("rope.scaling.type", "linear")  # llama.cpp's default
    if scaling_type not in ROPE_SCALING_TYPES:
        raise UnsupportedArchitectureError(f"RoPE scaling {scaling_type!r} is not supported")
    # llama.cpp never scales when the type is none; gemma2's local layers copy the trained one
    rope_scale = 1.0 if scaling_type == "none" else trained_scale
    n_swa = key("attention.sliding_window", arch.default_n_swa) if arch.sliding_window else 0
    rope_base = key("rope.freq_base", 10000.0)
    large = n_layer == arch.large_scale_layers
    softcap = key("attn_logit_softcapping", ATTN_SOFTCAP_DEFAULT) if arch.attn_softcap else 0.0
    vocab = fields.get("tokenizer.ggml.tokens")
    if key("attention.value_length", head_dim) != head_dim:
        raise UnsupportedArchitectureError("V heads of another size than K's are not supported")
    hp = Hparams(
        arch=arch,
        n_vocab=key("vocab_size", len(vocab) if vocab else 0),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=key("attention.head_count_kv", n_head),
        head_dim=head_dim,
        n_rot=key("rope.dimension_count", head_dim),
        eps=key("attention.layer_norm_rms_epsilon"),
        rope_base=rope_base,
        rope_scale=rope_scale,
        rope_base_swa=key("rope.freq_base_swa", rope_base if arch.swa_rope_from_global else 1e4),
        rope_scale_swa=trained_scale if arch.swa_rope_from_global else 1.0,
        rope_attn_factor=key("rope.scaling.attn_factor", 1.0),
        rope_factors=_rope_factors(tensor_names, key, n_ctx),
        n_swa=n_swa,
        swa_layers=_swa_layers(key, arch, n_layer, n_swa),
        attn_scale=1.0 / math.sqrt(n_embd / n_head if large else head_dim),
        attn_softcap=softcap,
        softcap=0.0
        if arch.final_softcap is None
        else key("final_logit_softcapping", arch.final_softcap),
    )
    mine = (k for k in fields if k.startswith(f"{arch.name}."))
    return dataclasses.replace(hp, unread_keys=tuple(sorted(set(mine) - read)))


def _swa_layers(key: Any, arch: Architecture, n_layer: int, n_swa: int) -> tuple[bool, ...]:
    """Which layers are local (llama_hparams::set_swa_pattern: pattern 0 makes all local)."""
    if not n_swa:
        return (False,) * n_layer
    pattern = key("attention.sliding_window_pattern", arch.swa_pattern)
    if isinstance(pattern, list):
        return tuple(bool(x) for x in pattern)
    return tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer))


def _rope_factors(tensor_names: set[str], key: Any, n_ctx: int | None) -> str:
    """llama_model::get_rope_factors: ``rope_freqs`` (Llama 3) where the file has it, else
    LongRoPE's long factors when a sequence's context is longer than the original one,
    else its short factors."""
    if "rope_freqs.weight" in tensor_names:
        return "rope_freqs.weight"
    original = key("rope.scaling.original_context_length", key("context_length", 0))
    long = n_ctx is not None and n_ctx > original
    name = "rope_factors_long.weight" if long else "rope_factors_short.weight"
    return name if name in tensor_names else ""
