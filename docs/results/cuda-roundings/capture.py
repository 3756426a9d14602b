"""Captures layer 0 of tiny real GGUFs on llama.cpp's CUDA backend, for the float64 engine's
CUDA rounding sources (issue 31) to be checked op by op against (``check.py``, here).

Run on the lent H200 by ``device.sh`` beside this file, from the repository's root:
    python3 docs/results/cuda-roundings/capture.py OUT_FOLDER
For every weight format of TARGETS (a random tiny llama, quantized by llama.cpp) and every
prompt length of LENGTHS (1 token takes MMVQ or mmvf, 2-8 MMVQ, 9-16 mmf or MMQ, more MMQ
or cuBLAS: docs/gpu-arithmetic.md), it keeps every tensor of layer 0 at the prompt's last
token (qdiff's own capture: the eval callback) in ``<target>-<n>.npz`` and each file's
sha256 in ``files.tsv``: the files are made again here from the same seed, and checked."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

TARGETS = ["f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k"]
LENGTHS = [1, 5, 12, 40]
SHAPE = {"n_embd": 256, "n_ff": 512}


def make(folder: Path, target: str) -> Path:
    """The tiny llama as ``target`` (its F32 source for f32), quantized in a child process
    (as the workflow quantizes)."""
    from tinymodel import write_tiny_llama

    source = folder / "f32.gguf"
    if not source.exists():
        write_tiny_llama(source, **SHAPE)
    if target == "f32":
        return source
    path = folder / f"{target}.gguf"
    code = (
        "import sys; from pathlib import Path; from qdiff.engine.quant import quantize; "
        f"sys.exit(quantize(Path({str(source)!r}), Path({str(path)!r}), {target!r}, 1))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return path


def context_for(lengths: list[int]) -> int:
    """256 (the captures of 2026-12-03), or 1024 where a prompt needs more."""
    return 256 if max(lengths) + max(STARTS) <= 256 else 1024


def text_for(n_ctx: int) -> str:
    return TEXT * (8 if n_ctx == 256 else 80)


def capture(
    path: Path,
    lengths: list[int],
    backend: str,
    flash_attn: bool,
    n_ubatch: int = 512,
    kv_cache_type: str = "f16",
) -> dict[int, dict[str, np.ndarray]]:
    """Layer 0's tensors at the last token of prompts of ``lengths`` tokens (the last
    ubatch's graph)."""
    from qdiff.core.settings import DeviceSettings
    from qdiff.engine.capture import TensorCapture
    from qdiff.engine.devices import backend_devices, devices_for_backend
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel
    from qdiff.engine.worker import _capture_prompt

    log = init_backend()  # kept while llama.cpp runs
    settings = DeviceSettings(
        backend=backend,
        threads=1,
        flash_attn=flash_attn,
        n_ubatch=n_ubatch,
        kv_cache_type=kv_cache_type,
    )
    gpu = None
    if settings.on_gpu:
        usable = devices_for_backend(backend, backend_devices())
        if not usable:
            raise SystemExit(f"this build has no {backend} device")
        gpu = usable[0].handle
    out: dict[int, dict[str, np.ndarray]] = {}
    n_ctx = context_for(lengths)
    with LoadedModel(path, settings, n_ctx, gpu) as model:
        tokens = model.tokenize(text_for(n_ctx), parse_special=False)
        for n in lengths:
            arrays: dict[str, np.ndarray] = {}
            row = _capture_prompt(
                model, TensorCapture(LAYER0_NAMES), str(n), tokens[:n], "t", arrays
            )
            first: dict[str, np.ndarray] = {}
            for t in row["tensors"]:
                if t["key"] in arrays:
                    first.setdefault(t["name"], arrays[t["key"]])
            first["tokens"] = np.asarray(tokens[:n])
            out[n] = first
    del log
    return out


# layer 0's named tensors, and the flash-attention node, unnamed (its first is layer 0's)
LAYER0_NAMES = "-0$|^FLASH_ATTN_EXT"
FIRST_STEPS = [3, 5, 12, 40]  # prompt lengths of the whole-model check
STARTS = [0, 7, 19, 31]  # where each prompt starts in the text's tokens
# one token per ubatch (``ub1``): every row's attention takes MMVF; the last of 600 tokens
# sees 768 KV cells, more than MMVF's K·Q takes (docs/gpu-arithmetic.md)
UB1_STEPS = [*FIRST_STEPS, 600]
UB1_LAYER0 = [5, 40, 600]  # layer 0's tensors at the last of these, in one-token ubatches
TEXT = "The quick brown fox jumps over the lazy dog. "
# an f32 KV cache (``kv32``): K·Q and softmax·V take MMVF for 1-3 tokens, MMF for 4-16,
# cuBLAS in TF32 mode for more (docs/gpu-arithmetic.md)
KV32_LAYER0 = [1, 3, 5, 12, 40]
# flash attention (``fa``): one token takes the VEC kernel, more the MMA_F16 kernel
# (fattn.cu ggml_cuda_get_best_fattn_kernel), whose tiles of KV cells a long prompt crosses
FA_LAYER0 = [1, 2, 5, 12, 40, 300]


