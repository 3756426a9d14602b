"""Which of llama.cpp's rounding sources a combination has, and the sets of switches that
measure them (qdiff.exact.roundings follows each in float64). Pure Python: the Snakefile
plans with it without loading NumPy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

FA_TILE_Q = 64  # ggml-cpu/common.h GGML_FA_TILE_Q: query rows of the tiled flash-attention path


class NotEmulatedError(ValueError):
    """A rounding the engine does not follow (a weight type, a KV cache type, a backend)."""


@dataclass(frozen=True)
class Roundings:
    activations: bool = False
    kv_f16: bool = False
    qp_f16: bool = False
    flash_cpu: bool = False
    gelu_table: bool = False
    cuda_activations: bool = False
    cuda_tf32: bool = False
    cuda_f16: bool = False  # f16 weights' kernels: MMVF, MMF or cuBLAS's f16 compute
    # CUDA's attention without flash attention, by the kernels each ubatch's size picks:
    # with an f16 KV cache, or with an f32 one (TF32 products)
    cuda_attention: bool = False
    cuda_attention_kv_f32: bool = False
    cuda_flash: bool = False  # CUDA's flash attention: VEC for one token, MMA_F16 for more
    # Vulkan without matrix cores (qdiff.exact.vulkan): weights' matmuls above 8 tokens
    # with f16 operands (f16 sums but for f32 weights), and attention above one token (Q
    # and the softmax weights in f16, softmax·V summed in f16)
    vulkan_matmul: bool = False
    vulkan_attention: bool = False
    # the same with an f32 KV cache: K and V copied to f16 for mul_mm (above one token),
    # kept in float32 by the matrix-vector shaders (one token)
    vulkan_attention_kv_f32: bool = False
    vulkan_flash: bool = False  # its flash attention (flash_attn.comp's scalar path)
    # a Vulkan device with integer dot products: quantized weights' activations in q8_1
    # (mul_mat_vecq up to 8 tokens, mul_mmq beyond); with vulkan_matmul, the others' too
    vulkan_int_dot: bool = False
    # the f32 copy's weights: every matmul weight is f32 (the file's values), so it takes
    # the f32 kernels (on CUDA: MMVF, MMF or cuBLAS), not the file's type's
    f32_copy: bool = False
    n_ubatch: int = 512  # decides which rows take flash attention's one-row path
    # >0: the seed of a float32-sized perturbation of every rounding's input (``jittered``)
    jitter: int = 0

    def __post_init__(self) -> None:
        if sum((self.cuda_attention, self.cuda_attention_kv_f32, self.cuda_flash)) > 1:
            raise ValueError(
                "cuda_attention (f16 KV cache), cuda_attention_kv_f32 and cuda_flash "
                "exclude each other"
            )
        if sum((self.vulkan_attention, self.vulkan_attention_kv_f32, self.vulkan_flash)) > 1:
            raise ValueError(
                "vulkan_attention (f16 KV cache), vulkan_attention_kv_f32 and vulkan_flash "
                "exclude each other"
            )

    @property
    def by_ubatch(self) -> bool:
        """Whether the ubatch's size changes what these switches compute (CPU flash
        attention's path, CUDA's kernels)."""
        return (
            self.flash_cpu
            or self.cuda_activations
            or self.cuda_tf32
            or self.cuda_f16
            or self.cuda_attention
            or self.cuda_attention_kv_f32
            or self.cuda_flash
            or self.vulkan_matmul
            or self.vulkan_attention
            or self.vulkan_attention_kv_f32
            or self.vulkan_flash
            or self.vulkan_int_dot
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Roundings:
        return cls(**values)


JITTER_SEEDS = (1, 2)  # two draws: the floor is the larger of their distances
JITTER = 2.0**-20  # about the error of a float32 sum of 256 terms (16 ulps), relative


SOURCE_LABELS = {
    "activations": "activations quantized",
    "kv_f16": "f16 K/V cache",
    "qp_f16": "f16 Q and softmax weights",
    "flash_cpu": "flash attention's f16 Q and accumulator",
    "gelu_table": "fp16 GELU table",
    "cuda_activations": "CUDA's q8_1 activations (MMVQ, MMQ)",
    "cuda_tf32": "CUDA's TF32 products of f32 weights",
    "cuda_f16": "CUDA's f16 weights (f16 activations; f16 products for one token, f16 sums for more than 16)",
    "cuda_attention": "CUDA's attention (f16 softmax weights; f16 products for one token, f16 sums for more than 16)",
    "cuda_attention_kv_f32": "CUDA's attention with an f32 KV cache (TF32 products above 3 tokens)",
    "cuda_flash": "CUDA's flash attention (above one token: f16 Q and softmax weights, f16 sums)",
    "vulkan_matmul": (
        "Vulkan's matmuls above 8 tokens (f16 operands; f16 sums but for f32 weights)"
    ),
    "vulkan_attention": (
        "Vulkan's attention above one token (f16 Q and softmax weights, softmax·V summed in f16)"
    ),
    "vulkan_attention_kv_f32": (
        "Vulkan's attention with an f32 KV cache (above one token: K and V copied to f16, f16 Q "
        "and softmax weights, softmax·V summed in f16)"
    ),
    "vulkan_flash": (
        "Vulkan's flash attention (f16 Q, softmax weights and output; split cells joined in float32)"
    ),
    "vulkan_int_dot": (
        "Vulkan's matmuls with integer dot products (q8_1 activations for quantized weights; "
        "f16 operands above 8 tokens for the others)"
    ),
}
# what the engine does not follow (yet) of a backend's arithmetic, by the key the engine
# notes where a pass met it (ExactModel.not_followed): a residual above the floor is
# expected there (docs/gpu-arithmetic.md)
NOT_FOLLOWED_LABELS = {
    "cuda_flash_tiles": (
        "flash attention beyond its first tile of KV cells (32-128 by head size: the MMA "
        "kernel's running maximum and f16 sum over each block's tiles, the blocks' partials "
        "folded in float32)"
    ),
}


def ubatch_of(settings: dict[str, Any]) -> int:
    """The most tokens llama.cpp computes at once: n_ubatch, or n_batch where smaller."""
    return min(settings.get("n_batch", 512), settings.get("n_ubatch", 512))


def sources_of(
    settings: dict[str, Any], dequant: str, int_dot: bool = False
) -> dict[str, Roundings]:
    """The rounding sources of one combination (its device's recorded settings and its
    file), each alone; ``int_dot``: those of a Vulkan device with integer dot products.
    Every CPU source is named; those that change nothing for a model (the GELU table of a
    SiLU model, activations before f32 weights) are dropped later, when the model's
    architecture and weight types are read. Raises NotEmulatedError where the engine does
    not follow the backend's roundings."""
    backend = settings["backend"]
    if backend not in ("cpu", "cuda", "vulkan"):
        raise NotEmulatedError(f"the {backend} backend's roundings are not emulated yet")
    if settings.get("extra_bufts"):
        raise NotEmulatedError("repacked weights (extra_bufts: true) are not emulated")
    if dequant not in ("none", "f32"):
        raise NotEmulatedError(f"the {dequant} copy's weights are not the file's")
    kv = settings.get("kv_cache_type", "f16")
    if kv not in ("f16", "f32"):
        raise NotEmulatedError(f"a {kv} KV cache is not emulated")
    flash = bool(settings.get("flash_attn"))
    n_ubatch = ubatch_of(settings)
    if backend == "cuda":
        return _cuda_sources(dequant, kv, flash, n_ubatch)
    if backend == "vulkan":
        return _vulkan_sources(dequant, kv, flash, n_ubatch, int_dot)
    sources = {"gelu_table": Roundings(gelu_table=True)}
    if dequant == "none":
        sources["activations"] = Roundings(activations=True)
    # flash attention takes f16 K and V: llama-graph.cpp casts an f32 cache's to f16
    if kv == "f16" or flash:
        sources["kv_f16"] = Roundings(kv_f16=True)
        if flash:
            sources["flash_cpu"] = Roundings(flash_cpu=True, n_ubatch=n_ubatch)
        else:
            sources["qp_f16"] = Roundings(qp_f16=True)
    return sources


