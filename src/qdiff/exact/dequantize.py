"""A GGUF tensor's values as llama.cpp dequantizes them: ggml's own ``to_float`` for its type
(``ggml_get_type_traits``, in the libggml-base that llama-cpp-python ships), called through
ctypes. gguf-py's numpy dequantizers give the same float32 values bit for bit on every type
of the project's models (tests/test_exact.py), but take 3-13 times longer: on the 2-core AMD
EPYC, Gemma 3 270M's Q4_K_M file 3.57 s against 1.08 s, SmolLM2's Q4_K_M 2.34 s against
0.24 s (docs/results/bench-epyc/dequantize-ggml.log). Only libggml-base is loaded: no
backend, no GPU library."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

F32 = 0  # ggml_type GGML_TYPE_F32: no conversion
GGML_TYPE_COUNT = (
    43  # ggml.h's enum ggml_type at the vendored commit: the types it knows are below it
)


class _TypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml.h, at the vendored commit of llama-cpp-python
    0.3.36): only ``to_float`` is called."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@functools.cache
def _ggml_base() -> ctypes.CDLL:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "llama-cpp-python is not installed in this environment: run ./setup",
            name="llama_cpp",
        )
    folder = Path(spec.submodule_search_locations[0]) / "lib"
    # .so on Linux, .dylib on macOS (a Metal build)
    path = next(
        (p for p in (folder / "libggml-base.so", folder / "libggml-base.dylib") if p.exists()), None
    )
    if path is None:
        raise FileNotFoundError(f"no libggml-base in {folder}: rebuild llama-cpp-python (./setup)")
    lib = ctypes.CDLL(str(path))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    return lib


def _traits(ggml_type: int) -> _TypeTraits:
    # ggml indexes its table unchecked in release builds: a type it does not know is
    # refused here (ggml_type_name answers "NONE" past the table's end)
    if not 0 <= ggml_type < GGML_TYPE_COUNT or _ggml_base().ggml_type_name(ggml_type) == b"NONE":
        raise ValueError(f"ggml does not know tensor type {ggml_type}")
    return _ggml_base().ggml_get_type_traits(ggml_type).contents


@functools.cache
def _to_float(ggml_type: int) -> Any:
    traits = _traits(ggml_type)
    if not traits.to_float or traits.blck_size <= 0:
        raise ValueError(f"ggml has no conversion to float for type {traits.type_name.decode()}")
    return _TO_FLOAT(traits.to_float)


def float32(data: np.ndarray, ggml_type: int, row_length: int) -> np.ndarray:
    """The values of a tensor's raw ``data`` (its bytes, shaped (..., the bytes of a row))
    of ``ggml_type``, as float32 in numpy's row-major shape, rows of ``row_length`` values
    (gguf-py's ``dequantize`` gives the same shape)."""
    raw = np.ascontiguousarray(data)
    if ggml_type == F32:
        return raw.view(np.float32).reshape(*raw.shape[:-1], row_length)
    convert, traits = _to_float(ggml_type), _traits(ggml_type)
    out = np.empty((*raw.shape[:-1], row_length), dtype=np.float32)
    # ggml reads whole blocks: a mismatch would read past the data, so it is refused
    if out.size % traits.blck_size or raw.nbytes != out.size // traits.blck_size * traits.type_size:
        raise ValueError(
            f"{raw.nbytes} bytes of {traits.type_name.decode()} do not hold {out.size} values"
        )
    convert(raw.ctypes.data, out.ctypes.data, out.size)
    return out
