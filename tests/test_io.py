"""Untrusted files: logits are read without pickle; writes are atomic."""

from pathlib import Path

import numpy as np
import pytest

from qdiff.core.io import load_array, save_array, write_text


def test_pickled_arrays_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "logits.npy"
    np.save(path, np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        load_array(path)


def test_atomic_writes_leave_no_partial_file(tmp_path: Path) -> None:
    save_array(tmp_path / "a.npy", np.arange(3, dtype=np.float32))
    assert load_array(tmp_path / "a.npy").tolist() == [0, 1, 2]
    with pytest.raises(TypeError):  # fails while writing: the target must not appear
        write_text(tmp_path / "b.txt", 123)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]
    assert oct((tmp_path / "a.npy").stat().st_mode & 0o777) != "0o600"  # shared, not private


def test_the_workflow_side_never_loads_llama_cpp() -> None:
    """The Snakefile and each run's supervising parent import these modules; only the
    isolated worker may load llama.cpp's native code (a crash there must not spread)."""
    import subprocess
    import sys

    code = (
        "import sys, qdiff.core.config, qdiff.engine.stage, qdiff.engine.provenance, qdiff.compare.pairs, qdiff.report\n"
        "print('llama_cpp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
