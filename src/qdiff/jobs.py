"""Helpers shared by the thin workflow scripts."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO


def log_to(path: str | Path) -> TextIO:
    """Send this job's stderr to its Snakemake log, in append mode so that a child
    process writing to the same file is never overwritten."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("")
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the job
    os.dup2(stream.fileno(), 2)  # native code (llama.cpp) writes to fd 2 directly
    sys.stderr = stream
    return stream


def model_info(path: Path, sha256: str, origin: str) -> dict[str, object]:
    """The sidecar written next to every model file: what a run needs for provenance."""
    return {
        "file": path.name,
        "sha256": sha256,
        "bytes": path.stat().st_size,
        "origin": origin,
    }