def _cuda_sources(dequant: str, kv: str, flash: bool, n_ubatch: int) -> dict[str, Roundings]:
    """CUDA's sources on an H200 that the engine follows (qdiff.exact.cuda): the q8_1
    activations of the quantized file's matmuls, the kernels of its f16 weights (dropped
    later where it has none), the TF32 products of f32 weights, the
    f16 K/V (stored, or cast for flash attention) and, without flash attention,
    attention's kernels for the cache's type; ``not_followed`` lists the rest."""
    # f32 weights, of the file or, every one of them, of its f32 copy; the kernels by the
    # size of each ubatch
    tf32 = Roundings(cuda_tf32=True, f32_copy=dequant == "f32", n_ubatch=n_ubatch)
    sources = {"cuda_tf32": tf32}
    if dequant == "none":
        sources["cuda_activations"] = Roundings(cuda_activations=True, n_ubatch=n_ubatch)
        sources["cuda_f16"] = Roundings(cuda_f16=True, n_ubatch=n_ubatch)
    if kv == "f16" or flash:
        sources["kv_f16"] = Roundings(kv_f16=True)
    if flash:
        sources["cuda_flash"] = Roundings(cuda_flash=True, n_ubatch=n_ubatch)
    else:
        name = "cuda_attention" if kv == "f16" else "cuda_attention_kv_f32"
        sources[name] = Roundings(**{name: True}, n_ubatch=n_ubatch)
    return sources


