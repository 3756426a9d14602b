"""The number formats qdiff names, with llama.cpp's ids for them, in one place.

- ``GGML_TYPES``: ggml's tensor types (``enum ggml_type``, ggml.h) that qdiff reads or asks for:
  the KV cache's element type, and the float tensors a capture keeps;
- ``QUANT_TYPES``: the quantized file types qdiff derives, as ``llama_ftype`` (llama.h), by
  the names ``llama-quantize`` uses;
- ``COPY_TYPES``: the dequantized copies (every quantized weight converted; f32 reproduces
  the weights exactly, f16 and bf16 add one rounding).
"""

from __future__ import annotations

from qdiff.core.labels import DEQUANT_COPIES

GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
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
COPY_TYPES = dict(zip(DEQUANT_COPIES, (0, 1, 32), strict=True))  # llama_ftype too
