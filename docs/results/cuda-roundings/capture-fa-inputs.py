"""Captures the operands of layer 0's flash attention (FLASH_ATTN_EXT) as llama.cpp hands
them to the kernel, whole: Q (float32, after RoPE), the KV cache's views of K and V (f16),
the mask (f16) and the output at every position, with the op's parameters. capture.py keeps
each tensor at the last token only, and its K is the one before RoPE: beyond one tile of KV
cells explore-fa-tiles.py could not tell the kernel's arithmetic from RoPE's. With these
operands the kernel's tiles can be tried on exactly what it read.

Run on the lent H200 with the CUDA wheel in /tmp/site, from the repository's root:
    PYTHONPATH=src:tests:/tmp/site python3 docs/results/cuda-roundings/capture-fa-inputs.py OUT [BACKEND]
For each of TARGETS and LENGTHS: ``<target>-fa-inputs-<n>.npz`` (q, k, v, mask, out, scale,
max_bias, softcap, prec, tokens, n_ubatch) and the first step's logits with flash attention
(``<target>-logits-fa-long.npz``, capture.first_steps' keys)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "docs/results/cuda-roundings")]

from capture import context_for, first_steps, make, text_for  # noqa: E402

from qdiff.engine.bindings import llama_cpp  # noqa: E402
from qdiff.engine.capture import _GgmlTensor, _libggml_base  # noqa: E402

TARGETS = ["f32", "q8_0", "q4_k_m"]
# the f32 llama in other shapes: a head of 128; six query heads on two KV heads (GQA 3)
SHAPES = {"f32-h128": {"n_head": 2}, "f32-gqa3": {"n_embd": 384, "n_head": 6, "n_head_kv": 2}}
LENGTHS = [40, 100, 300, 600]  # 600: two ubatches of 512, the last one of 88 rows
DTYPES = {"f32": np.float32, "f16": np.float16}


class FlashOperands:
    """The eval callback: at the first FLASH_ATTN_EXT of a read pass, its sources and
    output as arrays (strided views read through their byte strides)."""

    def __init__(self) -> None:
        self.lib = _libggml_base()
        self.reading = False
        self.arrays: dict[str, np.ndarray] = {}
        self.error: BaseException | None = None
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def _array(self, address: int) -> np.ndarray:
        t = _GgmlTensor.from_address(address)
        dtype = DTYPES[self.lib.ggml_type_name(t.type).decode()]
        raw = np.empty(int(self.lib.ggml_nbytes(address)), dtype=np.uint8)
        self.lib.ggml_backend_tensor_get(address, raw.ctypes.data, 0, raw.size)
        shape = [int(x) for x in t.ne][::-1]
        strides = [int(x) for x in t.nb][::-1]
        view = np.lib.stride_tricks.as_strided(raw.view(dtype), shape=shape, strides=strides)
        return np.array(view)  # numpy order: ne[3] first

    def _on_eval(self, address: int, ask: bool, user_data: int) -> bool:
        try:
            is_fa = self.lib.ggml_op_desc(address).decode() == "FLASH_ATTN_EXT"
            if ask:
                return self.reading and is_fa and not self.arrays
            if self.reading and is_fa and not self.arrays:
                t = _GgmlTensor.from_address(address)
                for key, i in (("q", 0), ("k", 1), ("v", 2), ("mask", 3)):
                    self.arrays[key] = self._array(t.src[i])
                self.arrays["out"] = self._array(address)
                params = np.ctypeslib.as_array(t.op_params)
                floats = params[:3].view(np.float32)
                self.arrays |= {
                    "scale": floats[0],
                    "max_bias": floats[1],
                    "softcap": floats[2],
                    "prec": params[3],
                }
        except BaseException as exc:  # never let an exception unwind through C
            self.error = self.error or exc
        return True


def capture_operands(path: Path, backend: str) -> dict[int, dict[str, np.ndarray]]:
    from qdiff.core.settings import DeviceSettings
    from qdiff.engine.devices import backend_devices, devices_for_backend
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel

    log = init_backend()
    settings = DeviceSettings(backend=backend, threads=1, flash_attn=True)
    gpu = devices_for_backend(backend, backend_devices())[0].handle if settings.on_gpu else None
    out: dict[int, dict[str, np.ndarray]] = {}
    n_ctx = context_for(LENGTHS)
    with LoadedModel(path, settings, n_ctx, gpu) as model:
        tokens = model.tokenize(text_for(n_ctx), parse_special=False)
        for n in LENGTHS:
            capturer = FlashOperands()
            model.set_eval_callback(capturer.callback)
            last = model.last_ubatch(n)
            model.clear()
            if n > last:  # the earlier ubatches with the capture idle
                model.extend(tokens[: n - last])
            capturer.reading = True
            model.extend(tokens[n - last : n])
            model.set_eval_callback(None)
            if capturer.error is not None:
                raise capturer.error
            capturer.arrays |= {"tokens": np.asarray(tokens[:n]), "n_ubatch": np.asarray(last)}
            out[n] = capturer.arrays
    del log
    return out


def make_shaped(folder: Path, name: str) -> Path:
    from tinymodel import write_tiny_llama

    return write_tiny_llama(
        folder / f"{name}.gguf", **({"n_embd": 256, "n_ff": 512} | SHAPES[name])
    )


def main() -> None:
    out = Path(sys.argv[1])
    backend = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    models = out / "models"
    models.mkdir(parents=True, exist_ok=True)
    for target in [*TARGETS, *SHAPES]:
        path = make_shaped(models, target) if target in SHAPES else make(models, target)
        for n, arrays in capture_operands(path, backend).items():
            np.savez_compressed(out / f"{target}-fa-inputs-{n}.npz", **arrays)
            shapes = {k: v.shape for k, v in arrays.items() if v.ndim}
            print(f"{target} n={n}: {shapes}", flush=True)
        steps = first_steps(path, backend, lengths=LENGTHS[1:], flash_attn=True)
        np.savez_compressed(out / f"{target}-logits-fa-long.npz", **steps)
        print(f"{target}: {len(steps) // 2} first steps with flash attention", flush=True)


if __name__ == "__main__":
    main()