def _vulkan_sources(
    dequant: str, kv: str, flash: bool, n_ubatch: int, int_dot: bool
) -> dict[str, Roundings]:
    """Vulkan's sources on a device with f16 arithmetic and no matrix cores, with integer
    dot products (``int_dot``) or without (qdiff.exact.vulkan; a run on another device's
    path has no budget: qdiff.compare.budget): the weights' matmuls (the f32 copy's all of
    f32, which integer dot products do not change), the f16 K/V cache and attention, or
    flash attention; with an f32 cache, attention as it reads that cache."""
    if kv == "f32" and flash:
        raise NotEmulatedError("Vulkan's flash attention with an f32 KV cache is not emulated yet")
    f32_copy = dequant == "f32"
    matmul = Roundings(vulkan_matmul=True, f32_copy=f32_copy, n_ubatch=n_ubatch)
    name = "vulkan_matmul"
    if int_dot and not f32_copy:
        name, matmul = "vulkan_int_dot", replace(matmul, vulkan_int_dot=True)
    if kv == "f32":
        attention = Roundings(vulkan_attention_kv_f32=True, n_ubatch=n_ubatch)
        return {name: matmul, "vulkan_attention_kv_f32": attention}
    attention_name = "vulkan_flash" if flash else "vulkan_attention"
    return {
        name: matmul,
        "kv_f16": Roundings(kv_f16=True),
        attention_name: Roundings(**{attention_name: True}, n_ubatch=n_ubatch),
    }


# a Vulkan device whose shaders the engine follows (qdiff.exact.vulkan), by the properties
# ggml_vulkan prints for it: f16 arithmetic and no matrix cores (coopmat1, coopmat2: other
# kernels); with integer dot products or without (``vulkan_int_dot``)
VULKAN_FOLLOWED = {"fp16": "1", "matrix cores": "none"}
# vendors whose one-token matmuls take q8_1 only for some types and K
# (ggml_vk_should_use_mmvq), where the engine follows the rule of the others (lavapipe)
VULKAN_MMVQ_VENDORS = ("NVIDIA", "AMD", "Radeon", "Intel")


def vulkan_device(provenance: dict[str, Any]) -> dict[str, str] | None:
    """ggml_vulkan's line for the Vulkan device a run used (its provenance), if recorded."""
    used = {d["name"] for d in provenance.get("used_devices", [])}
    found = [d for d in provenance.get("vulkan_devices", []) if d["device"] in used]
    return found[0] if found else None


