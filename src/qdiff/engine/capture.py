"""Named intermediate tensors of a forward pass, read through llama.cpp's eval callback
(``cb_eval``, the mechanism behind llama-eval-callback)."""

from __future__ import annotations

import ctypes
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from qdiff.core.formats import GGML_TYPES
from qdiff.engine.bindings import llama_cpp
from qdiff.engine.devices import shared_library


class _GgmlTensor(ctypes.Structure):
    """The head of ggml.h's ``struct ggml_tensor``, up to its name (checked on every read
    against ggml_get_name and ggml_nelements, so a layout change fails loudly)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


_FLOAT_TYPES = {GGML_TYPES["f32"]: np.float32, GGML_TYPES["f16"]: np.float16}  # (bf16 below)
GGML_TYPE_BF16 = GGML_TYPES["bf16"]
# llama.cpp's names for reshaped, permuted or viewed tensors: no new arithmetic
_DERIVED_NAME = re.compile(r"\((view|permuted|reshaped|transposed|cont|copy)[^)]*\)$")
_UNNAMED = re.compile(r"^(node|leaf)_\d+$")  # ggml's default names, numbered per graph
_NO_ARITHMETIC = {"NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"}
KEEP_WHOLE_MAX = 1 << 20  # elements; larger tensors without a token axis are skipped
Key = tuple[str, int]  # (name, occurrence in graph order)


@dataclass
class CapturedTensor:
    name: str
    op: str
    type: str
    ne: list[int]  # ggml order: ne[0] is the contiguous dimension
    weight: str | None  # a matmul's weight tensor and its type, e.g. "blk.0.attn_q.weight q4_K"
    kept: str  # "last position", "whole" or why nothing was kept
    values: np.ndarray


def token_axis(
    ne: list[int], n_tokens: int, probe_ne: list[int] | None, delta: int = 1
) -> int | str | None:
    """The axis of ``ne`` that runs over the batch's tokens, found from the graph: the one
    axis that is ``n_tokens`` long in the pass and ``delta`` longer (one more token, or one
    fewer) in the probe pass. ``None``: no token axis; ``"ambiguous"``: the shapes cannot
    tell (never a guess from a size that happens to equal the token count, e.g. the head
    count)."""
    if probe_ne is None:
        return "ambiguous" if n_tokens in ne else None
    grown = [d for d in range(4) if ne[d] == n_tokens and probe_ne[d] == n_tokens + delta]
    if len(grown) == 1:
        return grown[0]
    return "ambiguous" if grown else None


class TensorCapture:
    """Reads named intermediate tensors of a forward pass through the eval callback. For
    each tensor whose name matches ``pattern`` it keeps the values of the last token
    position, or the whole tensor when it has no token axis (e.g. the last layer after
    llama.cpp drops unused rows).

    Use: ``probe(n_tokens + 1)`` and decode one more token than the prompt (shapes only),
    then ``start(n_tokens)`` and decode the prompt; ``tensors`` holds the capture."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)
        self.lib = _libggml_base()
        self.n_tokens = 0
        self.tensors: list[CapturedTensor] = []
        self.error: BaseException | None = None
        self._mode = "idle"  # "idle": read nothing; "probe": shapes only; "read"
        self._delta = 1
        self._probed = True
        self._probe_shapes: dict[Key, list[int]] = {}
        self._seen: Counter[str] = Counter()
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def idle(self) -> None:
        """The next passes read nothing (e.g. a prompt's earlier ubatches)."""
        self._mode = "idle"

    def probe(self, delta: int = 1) -> None:
        """The next pass only records shapes; its batch is ``delta`` tokens longer than the
        captured one (1, or -1 where the captured ubatch is already full)."""
        self._mode, self._delta, self._probe_shapes, self.error = "probe", delta, {}, None
        self._seen = Counter()

    def start(self, n_tokens: int, probed: bool = True) -> None:
        """The next pass is read. Without a probe pass (a one-token graph that cannot grow)
        every tensor is that one token's, so each is kept whole as its last position."""
        self._mode, self.n_tokens, self.tensors, self.error = "read", n_tokens, [], None
        self._probed = probed
        self._seen = Counter()

    def _wanted(self, t: _GgmlTensor, name: str, address: int) -> bool:
        return (
            bool(self.pattern.search(name))
            and self.lib.ggml_op_desc(address).decode() not in _NO_ARITHMETIC
            and not _DERIVED_NAME.search(name)
            and (t.type in _FLOAT_TYPES or t.type == GGML_TYPE_BF16)
            and bool(self.lib.ggml_is_contiguous(address))
        )

    def _on_eval(self, address: int, ask: bool, user_data: int) -> bool:
        try:
            t = _GgmlTensor.from_address(address)
            name = t.name.decode("utf-8", errors="replace")
            if _UNNAMED.match(name):  # e.g. the flash-attention node: name it by its op
                name = f"{self.lib.ggml_op_desc(address).decode()} (unnamed)"
            if self._mode == "idle":
                return not ask  # asked: nothing wanted; shown: carry on
            if ask:
                wanted = self._wanted(t, name, address)
                if wanted and self._mode == "probe":
                    self._probe_shapes[(name, self._seen[name])] = [int(x) for x in t.ne]
                    self._seen[name] += 1
                    return False  # shapes only: nothing to read
                return wanted
            key = (name, self._seen[name])
            self._seen[name] += 1
            self.tensors.append(self._read(t, name, address, self._probe_shapes.get(key)))
        except BaseException as exc:  # never let an exception unwind through C
            self.error = self.error or exc
        return True

    def _read(
        self, t: _GgmlTensor, name: str, address: int, probe_ne: list[int] | None
    ) -> CapturedTensor:
        lib = self.lib
        ne = [int(x) for x in t.ne]
        real_name = lib.ggml_get_name(address).decode(errors="replace")
        if (real_name != name and not _UNNAMED.match(real_name)) or int(
            lib.ggml_nelements(address)
        ) != int(np.prod(ne)):
            raise RuntimeError(
                "struct ggml_tensor layout differs from qdiff's: update engine.capture._GgmlTensor"
            )
        raw = np.empty(int(lib.ggml_nbytes(address)), dtype=np.uint8)
        lib.ggml_backend_tensor_get(address, raw.ctypes.data, 0, raw.size)
        if t.type == GGML_TYPE_BF16:
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.view(_FLOAT_TYPES[t.type]).astype(np.float32)
        axis = token_axis(ne, self.n_tokens, probe_ne, self._delta)
        if not self._probed and self.n_tokens == 1 and values.size <= KEEP_WHOLE_MAX:
            kept = "last position"  # a one-token graph: all of it is that token's
        elif isinstance(axis, int):
            array = values.reshape(ne[::-1])  # numpy order: ne[3] first
            kept, values = "last position", np.take(array, self.n_tokens - 1, axis=3 - axis).ravel()
        elif axis == "ambiguous":
            kept, values = "skipped (token axis ambiguous)", np.zeros(0, np.float32)
        elif values.size <= KEEP_WHOLE_MAX:
            kept = "whole"
        else:
            kept, values = "skipped (no token axis, too large)", np.zeros(0, np.float32)
        weight = None
        op = lib.ggml_op_desc(address).decode()
        if op in ("MUL_MAT", "MUL_MAT_ID") and t.src[0]:
            w = _GgmlTensor.from_address(t.src[0])
            weight = f"{w.name.decode(errors='replace')} {lib.ggml_type_name(w.type).decode()}"
        return CapturedTensor(
            name=name,
            op=op,
            type=lib.ggml_type_name(t.type).decode(),
            ne=ne,
            weight=weight,
            kept=kept,
            values=np.ascontiguousarray(values, dtype=np.float32),
        )


def _libggml_base() -> ctypes.CDLL:
    lib = shared_library("ggml-base")
    for fn, restype in (
        ("ggml_get_name", ctypes.c_char_p),
        ("ggml_op_desc", ctypes.c_char_p),
        ("ggml_nelements", ctypes.c_int64),
        ("ggml_nbytes", ctypes.c_size_t),
        ("ggml_is_contiguous", ctypes.c_bool),
    ):
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    return lib
