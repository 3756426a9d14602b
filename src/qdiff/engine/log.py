"""llama.cpp's log, captured with its levels."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from qdiff.engine.bindings import llama_cpp

GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE, DEBUG, INFO, WARN, ERROR, CONT
GGML_LOG_LEVEL_CONT = 5  # continues the previous message


class LlamaLog:
    """Collects llama.cpp's log and mirrors it to stderr as it arrives.

    Mirroring byte by byte to file descriptor 2 means a crash still leaves the log's tail
    in the job's log file. Messages at ERROR level, llama.cpp's own statement of what went
    wrong, are also appended at once to ``errors_file``, so the supervising process can
    give them as the reason even when this process dies right after.
    """

    def __init__(self, errors_file: Path | None = None) -> None:
        self.chunks: list[str] = []
        self.errors: list[str] = []
        self._errors_file = errors_file
        self._in_error = False

        @llama_cpp.llama_log_callback
        def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            message = text.decode("utf-8", errors="replace")
            self.chunks.append(message)
            os.write(2, text)
            if level != GGML_LOG_LEVEL_CONT:
                self._in_error = level == GGML_LOG_LEVEL_ERROR
            if self._in_error:
                self._error(message, continues=level == GGML_LOG_LEVEL_CONT)

        self._callback = _callback  # llama.cpp keeps a raw pointer: keep the object alive
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _error(self, message: str, continues: bool) -> None:
        line = message.strip()
        if not line:
            return
        if continues and self.errors:
            self.errors[-1] += " " + line
        else:
            self.errors.append(line)
        if self._errors_file is not None:
            self._errors_file.write_text("\n".join(self.errors) + "\n")

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def init_backend(errors_file: Path | None = None) -> LlamaLog:
    """Route llama.cpp's log through qdiff and initialise the backends, once per process."""
    log = LlamaLog(errors_file)
    llama_cpp.llama_backend_init()
    return log
