"""A GGUF file's metadata and tensor table, read in one pass without gguf-py's reader.

gguf-py's ``GGUFReader`` makes a numpy view of every entry of every metadata array: 12 s
and about 690 MiB for Gemma 3's 262,144-token vocabulary on the 2-core AMD EPYC, read twice
per float64 job. This reads the same values as plain Python ones (0.3 s; docs/performance.md)
and maps the tensors' bytes. The format: ggml's docs/gguf.md (little-endian, version 2 or 3).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# value types (gguf.md's gguf_metadata_value_type): struct formats of the scalar ones
SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8"}
NUMPY |= {11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands, or a truncated one."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml's order: shape[0] is a row's length
    ggml_type: int
    offset: int  # from the start of the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def type_name(self) -> str:
        """ggml's name of the type, lower case (``q4_k``, ``f32``)."""
        import gguf  # the constants only

        return str(gguf.GGMLQuantizationType(self.ggml_type).name.lower())


class GGUFFile:
    """``fields``: every metadata key's value (str, int, float, bool, or a list of them);
    ``tensors``: the tensor table in the file's order; ``data(tensor)``: its bytes, mapped."""

    def __init__(self, path: Path) -> None:
        if Path(path).stat().st_size < len(MAGIC):
            raise GGUFFormatError(f"{Path(path).name} is not a GGUF file (it is empty or nearly)")
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.fields, self.tensors = _parse(self._map, Path(path).name)
        except GGUFFormatError:
            raise
        except (struct.error, IndexError, ValueError, OverflowError) as exc:
            raise GGUFFormatError(f"{Path(path).name} is not a whole GGUF file ({exc})") from exc

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes (uint8, not copied)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.offset)


class _Cursor:
    def __init__(self, buffer: Any) -> None:
        self.buffer, self.at = memoryview(buffer), 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        end = self.at + n
        if end > len(self.buffer):
            raise IndexError("a string runs past the end of the file")
        value = bytes(self.buffer[self.at : end]).decode("utf-8", "surrogateescape")
        self.at = end
        return value

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in (STRING, ARRAY):  # each element reads (and bounds) its own length
                return [self.value(item) for _ in range(count)]
            if item not in NUMPY:
                raise IndexError(f"an array of value type {item}")
            end = self.at + count * np.dtype(NUMPY[item]).itemsize
            if end > len(self.buffer):
                raise IndexError("an array runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype=NUMPY[item], count=count, offset=self.at)
            self.at = end
            return values.tolist()
        if kind not in SCALARS:
            raise IndexError(f"value type {kind}")
        return self.unpack(SCALARS[kind])


def _parse(buffer: Any, name: str) -> tuple[dict[str, Any], list[TensorInfo]]:
    at, n_tensors, fields = _fields(buffer, name)
    table = _table(at, n_tensors, name)
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"{name}: general.alignment {alignment!r} is not a power of two")
    start = -(-at.at // alignment) * alignment  # the tensors' data, aligned
    return fields, [_placed(entry, start, len(buffer), name) for entry in table]


def _fields(buffer: Any, name: str) -> tuple[_Cursor, int, dict[str, Any]]:
    """The header and the metadata: a cursor after them, the number of tensors, the keys."""
    if bytes(buffer[:4]) != MAGIC:
        raise GGUFFormatError(f"{name} is not a GGUF file (it does not start with 'GGUF')")
    at = _Cursor(buffer)
    at.at = 4
    version = at.unpack("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{name} is GGUF version {version}; qdiff reads versions 2 and 3")
    n_tensors, n_fields = at.unpack("Q"), at.unpack("Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = at.string()
        if key in fields:
            raise GGUFFormatError(f"{name} holds the key {key} twice")
        fields[key] = at.value(at.unpack("I"))
    return at, n_tensors, fields


_Entry = tuple[str, tuple[int, ...], int, int]  # name, shape, ggml type, offset in the data


def _table(at: _Cursor, n_tensors: int, name: str) -> list[_Entry]:
    table = []
    for _ in range(n_tensors):
        tensor_name = at.string()
        n_dims = at.unpack("I")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(f"{name}: tensor {tensor_name} has {n_dims} dimensions")
        shape = tuple(at.unpack("Q") for _ in range(n_dims))
        table.append((tensor_name, shape, at.unpack("I"), at.unpack("Q")))
    if len({entry[0] for entry in table}) < len(table):
        raise GGUFFormatError(f"{name} names a tensor twice")
    return table


def _placed(entry: _Entry, start: int, file_size: int, name: str) -> TensorInfo:
    """A tensor's place and size in the file, checked against its type and the file's end."""
    import gguf  # the constants only: each type's block size and bytes

    tensor_name, shape, ggml_type, offset = entry
    if ggml_type not in {int(t) for t in gguf.GGML_QUANT_SIZES}:
        raise GGUFFormatError(f"{name}: tensor {tensor_name} has unknown type {ggml_type}")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    if shape and shape[0] % block:
        raise GGUFFormatError(
            f"{name}: tensor {tensor_name}'s rows of {shape[0]} values are not whole "
            f"blocks of {block}"
        )
    n_bytes = math.prod(shape) // block * size
    if start + offset + n_bytes > file_size:
        raise GGUFFormatError(f"{name}: tensor {tensor_name} runs past the end of the file")
    return TensorInfo(tensor_name, shape, ggml_type, start + offset, n_bytes)