def vulkan_int_dot(provenance: dict[str, Any]) -> bool:
    """Whether the run's Vulkan device reported integer dot products."""
    return (vulkan_device(provenance) or {}).get("int dot") == "1"


def vulkan_path_problem(provenance: dict[str, Any], n_ubatch: int = 512) -> str | None:
    """Why the engine does not follow the Vulkan device a run used (its provenance; the
    run's ubatch of ``n_ubatch`` tokens), or None where it does."""
    device = vulkan_device(provenance)
    if device is None:
        return "the run did not record its Vulkan device's properties"
    other = {k: device.get(k, "?") for k, v in VULKAN_FOLLOWED.items() if device.get(k) != v}
    if not other and n_ubatch == 1 and vulkan_int_dot(provenance):
        vendor = next((v for v in VULKAN_MMVQ_VENDORS if v in device["name"]), None)
        if vendor:
            return (
                f"{device['name']}'s one-token matmuls take q8_1 activations only for some "
                f"types and sizes on {vendor} GPUs (ggml_vk_should_use_mmvq); the engine "
                "follows a device of another vendor, which takes them always"
            )
    if not other:
        return None
    followed = ", ".join(f"{k}: {v}" for k, v in VULKAN_FOLLOWED.items())
    return (
        f"{device['name']} takes other Vulkan shaders "
        f"({', '.join(f'{k}: {v}' for k, v in other.items())}); the engine follows those "
        f"of a device with {followed}"
    )


def together(sources: dict[str, Roundings]) -> Roundings:
    """Every source of ``sources`` at once."""
    switched = {
        f.name: any(getattr(r, f.name) for r in sources.values())
        for f in fields(Roundings)
        if f.type == "bool"
    }
    n_ubatch = max((r.n_ubatch for r in sources.values() if r.by_ubatch), default=512)
    return Roundings(**switched, n_ubatch=n_ubatch)


def config_id(r: Roundings) -> str:
    """A name for a set of switches, the same for equal sets (n_ubatch counts only where
    it changes what they compute), used as a key of the engine's outputs."""
    on = [f.name for f in fields(r) if f.type == "bool" and getattr(r, f.name)]
    name = "+".join(on) + (f"@ub{r.n_ubatch}" if r.by_ubatch else "") if on else "exact"
    return name + (f"~{r.jitter}" if r.jitter else "")


def plan(
    combinations: dict[str, tuple[dict[str, Any], str]],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """For a model's combinations (label -> (device settings, dequant)): the engine's sets
    of switches to compute, each once (id -> Roundings fields), and per combination its
    sources (name -> id), all of them at once (``together``: id) and that again with its
    inputs jittered (``jittered``: ids, one per seed: the emulation's floor), or why none
    is emulated (``not_emulated``); for a Vulkan combination whose shaders a device with
    integer dot products changes, the same for such a device (``int_dot``)."""
    configs: dict[str, dict[str, Any]] = {}
    per_combination: dict[str, dict[str, Any]] = {}
    for label, (settings, dequant) in combinations.items():
        try:
            sources = sources_of(settings, dequant)
        except NotEmulatedError as exc:
            per_combination[label] = {"not_emulated": str(exc)}
            continue
        per_combination[label] = _planned(sources, configs)
        # a Vulkan device with integer dot products takes other shaders for a quantized
        # file's matmuls; which device ran is known only from the run's record, so both
        int_dot = sources_of(settings, dequant, int_dot=True)
        if int_dot != sources:
            per_combination[label]["int_dot"] = _planned(int_dot, configs)
    return dict(sorted(configs.items())), per_combination


def _planned(sources: dict[str, Roundings], configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One combination's entry of ``plan`` for ``sources``; their sets added to ``configs``."""
    all_of = together(sources)
    jitters = [replace(all_of, jitter=seed) for seed in JITTER_SEEDS]
    for r in [*sources.values(), all_of, *jitters]:
        configs[config_id(r)] = r.as_dict()
    return {
        "sources": {name: config_id(r) for name, r in sources.items()},
        "together": config_id(all_of),
        "jittered": [config_id(r) for r in jitters],
    }
