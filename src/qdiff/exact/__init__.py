"""The exact answer of a GGUF's weights: a plain forward pass in float64 (numpy).

llama.cpp is not exact even on f32 weights: the CPU backend evaluates GELU through an fp16
table, the KV cache is f16 by default, and every backend sums in its own order. This module
computes the model's mathematical definition instead, in float64 throughout: the weights
dequantized exactly as llama.cpp dequantizes them (ggml's own ``to_float``, checked bit
for bit against the f32 copy llama.cpp writes and gguf-py's ``gguf.quants``), RMS norms, RoPE angles, the attention
softmax and the activation (Gemma: the tanh-approximated GELU, computed exactly), with no
KV-cache rounding. float64 has 2^29 times finer rounding than float32, so against any
llama.cpp run its own error is nil.

It follows llama.cpp's graph for each architecture it supports (``architectures``; the
source of truth is llama.cpp's ``src/models/<arch>.cpp``), and reads the hyperparameters
with llama.cpp's defaults, so the same file means the same model. An architecture it does
not support raises ``UnsupportedArchitectureError``: the report says so.

- ``architectures``: the table of architectures and their hyperparameters;
- ``model``: the weights and the forward pass (``ExactModel``);
- ``reference``: the exact answer along the teacher's text, and its memory estimate.
"""

from qdiff.exact.architectures import ARCHITECTURES, UnsupportedArchitectureError
from qdiff.exact.model import ExactModel, Weights

__all__ = ["ARCHITECTURES", "ExactModel", "UnsupportedArchitectureError", "Weights"]
