"""The exact answer along the teacher's text (``reference``), its memory estimate
(``memory_needed``), and the child process that computes it (``python -m
qdiff.exact.reference SPEC OUT``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.core.backends import CPU_VEC_DOT_TYPE
from qdiff.core.gguffile import GGUFFile
from qdiff.core.roundings import NotEmulatedError, Roundings
from qdiff.exact import cuda, vulkan
from qdiff.exact.architectures import Hparams, UnsupportedArchitectureError, read_hparams
from qdiff.exact.model import ATTENTION_BLOCK, BATCH_TOKENS, DEQUANTIZE_VALUES, ExactModel


def reference(
    model: Path,
    teacher_run: dict[str, Any],
    teacher_slices: np.ndarray | None,
    top_k: int,
    layer_by_layer: bool = False,
    n_top: int = 2,
    keep_first: bool = True,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The exact logits along the teacher's text: full-vocabulary first-step logits per
    prompt, and at every position the forced passes keep (the teacher's ``teacher_slices``
    token ids, or the exact top-``top_k`` without them) the same summaries as a forced pass
    (qdiff.compare.forced), in float64. The prompts' tokens are llama.cpp's, from the
    teacher's run. ``layer_by_layer``: see ExactModel; ``n_top``: see ForcedRecorder;
    ``keep_first``: False leaves the first-step logits out (a text's windows need none)."""
    import time

    from qdiff.core.forced import ForcedRecorder

    start = time.perf_counter()
    exact = ExactModel(model, n_ctx=context_of(teacher_run), layer_by_layer=layer_by_layer)
    prompts = teacher_run["prompts"]
    max_len = max((len(p["tokens"]) for p in prompts), default=0)
    k = teacher_slices.shape[-1] if teacher_slices is not None else min(top_k, exact.hp.n_vocab)
    recorder = ForcedRecorder(len(prompts), max_len, k, dtype=np.float64, n_top=n_top)
    first = np.zeros((len(prompts) if keep_first else 0, exact.hp.n_vocab))
    began = time.perf_counter()  # the weights are read and dequantized as the layers need them
    # the last forced token predicts nothing kept
    hidden = exact.hidden([p["prompt_tokens"] + p["tokens"][:-1] for p in prompts])
    for p, prompt in enumerate(prompts):
        tokens, forced = prompt["prompt_tokens"], prompt["tokens"]
        logits = exact.logits(hidden[p][len(tokens) - 1 :])
        if keep_first:
            first[p] = logits[0]
        recorder.begin_prompt(p, len(tokens), forced)
        recorder.add_rows(
            p, logits[: len(forced)], None if teacher_slices is None else teacher_slices[p]
        )
    forward_s = time.perf_counter() - began
    record = {
        "architecture": exact.hp.arch.name,
        "hparams": hparams_record(exact.hp),
        # what the file holds that the engine's answer leaves out (the report names them)
        "unread": {"keys": list(exact.hp.unread_keys), "tensors": exact.weights.unread()},
        "weight_types": exact.weights.types(),
        "prompt_ids": [p["id"] for p in prompts],
        "n_positions": int(recorder.arrays["lengths"].sum()),
        "top_k": int(k),
        "timings": {
            "total_s": round(time.perf_counter() - start, 3),
            "forward_s": round(forward_s, 3),
            # of forward_s: the weights' dequantization, once a tensor, whatever the text's length
            "dequantize_s": round(exact.weights.dequantize_s, 3),
        },
        "peak_rss_mib": _peak_rss_mib(),
        "layer_by_layer": layer_by_layer,
    }
    return record, {**recorder.arrays, **({"first_logits": first} if keep_first else {})}