def first_steps(
    path: Path,
    backend: str,
    n_ubatch: int = 512,
    lengths: list[int] = FIRST_STEPS,
    kv_cache_type: str = "f16",
    flash_attn: bool = False,
) -> dict[str, np.ndarray]:
    """The first step's logits of prompts of ``lengths`` tokens, each from STARTS, the
    prompt in ubatches of ``n_ubatch`` tokens."""
    from qdiff.core.settings import DeviceSettings
    from qdiff.engine.devices import backend_devices, devices_for_backend
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel

    log = init_backend()
    settings = DeviceSettings(
        backend=backend,
        threads=1,
        n_ubatch=n_ubatch,
        kv_cache_type=kv_cache_type,
        flash_attn=flash_attn,
    )
    gpu = devices_for_backend(backend, backend_devices())[0].handle if settings.on_gpu else None
    out: dict[str, np.ndarray] = {}
    n_ctx = context_for(lengths)
    with LoadedModel(path, settings, n_ctx, gpu) as model:
        tokens = model.tokenize(text_for(n_ctx), False)
        for n in lengths:
            for start in STARTS:
                prompt = tokens[start : start + n]
                logits, _ = model.prefill(prompt)
                out[f"{n}-{start}"] = np.asarray(logits, dtype=np.float32)
                out[f"{n}-{start}-tokens"] = np.asarray(prompt)
    del log
    return out


def save_ub1(out: Path, path: Path, target: str, backend: str) -> None:
    steps = first_steps(path, backend, 1, UB1_STEPS)
    np.savez_compressed(out / f"{target}-logits-ub1.npz", **steps)
    print(f"{target}: {len(steps) // 2} first steps in one-token ubatches", flush=True)
    for n, tensors in capture(path, UB1_LAYER0, backend, False, n_ubatch=1).items():
        np.savez_compressed(out / f"{target}-ub1-{n}.npz", **tensors)


def save_kv32(out: Path, path: Path, target: str, backend: str) -> None:
    steps = first_steps(path, backend, kv_cache_type="f32")
    np.savez_compressed(out / f"{target}-logits-kv32.npz", **steps)
    print(f"{target}: {len(steps) // 2} first steps with an f32 KV cache", flush=True)
    layer0 = capture(path, KV32_LAYER0, backend, False, kv_cache_type="f32")
    for n, tensors in layer0.items():
        np.savez_compressed(out / f"{target}-kv32-{n}.npz", **tensors)


def save_fa(out: Path, path: Path, target: str, backend: str) -> None:
    for n_ubatch, name in ((512, "fa"), (1, "fa-ub1")):
        steps = first_steps(path, backend, n_ubatch, flash_attn=True)
        np.savez_compressed(out / f"{target}-logits-{name}.npz", **steps)
    print(f"{target}: first steps with flash attention", flush=True)
    for n, tensors in capture(path, FA_LAYER0, backend, True).items():
        np.savez_compressed(out / f"{target}-fa-{n}.npz", **tensors)


def save_kv32_wide(out: Path, path: Path, target: str, backend: str) -> None:
    """Layer 0 with an f32 KV cache in a context of 1,024 (capture's context for prompts
    of 300 tokens): the cells a ubatch reads (256, 512) fewer than the cache's, so that
    its view of V is not contiguous (Vulkan copies it to f16 first). f32 and Q8_0 only."""
    if target not in ("f32", "q8_0"):
        return
    for n, tensors in capture(path, [12, 300], backend, False, kv_cache_type="f32").items():
        np.savez_compressed(out / f"{target}-kv32-wide-{n}.npz", **tensors)


MODES = {"ub1": save_ub1, "kv32": save_kv32, "kv32-wide": save_kv32_wide, "fa": save_fa}


def main() -> None:
    """``capture.py OUT [BACKEND] [ub1 | kv32 | fa]``: with ``ub1``, only the first steps of
    UB1_STEPS in one-token ubatches (``<target>-logits-ub1.npz``); with ``kv32``, the
    first steps and layer 0 with an f32 KV cache (``<target>-logits-kv32.npz``,
    ``<target>-kv32-<n>.npz``); with ``kv32-wide``, layer 0 with an f32 KV cache in a
    larger context (``<target>-kv32-wide-<n>.npz``); with ``fa``, with flash attention
    (first steps in one ubatch and in one-token ubatches, ``<target>-logits-fa.npz``,
    ``-fa-ub1.npz``, and layer 0 at FA_LAYER0, ``<target>-fa-<n>.npz``)."""
    out = Path(sys.argv[1])
    backend = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    out.mkdir(parents=True, exist_ok=True)
    models = out / "models"
    models.mkdir(exist_ok=True)
    if len(sys.argv) > 3:
        for target in TARGETS:
            MODES[sys.argv[3]](out, make(models, target), target, backend)
        return
    rows = []
    for target in TARGETS:
        path = make(models, target)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        rows.append(f"{target}\t{digest}")
        for flash in (False, True):
            name = target + ("-fa" if flash else "")
            for n, tensors in capture(path, LENGTHS, backend, flash).items():
                np.savez_compressed(out / f"{name}-{n}.npz", **tensors)
                print(f"{name} n={n}: {len(tensors) - 1} tensors", flush=True)
        np.savez_compressed(out / f"{target}-logits.npz", **first_steps(path, backend))
    (out / "files.tsv").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
