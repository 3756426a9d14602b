"""llama.cpp, driven through llama-cpp-python's low-level binding.

This package loads native code: only the isolated worker process (``qdiff.worker``), the
quantize child (``qdiff.quant``) and the backend probe (``qdiff.probe``) import it.

- ``bindings``: ``llama_cpp``, the bindings without the high-level API (faster to import);
- ``log``: llama.cpp's log with its levels (ERROR lines are a failure's reason);
- ``devices``: the ggml backend devices of this build;
- ``model``: one model and one context (``LoadedModel``): generation, teacher forcing;
- ``capture``: named intermediate tensors through the eval callback.
"""

from __future__ import annotations

from pathlib import Path

from qdiff.engine.bindings import llama_cpp
from qdiff.engine.log import LlamaLog


def init_backend(errors_file: Path | None = None) -> LlamaLog:
    """Route llama.cpp's log through qdiff and initialise the backends, once per process."""
    log = LlamaLog(errors_file)
    llama_cpp.llama_backend_init()
    return log
