"""Atomic writes and pickle-free reads: nothing half-written ever looks complete."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from qdiff.core import secrets

if TYPE_CHECKING:  # imported where arrays are read or written, which most job parents never do
    import numpy as np


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic(path: Path, mode: str, write: Callable[[IO[Any]], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; results are shared files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, value: Any) -> None:
    """Every record and sidecar is written here: a hidden value this process holds never is
    (qdiff.core.secrets.scrub)."""
    text = json.dumps(secrets.scrub(value), indent=1, sort_keys=False, default=str)
    _atomic(path, "w", lambda f: f.write(text + "\n"))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def write_text(path: Path, text: str) -> None:
    _atomic(path, "w", lambda f: f.write(text))


def save_array(path: Path, array: np.ndarray) -> None:
    import numpy as np

    _atomic(path, "wb", lambda f: np.save(f, array, allow_pickle=False))


def load_array(path: Path) -> np.ndarray:
    """Load a .npy file; object arrays (which need pickle) are refused."""
    import numpy as np

    return np.load(path, allow_pickle=False)


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Several named arrays in one uncompressed .npz file."""
    import numpy as np

    _atomic(path, "wb", lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """All arrays of a .npz file, read at once; object arrays are refused."""
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}
