"""Requantize and dequantize GGUF files with llama.cpp's own llama_model_quantize."""

from __future__ import annotations

import ctypes
from pathlib import Path

# llama.cpp's llama_ftype values (include/llama.h), by the names `llama-quantize` uses
QUANT_TYPES = {
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 8,
    "q5_1": 9,
    "q8_0": 7,
    "q2_k": 10,
    "q3_k_s": 11,
    "q3_k_m": 12,
    "q3_k_l": 13,
    "q4_k_s": 14,
    "q4_k_m": 15,
    "q5_k_s": 16,
    "q5_k_m": 17,
    "q6_k": 18,
    "iq4_nl": 25,
    "iq4_xs": 30,
}
# dequantized copies: every quantized weight converted; f32 reproduces the weights exactly
FLOAT_TYPES = {"f32": 0, "f16": 1, "bf16": 32}


def quantize(src: Path, dst: Path, target: str, threads: int) -> None:
    """Write ``src`` converted to ``target`` (a QUANT_TYPES or FLOAT_TYPES name) at ``dst``.

    Writes to a temporary name first, so an interrupted job never leaves a file that
    looks complete.
    """
    import llama_cpp  # native code: imported only by the job that needs it

    ftype = {**QUANT_TYPES, **FLOAT_TYPES}[target]
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = ftype
    params.allow_requantize = True  # the source is usually quantized already
    partial = dst.with_name(dst.name + ".partial")
    partial.unlink(missing_ok=True)
    rc = llama_cpp.llama_model_quantize(
        str(src).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if rc != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"llama_model_quantize({src.name} -> {target}) failed with code {rc}; "
            "the log above says why (is the source a valid GGUF?)"
        )
    partial.replace(dst)
