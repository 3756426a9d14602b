"""Attention with an f32 KV cache on the H200 (``h200-kv32/``, capture.py's ``kv32``), held
against the float64 engine: run here, from the repository's root, with ./setup's .venv:
    .venv/bin/python docs/results/cuda-roundings/check-kv32.py > docs/results/cuda-roundings/check-kv32.log
For each tiny model and each prompt of 1-40 tokens (one ubatch): the share of K·Q's and
softmax·V's values at the last token that equal the run's to float32's level (1e-6 of the
largest), with both operands as they are, cut to TF32, or rounded to TF32, Q, K and V
computed by the engine (through CUDA's matmuls); then whole first steps: the median over
prompts of max |Δ| between the H200's logits and the engine with the sources the pipeline
plans for such a device, with and without the attention's switch."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from capture import KV32_LAYER0, STARTS, make  # noqa: E402  (beside this file)

from qdiff.core.roundings import sources_of, together  # noqa: E402
from qdiff.core.settings import DeviceSettings  # noqa: E402
from qdiff.exact import cuda  # noqa: E402
from qdiff.exact.model import ExactModel  # noqa: E402
from test_cuda_kernels import (  # noqa: E402
    _attention_inputs_of_layer0,
    _first_step_residual,
    _share_equal,
)

CAPTURES = Path(__file__).parent / "h200-kv32"
TARGETS = ["f32", "q8_0", "q4_k_m"]
OPERANDS = {
    "float32": np.asarray,
    "TF32 cut": lambda x: cuda.tf32(x, nearest=False),
    "TF32 rounded": lambda x: cuda.tf32(x, nearest=True),
}


def layer0(model: ExactModel, target: str) -> None:
    heads = model.hp.n_head
    for n in KV32_LAYER0:
        tensors = np.load(CAPTURES / f"{target}-kv32-{n}.npz")
        q, k, v = _attention_inputs_of_layer0(model, tensors["tokens"])
        cells = len(tensors["kq-0"]) // heads
        kq = tensors["kq-0"].reshape(heads, cells)[:, :n].astype(np.float64)
        p = tensors["kq_soft_max-0"].reshape(heads, cells)[:, :n].astype(np.float64)
        kqv = tensors["kqv-0"].reshape(heads, -1).astype(np.float64)
        shares = []
        for name, f in OPERANDS.items():
            a = _share_equal(np.einsum("hd,hnd->hn", f(q), f(k)), kq)
            b = _share_equal(np.einsum("hn,hnd->hd", f(p), f(v)), kqv)
            shares.append(f"{name} {a:.2f} / {b:.2f}")
        kernel = cuda.attention_kernel(n, f16_cache=False)
        print(f"{target:7s} {n:3d} tokens ({kernel:6s}) K·Q / softmax·V: " + "; ".join(shares))


def first_steps(model: ExactModel, target: str) -> None:
    runs = np.load(CAPTURES / f"{target}-logits-kv32.npz")
    model.first_step_only = True
    settings = DeviceSettings(backend="cuda", kv_cache_type="f32").as_dict()
    planned = together(sources_of(settings, "none"))
    without = dataclasses.replace(planned, cuda_attention_kv_f32=False)
    for n in (3, 5, 12, 40):
        line = [
            f"{name} {_first_step_residual(model, runs, n, r):.2g}"
            for name, r in (("planned", planned), ("without the attention's switch", without))
        ]
        print(
            f"{target:7s} {n:3d} tokens, first steps (median of {len(STARTS)}): " + "; ".join(line)
        )


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        for target in TARGETS:
            model = ExactModel(make(Path(folder), target))
            layer0(model, target)
            first_steps(model, target)


if __name__ == "__main__":
    main()
