"""qdiff's GGUF reader against gguf-py's on tiny generated files: every metadata value,
every tensor's place and bytes; and a damaged file refused with a GGUFFormatError."""

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from qdiff.core.gguffile import GGUFFile, GGUFFormatError
from tinymodel import write_tiny_gemma3, write_tiny_llama


@pytest.fixture(params=["llama", "gemma3"])
def tiny(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"{request.param}.gguf"
    return write_tiny_llama(path) if request.param == "llama" else write_tiny_gemma3(path)


def test_reads_what_gguf_py_reads(tiny: Path) -> None:
    ours, theirs = GGUFFile(tiny), gguf.GGUFReader(tiny)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        if isinstance(value, float):  # gguf-py widens float32 values too
            assert np.float32(ours.fields[key]) == np.float32(value), key
        else:
            assert ours.fields[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.shape == tuple(int(n) for n in t.shape)
        assert (mine.ggml_type, mine.type_name) == (int(t.tensor_type), t.tensor_type.name.lower())
        assert (mine.offset, mine.n_bytes, mine.n_elements) == (
            t.data_offset,
            t.n_bytes,
            int(t.n_elements),
        )
        assert ours.data(mine).tobytes() == np.asarray(t.data).tobytes()


def test_token_bytes_survive_decoding(tmp_path: Path) -> None:
    """A token that is not UTF-8 (byte-level vocabularies hold such) is kept byte for byte:
    a tokenizer's digest (qdiff.sources.tokenizer) hashes the file's bytes."""
    raw = [b"\xff\xfe", "é"]
    path = _write(tmp_path / "raw.gguf", lambda w: w.add_array("tokenizer.ggml.tokens", raw))
    tokens = GGUFFile(path).fields["tokenizer.ggml.tokens"]
    assert [t.encode("utf-8", "surrogateescape") for t in tokens] == [b"\xff\xfe", "é".encode()]


def test_damaged_files_are_refused(tiny: Path, tmp_path: Path) -> None:
    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])  # the tensors' bytes run past the end
    with pytest.raises(GGUFFormatError, match="runs past the end"):
        GGUFFile(cut)
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:100])  # the metadata itself is cut
    with pytest.raises(GGUFFormatError, match="not a whole GGUF file"):
        GGUFFile(header)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty"):
        GGUFFile(empty)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFFormatError, match="does not start with 'GGUF'"):
        GGUFFile(other)


def _write(path: Path, fill: Callable[[gguf.GGUFWriter], None]) -> Path:
    """A GGUF file of metadata alone, written by gguf-py."""
    writer = gguf.GGUFWriter(path, "llama")
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_arrays_of_arrays_are_read(tmp_path: Path) -> None:
    """gguf.md allows an array's elements to be arrays; gguf-py reads them, and so does this."""
    path = _write(tmp_path / "nested.gguf", lambda w: w.add_array("x.nested", [[1, 2], [3]]))
    assert GGUFFile(path).fields["x.nested"] == [[1, 2], [3]]


def test_a_file_cut_inside_a_numeric_array_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "scores.gguf", lambda w: w.add_array("x.scores", [0.5] * 1000))
    path.write_bytes(path.read_bytes()[:-100])  # the array's last 25 values are gone
    with pytest.raises(GGUFFormatError, match="an array runs past the end"):
        GGUFFile(path)


@pytest.mark.parametrize("alignment", [0, 24])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path: Path, alignment: int) -> None:
    path = _write(tmp_path / "aligned.gguf", lambda w: w.add_uint32("general.alignment", alignment))
    with pytest.raises(GGUFFormatError, match=f"general.alignment {alignment} is not a power"):
        GGUFFile(path)


def _patched(tmp_path: Path, old: bytes, new: bytes, at: int = 0) -> Path:
    """A file of two keys and two tensors (8 float32 values each), written by gguf-py, with
    the bytes ``old`` (their first occurrence) replaced by ``new`` at ``at`` bytes after it."""

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_uint32("x.aa", 1)
        writer.add_uint32("x.bb", 2)
        writer.add_tensor("ta", np.zeros(8, dtype=np.float32))
        writer.add_tensor("tb", np.zeros(8, dtype=np.float32))

    path = _write(tmp_path / "two.gguf", fill)
    data = bytearray(path.read_bytes())
    where = data.index(old) + at
    data[where : where + len(new)] = new
    path.write_bytes(bytes(data))
    return path


def test_a_key_or_a_tensor_named_twice_is_refused(tmp_path: Path) -> None:
    assert GGUFFile(_patched(tmp_path, b"x.bb", b"x.bb")).fields["x.bb"] == 2  # unpatched
    with pytest.raises(GGUFFormatError, match=r"holds the key x\.aa twice"):
        GGUFFile(_patched(tmp_path, b"x.bb", b"x.aa"))
    with pytest.raises(GGUFFormatError, match="names a tensor twice"):
        GGUFFile(_patched(tmp_path, b"tb", b"ta"))


def test_a_tensor_table_that_cannot_be_is_refused(tmp_path: Path) -> None:
    """The tensor table after a name: n_dims (u32), the dims (u64 each), the type (u32)."""
    n_dims = len("ta")
    with pytest.raises(GGUFFormatError, match="tensor ta has 5 dimensions"):
        GGUFFile(_patched(tmp_path, b"ta", (5).to_bytes(4, "little"), at=n_dims))
    q8_0 = (8).to_bytes(4, "little")  # 8 values are not a whole block of 32
    with pytest.raises(GGUFFormatError, match="rows of 8 values are not whole blocks of 32"):
        GGUFFile(_patched(tmp_path, b"ta", q8_0, at=n_dims + 4 + 8))