def emulate(
    model: Path,
    teacher_run: dict[str, Any],
    configs: dict[str, dict[str, Any]],
    layer_by_layer: bool = False,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The first step of every prompt with each set of llama.cpp's rounding sources
    (``configs``: a name -> Roundings fields; qdiff.exact.roundings) switched on in the
    float64 engine: one array of full-vocabulary logits per name (a set the engine cannot
    follow for this model's weights is left out, ``not_emulated`` says why; what a set's
    passes met and did not follow, ``not_followed``). The record says which sets can
    change anything for this model (``applies``: _changes_anything); those that cannot
    are not computed: each takes the engine's answer with no switch on, computed once."""
    import time

    start = time.perf_counter()
    exact = ExactModel(model, n_ctx=context_of(teacher_run), layer_by_layer=layer_by_layer)
    exact.first_step_only = True  # as the runs' first step: the last logits of each prompt
    prompts = teacher_run["prompts"]
    matmul_types = {t for t in exact.weights.types() if t != "f32"}
    has_f32 = _has_f32_matrices(exact)
    applies = {
        name: _changes_anything(Roundings.from_dict(values), exact, matmul_types, has_f32)
        for name, values in configs.items()
    }

    def first_steps(roundings: Roundings) -> np.ndarray:
        exact.roundings = roundings
        return exact.first_steps([p["prompt_tokens"] for p in prompts])

    arrays, not_emulated, not_followed = {}, {}, {}
    plain = None  # the engine with no switch on: what every set that changes nothing gives
    for done, (name, values) in enumerate(configs.items(), 1):
        began = time.perf_counter()
        if not applies[name]:
            plain = first_steps(Roundings()) if plain is None else plain
            arrays[name] = plain
        else:
            try:
                arrays[name] = first_steps(Roundings.from_dict(values))
            except NotEmulatedError as exc:  # this set only (CUDA's switches before bf16)
                not_emulated[name] = str(exc)
            else:
                if exact.not_followed:  # e.g. CUDA's flash attention beyond its first tile
                    not_followed[name] = sorted(exact.not_followed)
        seconds = time.perf_counter() - began  # progress, for a user watching the log
        print(f"[qdiff] roundings {done}/{len(configs)}: {name} ({seconds:.1f} s)", file=sys.stderr)
    record = {
        "prompt_ids": [p["id"] for p in prompts],
        "configs": configs,
        "applies": applies,
        "not_emulated": not_emulated,
        "not_followed": not_followed,
        "activation_formats": sorted({CPU_VEC_DOT_TYPE.get(t, t).upper() for t in matmul_types}),
        "timings": {"total_s": round(time.perf_counter() - start, 3)},
        "peak_rss_mib": _peak_rss_mib(),
        "layer_by_layer": layer_by_layer,
    }
    return record, arrays


def _changes_anything(
    r: Roundings, exact: ExactModel, matmul_types: set[str], has_f32: bool
) -> bool:
    """Whether a set of switches can change anything for this model: the GELU table only
    where it uses GELU, the activations' rounding only before weights that are not f32,
    CUDA's f32 kernels only where a matmul has f32 weights (``has_f32``; every one in the
    f32 copy), its f16 kernels only where a weight is f16; Vulkan's always (every weight's
    matmul takes mul_mm above 8 tokens, attention above one), its integer dot products
    only before quantized weights."""
    quantized = {t.lower() for t in matmul_types}
    return (
        r.kv_f16
        or r.qp_f16
        or r.flash_cpu
        or r.cuda_attention
        or r.cuda_attention_kv_f32
        or r.cuda_flash
        or r.vulkan_matmul
        or r.vulkan_attention
        or r.vulkan_attention_kv_f32
        or r.vulkan_flash
        or (r.gelu_table and exact.hp.arch.activation == "gelu")
        or (r.activations and bool(quantized))
        or (r.cuda_activations and bool(quantized & cuda.EMULATED))
        or (r.vulkan_int_dot and bool(quantized & set(vulkan.INT_DOT_TYPES)) and not r.f32_copy)
        or (r.cuda_tf32 and (r.f32_copy or has_f32))
        or (r.cuda_f16 and "f16" in quantized and not r.f32_copy)
    )


def _has_f32_matrices(exact: ExactModel) -> bool:
    """Whether a matmul of the model has an f32 weight (the embeddings only where the
    output reuses them: otherwise they are looked up, not multiplied)."""
    return any(
        t.type_name == "f32"
        and len(t.shape) >= 2
        and (t.name != "token_embd.weight" or exact.output_name == t.name)
        for t in exact.weights.file.tensors
    )


def context_of(teacher_run: dict[str, Any]) -> int:
    """The context llama.cpp gave the teacher's one sequence (it picks LongRoPE's factors):
    ``generation.n_ctx`` padded to a multiple of 256, as llama_context pads it."""
    n_ctx = int(teacher_run["generation"]["n_ctx"])
    return -(-n_ctx // 256) * 256


def _peak_rss_mib() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB


def hparams_record(hp: Hparams) -> dict[str, Any]:
    """The hyperparameters a reference was computed with, as its record states them."""
    fields = ("n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_rot", "n_vocab")
    rope = ("rope_base", "rope_scale", "rope_base_swa", "rope_scale_swa", "rope_attn_factor")
    attention = ("n_swa", "attn_scale", "attn_softcap", "softcap")
    return {
        **{f: getattr(hp, f) for f in (*fields, *rope, *attention)},
        "rope_factors": hp.rope_factors or None,
        "swa_layers": list(hp.swa_layers),
    }


BASE_MEMORY = 160 * 2**20  # the interpreter, numpy and OpenBLAS before any weight: about 37
#   MiB measured on the 2-core AMD EPYC (docs/results/bench-epyc/base-memory.log), allowing
#   about four times that for other machines' libraries
METADATA_BYTES_PER_ENTRY = 64  # the parsed metadata (qdiff.core.gguffile) per value of an
#   array (a vocabulary's token, score, type, merge): 57-58 bytes of resident memory
#   measured on Gemma 3's 786,465 values and SmolLM2's 147,234
DEQUANTIZING = 4 * DEQUANTIZE_VALUES  # bytes beside the float64 kept while a tensor is
#   dequantized: one chunk's float32 values (Weights.float64; the file's pages are counted
#   whole)


@dataclass(frozen=True)
class Workload:
    """What the engine holds beside its weights: rows of full-vocabulary logits, and the
    sequences it takes through the layers (the longest, and all of their tokens)."""

    logit_rows: int
    longest: int = 0
    tokens: int = 0
    kept_bytes: int = 0  # what the recorder keeps of the forced positions (ForcedRecorder)


def memory_needed(model: Path, work: Workload, layer_by_layer: bool = False) -> int:
    """``memory_estimates``' figure for one way of holding the weights."""
    kept, by_layer = memory_estimates(model, work)
    return by_layer if layer_by_layer else kept


def memory_estimates(model: Path, work: Workload) -> tuple[int, int]:
    """Bytes ``reference`` or ``emulate`` needs for ``model`` and ``work`` with every weight
    kept in float64, and with one layer's at a time (those outside the layers and the
    largest layer's), from the file's metadata before anything is loaded. Beside the
    weights: a chunk being dequantized, the file's pages mapped, its parsed metadata, the
    logits, one layer's activations for a batch (the longest sequence's mask; three arrays
    of scores per head for a block of queries; Q, K and V and their copies per head; the
    feed-forward's products; the residual stream) and every sequence's hidden state, and a
    base. The embeddings, dequantized first, take less: they are among the weights counted.
    tests/test_gemma.py checks it against the peak resident memory of the default
    experiment's models: never below, and within 1.5x; tests/test_exact.py against a long
    sequence's."""
    file = GGUFFile(model)
    sizes = {t.name: t.n_elements for t in file.tensors}
    entries = sum(len(v) if isinstance(v, list) else 1 for v in file.fields.values())
    vocab = file.fields.get("tokenizer.ggml.tokens")
    logits = 8 * len(vocab or ()) * work.logit_rows
    fixed = DEQUANTIZING + logits + BASE_MEMORY
    fixed += METADATA_BYTES_PER_ENTRY * entries + model.stat().st_size
    fixed += _activations(file.fields, sizes, work) + work.kept_bytes
    layers: dict[str, int] = {}
    for name, size in sizes.items():
        if name.startswith("blk."):
            layer = name.split(".")[1]
            layers[layer] = layers.get(layer, 0) + size
    outside = sum(sizes.values()) - sum(layers.values())
    kept = 8 * sum(sizes.values()) + fixed
    return kept, 8 * (outside + max(layers.values(), default=0)) + fixed


def _activations(fields: dict[str, Any], sizes: dict[str, int], work: Workload) -> int:
    """Bytes of one layer's float64 activations for a batch of sequences (ExactModel.hidden;
    the longest's attention), and every sequence's hidden state (0 for an architecture the
    engine does not have)."""
    try:
        hp = read_hparams(fields, set(sizes))
    except UnsupportedArchitectureError:
        return 0
    n, heads = work.longest, hp.n_head
    n_ff = sizes.get("blk.0.ffn_down.weight", 0) // hp.n_embd
    scores = 8 * 3 * heads * min(n, ATTENTION_BLOCK)  # a block of queries' scores over n keys
    # per token: Q, K, V, K and V per query head, the turned Q and K, the heads' output; the
    # feed-forward's gate, up, activation and product, and a rounded copy of one (emulating
    # the activations' rounding); the residual stream, its norm and two sums
    per_token = 8 * (6 * heads * hp.head_dim + 5 * n_ff + 4 * hp.n_embd)
    rows = max(n, min(work.tokens, BATCH_TOKENS))  # a batch's
    per_layer = n * (scores + n) + rows * per_token  # n: the mask, a byte per query and key
    return per_layer + 8 * 2 * work.tokens * hp.n_embd


ERROR_FILE = "error.json"  # a handled failure, written by the child
UNSUPPORTED = 3  # the child's exit code for an architecture the engine does not have


def main(argv: list[str]) -> int:
    """``python -m qdiff.exact.reference SPEC``: ``reference`` (or, when the spec names
    ``configs``, ``emulate``) in a process of its own, so
    that the kernel's out-of-memory killer ends this process alone and its supervisor
    records it (workflow/scripts/exact_reference.py). Writes the spec's ``record`` and
    ``data`` files, or ``ERROR_FILE`` beside them (``kind`` "unsupported", exit code
    UNSUPPORTED, for an architecture the engine does not have)."""
    from qdiff.core.io import load_arrays, read_json, save_arrays, write_json

    spec = read_json(Path(argv[0]))
    out = Path(spec["record"]).parent
    run = spec["teacher_run"]
    slices = load_arrays(Path(spec["teacher_data"]))["slice_ids"] if spec["teacher_data"] else None
    try:
        stream = spec["layer_by_layer"]
        if spec.get("configs") is not None:
            record, arrays = emulate(Path(spec["model"]), run, spec["configs"], stream)
        else:
            record, arrays = reference(
                Path(spec["model"]),
                run,
                slices,
                spec["top_k"],
                stream,
                spec.get("n_top", 2),
                spec.get("keep_first", True),
            )
    except (UnsupportedArchitectureError, NotEmulatedError) as exc:
        write_json(out / ERROR_FILE, {"kind": "unsupported", "message": str(exc)})
        return UNSUPPORTED
    except MemoryError:
        write_json(
            out / ERROR_FILE,
            {"kind": "memory", "message": "the float64 engine ran out of memory (MemoryError)"},
        )
        return 1
    save_arrays(Path(spec["data"]), arrays)
    write_json(Path(spec["record"]), record)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
