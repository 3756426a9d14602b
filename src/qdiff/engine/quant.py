"""Requantize and dequantize GGUF files with llama.cpp's own llama_model_quantize.

The conversion runs in a child process (``python -m qdiff.engine.quant SRC DST TYPE THREADS``), as
inference does, so a corrupt file that crashes llama.cpp fails only its own job, with
llama.cpp's reason.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from qdiff.core.formats import COPY_TYPES, QUANT_TYPES
from qdiff.core.records import failure_text

# less free space than this right after a failed conversion: the disk filled up
FULL_DISK_BYTES = 16 * 2**20


def quantize(src: Path, dst: Path, target: str, threads: int) -> int:
    """Write ``src`` converted to ``target`` (a QUANT_TYPES or COPY_TYPES name) at
    ``dst``; llama_model_quantize's return code (0: done)."""
    from qdiff.engine.bindings import llama_cpp  # native code: imported only by the child

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = {**QUANT_TYPES, **COPY_TYPES}[target]
    params.allow_requantize = True  # the source is usually quantized already
    return int(
        llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    )


def derive(
    source: Path,
    source_info: dict[str, Any],
    dest: Path,
    target: str,
    threads: int,
    log_path: Path,
    timeout_s: float = 3600.0,
) -> str:
    """Convert ``source`` to ``target`` at ``dest`` in a child process; raise StageError
    naming the reason (a missing source, llama.cpp's message, a crash's signal)."""
    from qdiff.engine.llamalog import abort_lines
    from qdiff.jobs import StageError, disk_full, spawn

    if source_info.get("status", "ok") != "ok":
        raise StageError(
            f"its source {source_info['file']} is missing: {failure_text(source_info)}"
        )
    partial = dest.with_name(dest.name + ".partial")
    partial.unlink(missing_ok=True)
    code = spawn(
        [
            sys.executable,
            "-m",
            "qdiff.engine.quant",
            str(source),
            str(partial),
            target,
            str(threads),
        ],
        log_path,
        timeout_s,
    )
    if code != 0 or not partial.exists():
        # measured before the partial copy is removed: a write that filled the disk
        filled = shutil.disk_usage(dest.parent).free < FULL_DISK_BYTES
        partial.unlink(missing_ok=True)
        if filled:
            raise StageError(f"making the {target} copy failed: {disk_full(dest.parent)}")
        log = log_path.read_text(errors="replace")
        said = [
            line for line in log.splitlines() if line.startswith("[qdiff] llama_model_quantize")
        ]
        why = (
            said[-1].removeprefix("[qdiff] ")
            if said
            else "; ".join(abort_lines(log)) or "no reason in the log"
        )
        if code is None:
            why = f"stopped after {timeout_s:g} s"
        elif code < 0:
            why = f"llama.cpp was killed by {signal.Signals(-code).name} ({why})"
        raise StageError(
            f"making the {target} copy of {source_info['file']} failed: {why}. Is the source "
            "a complete GGUF file?"
        )
    partial.replace(dest)
    return target


def main(argv: list[str]) -> int:
    from qdiff.engine.log import init_backend

    src, dst, target, threads = Path(argv[0]), Path(argv[1]), argv[2], int(argv[3])
    log = init_backend()
    rc = quantize(src, dst, target, threads)
    if rc != 0 or not dst.exists():
        print(
            f"[qdiff] llama_model_quantize failed (code {rc}): "
            + ("; ".join(log.errors) or "llama.cpp logged no error"),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
