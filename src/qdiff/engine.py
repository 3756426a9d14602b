"""Drive llama.cpp through llama-cpp-python's low-level binding.

The high-level ``llama_cpp.Llama`` class hides settings that change numerics
(``use_extra_bufts``, ``op_offload``, the split mode) and builds its own context
parameters, so qdiff sets every parameter itself here. This module loads native code:
only the isolated worker process (``qdiff.worker``) and the quantize step import it.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from qdiff.settings import DeviceSettings

ALL_LAYERS = 0x7FFFFFFF  # llama.cpp clamps this to the model's layer count

# ggml registry names of each backend qdiff knows (ggml_backend_reg_name)
BACKEND_REGISTRIES = {
    "cpu": {"CPU"},
    "cuda": {"CUDA"},
    "metal": {"Metal", "MTL"},
    "vulkan": {"Vulkan"},
}
_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8}


class LlamaLog:
    """Collects llama.cpp's log and mirrors it to stderr as it arrives.

    Mirroring byte by byte to file descriptor 2 means a crash still leaves the log's
    tail in the job's log file, where the parent process reads it.
    """

    def __init__(self) -> None:
        self.chunks: list[str] = []

        @llama_cpp.llama_log_callback
        def _callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            self.chunks.append(text.decode("utf-8", errors="replace"))
            os.write(2, text)

        self._callback = _callback  # llama.cpp keeps a raw pointer: keep the object alive
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    @property
    def text(self) -> str:
        return "".join(self.chunks)


@dataclass(frozen=True)
class BackendDevice:
    name: str  # "CPU", "CUDA0", "Vulkan0"
    description: str  # "NVIDIA H200", the CPU's model name, ...
    kind: str  # cpu | gpu | igpu | accel | meta
    registry: str  # "CPU", "CUDA", "Metal", "Vulkan", "BLAS", ...


def _shared_library(stem: str) -> ctypes.CDLL:
    """One of the ggml libraries bundled with llama-cpp-python (e.g. "ggml", "ggml-base")."""
    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in (f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll"):
        if (libdir / name).exists():
            return ctypes.CDLL(str(libdir / name))
    raise RuntimeError(f"lib{stem} not found in {libdir}")


def _libggml() -> ctypes.CDLL:
    lib = _shared_library("ggml")
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    return lib


def backend_devices() -> list[BackendDevice]:
    """The ggml backend devices this build of llama-cpp-python can use on this machine."""
    lib = _libggml()
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        devices.append(
            BackendDevice(
                name=lib.ggml_backend_dev_name(dev).decode(),
                description=lib.ggml_backend_dev_description(dev).decode(),
                kind=_DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "unknown"),
                registry=lib.ggml_backend_reg_name(reg).decode(),
            )
        )
    return devices


def devices_for_backend(
    backend: str, devices: list[BackendDevice]
) -> list[BackendDevice]:
    """The devices that can run ``backend``; an empty list means the backend is absent."""
    registries = BACKEND_REGISTRIES[backend]
    wanted_kinds = {"cpu"} if backend == "cpu" else {"gpu", "igpu"}
    return [d for d in devices if d.registry in registries and d.kind in wanted_kinds]


def system_info() -> str:
    return llama_cpp.llama_print_system_info().decode().strip()


def _model_params(device: DeviceSettings) -> llama_cpp.llama_model_params:
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0 if device.backend == "cpu" else ALL_LAYERS
    # one device only: a split across GPUs would be another numerics variable
    params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_NONE
    params.main_gpu = device.main_gpu
    params.use_extra_bufts = device.extra_bufts
    return params


def _context_params(
    device: DeviceSettings, n_ctx: int, eval_callback: Any = None
) -> llama_cpp.llama_context_params:
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = device.n_batch
    params.n_ubatch = min(device.n_ubatch, device.n_batch)
    params.n_seq_max = 1
    params.n_threads = device.threads
    params.n_threads_batch = device.threads
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if device.flash_attn
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    on_gpu = device.backend != "cpu"
    params.offload_kqv = on_gpu
    params.op_offload = on_gpu and device.op_offload
    params.type_k = KV_TYPES[device.kv_cache_type]
    params.type_v = KV_TYPES[device.kv_cache_type]
    params.no_perf = True
    if eval_callback is not None:
        params.cb_eval = eval_callback
    return params


@dataclass
class Generation:
    """Greedy generation from one prompt, with the logits of the first step."""

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    first_logits: np.ndarray  # float32, full vocabulary
    prompt_seconds: float
    decode_seconds: list[float]  # one per decode step after the prompt
    stopped_at_eog: bool


class LoadedModel:
    """One model and one context, loaded with a device's settings."""

    def __init__(self, path: Path, device: DeviceSettings, n_ctx: int) -> None:
        self.device = device
        self.n_ctx = n_ctx
        start = time.perf_counter()
        self._model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), _model_params(device)
        )
        if not self._model:
            raise ModelLoadError(
                f"llama.cpp could not load {path}: see the llama.cpp log above for the reason"
            )
        self._ctx = llama_cpp.llama_init_from_model(
            self._model, _context_params(device, n_ctx)
        )
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ModelLoadError(f"llama.cpp could not create a context for {path}")
        self.load_seconds = time.perf_counter() - start
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

    def set_eval_callback(self, callback: Any) -> None:
        """Recreate the context with llama.cpp's eval callback (cb_eval), or without (None)."""
        llama_cpp.llama_free(self._ctx)
        self._ctx = llama_cpp.llama_init_from_model(
            self._model, _context_params(self.device, self.n_ctx, callback)
        )
        if not self._ctx:
            raise ModelLoadError("llama.cpp could not create a context with an eval callback")

    def prefill(self, prompt_tokens: list[int]) -> tuple[np.ndarray, float]:
        """Decode the prompt from an empty cache: the first-step logits and the seconds."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)
        start = time.perf_counter()
        self._decode(prompt_tokens)
        return self._last_logits(), time.perf_counter() - start

    def close(self) -> None:
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode(errors="replace")

    def apply_chat_template(self, user_text: str, builtin: str | None = None) -> str:
        """Wrap ``user_text`` in the model's chat template, or in llama.cpp's built-in
        template called ``builtin`` (e.g. "gemma", "chatml")."""
        if builtin:
            template = builtin.encode()
        else:
            template = llama_cpp.llama_model_chat_template(self._model, None)
        if not template:
            raise ValueError(
                "the model has no chat template: set generation.chat_template to false "
                "or to the name of a llama.cpp built-in template"
            )
        messages = (llama_cpp.llama_chat_message * 1)(
            llama_cpp.llama_chat_message(b"user", user_text.encode())
        )
        needed = llama_cpp.llama_chat_apply_template(template, messages, 1, True, None, 0)
        if needed < 0:
            raise ValueError(
                "llama.cpp does not support this model's chat template: "
                "set generation.chat_template: false"
            )
        buf = ctypes.create_string_buffer(needed + 1)
        llama_cpp.llama_chat_apply_template(template, messages, 1, True, buf, needed + 1)
        return buf.raw[:needed].decode("utf-8")

    def tokenize(self, text: str, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(
                self._vocab, data, len(data), buf, capacity, True, parse_special
            )
            if n >= 0:
                return list(buf[:n])
            capacity = -n

    def detokenize(self, tokens: list[int]) -> str:
        pieces = bytearray()
        buf = ctypes.create_string_buffer(256)
        for token in tokens:
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:  # piece longer than the buffer
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(
                    self._vocab, token, buf, len(buf), 0, False
                )
            pieces += buf.raw[:n]
        return pieces.decode("utf-8", errors="replace")

    def _decode(self, tokens: list[int]) -> None:
        for start in range(0, len(tokens), self.device.n_batch):
            chunk = tokens[start : start + self.device.n_batch]
            array = (llama_cpp.llama_token * len(chunk))(*chunk)
            rc = llama_cpp.llama_decode(
                self._ctx, llama_cpp.llama_batch_get_one(array, len(chunk))
            )
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
        llama_cpp.llama_synchronize(self._ctx)  # GPU backends return before finishing

    def _last_logits(self) -> np.ndarray:
        pointer = llama_cpp.llama_get_logits_ith(self._ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def generate(self, prompt_tokens: list[int], n_new: int) -> Generation:
        """Greedy decoding (argmax, lowest id on ties) from an empty KV cache."""
        self._check_context(len(prompt_tokens), n_new, "new tokens")
        first_logits, prompt_seconds = self.prefill(prompt_tokens)

        logits, tokens, decode_seconds, stopped = first_logits, [], [], False
        while True:
            token = int(np.argmax(logits))
            tokens.append(token)
            if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                stopped = True
                break
            if len(tokens) == n_new:
                break
            start = time.perf_counter()
            self._decode([token])
            logits = self._last_logits()
            decode_seconds.append(time.perf_counter() - start)
        return Generation(
            prompt_tokens=list(prompt_tokens),
            tokens=tokens,
            text=self.detokenize(tokens),
            first_logits=first_logits,
            prompt_seconds=prompt_seconds,
            decode_seconds=decode_seconds,
            stopped_at_eog=stopped,
        )

    def force(
        self, prompt_tokens: list[int], forced: list[int],
        on_logits: Callable[[int, np.ndarray], None],
    ) -> float:
        """Teacher forcing: decode the prompt, then feed ``forced`` one token at a time,
        calling ``on_logits(i, logits)`` with the logits that predict forced token ``i``. Token by token,
        like ``generate``, so the arithmetic path (batch size 1 per step) is the same and
        a combination forced along its own greedy output reproduces its own logits.
        Returns the seconds spent."""
        self._check_context(len(prompt_tokens), len(forced), "forced tokens")
        start = time.perf_counter()
        logits, _ = self.prefill(prompt_tokens)
        for i, token in enumerate(forced):
            on_logits(i, logits)
            if i + 1 < len(forced):
                self._decode([token])
                logits = self._last_logits()
        return time.perf_counter() - start

    def _check_context(self, n_prompt: int, n_more: int, what: str) -> None:
        if n_prompt + n_more > self.n_ctx:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + {n_more} {what} exceed "
                f"generation.n_ctx = {self.n_ctx}"
            )


class ModelLoadError(RuntimeError):
    pass


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


_FLOAT_TYPES = {0: np.float32, 1: np.float16}  # GGML_TYPE_F32, GGML_TYPE_F16 (BF16 below)
GGML_TYPE_BF16 = 30
# llama.cpp's names for reshaped, permuted or viewed tensors: no new arithmetic
_DERIVED_NAME = re.compile(r"\((view|permuted|reshaped|transposed|cont|copy)[^)]*\)$")
_UNNAMED = re.compile(r"^(node|leaf)_\d+$")  # ggml's default names, numbered per graph
_NO_ARITHMETIC = {"NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"}
KEEP_WHOLE_MAX = 1 << 20  # elements; larger tensors without a token axis are skipped


@dataclass
class CapturedTensor:
    name: str
    op: str
    type: str
    ne: list[int]  # ggml order: ne[0] is the contiguous dimension
    weight: str | None  # a matmul's weight tensor and its type, e.g. "blk.0.attn_q.weight q4_K"
    kept: str  # "last position" or "whole"
    values: np.ndarray


class TensorCapture:
    """Reads named intermediate tensors of a forward pass through llama.cpp's eval callback
    (``cb_eval``, the mechanism behind llama-eval-callback). For each tensor whose name
    matches ``pattern`` it keeps the values of the last token position, or the whole tensor
    when it has no token axis (e.g. the last layer after llama.cpp drops unused rows)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)
        self.lib = _libggml_base()
        self.n_tokens = 0
        self.tensors: list[CapturedTensor] = []
        self.error: BaseException | None = None
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def start(self, n_tokens: int) -> None:
        self.n_tokens, self.tensors, self.error = n_tokens, [], None

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
            if ask:
                return self._wanted(t, name, address)
            self.tensors.append(self._read(t, name, address))
        except BaseException as exc:  # never let an exception unwind through C
            self.error = self.error or exc
        return True

    def _read(self, t: _GgmlTensor, name: str, address: int) -> CapturedTensor:
        lib = self.lib
        ne = [int(x) for x in t.ne]
        real_name = lib.ggml_get_name(address).decode(errors="replace")
        if (real_name != name and not _UNNAMED.match(real_name)) or int(
            lib.ggml_nelements(address)
        ) != int(np.prod(ne)):
            raise RuntimeError("struct ggml_tensor layout differs from qdiff's: update engine._GgmlTensor")
        raw = np.empty(int(lib.ggml_nbytes(address)), dtype=np.uint8)
        lib.ggml_backend_tensor_get(address, raw.ctypes.data, 0, raw.size)
        if t.type == GGML_TYPE_BF16:
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.view(_FLOAT_TYPES[t.type]).astype(np.float32)
        array = values.reshape(ne[::-1])
        axis = next((d for d in (1, 2, 3) if ne[d] == self.n_tokens), None)
        if axis is not None:
            kept, values = "last position", np.take(array, self.n_tokens - 1, axis=3 - axis).ravel()
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
            name=name, op=op, type=lib.ggml_type_name(t.type).decode(), ne=ne,
            weight=weight, kept=kept, values=np.ascontiguousarray(values, dtype=np.float32),
        )


def _libggml_base() -> ctypes.CDLL:
    lib = _shared_library("ggml-base")
    for fn, restype in (
        ("ggml_get_name", ctypes.c_char_p), ("ggml_op_desc", ctypes.c_char_p),
        ("ggml_nelements", ctypes.c_int64), ("ggml_nbytes", ctypes.c_size_t),
        ("ggml_is_contiguous", ctypes.c_bool),
    ):
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
    ]
    return lib


def init_backend() -> LlamaLog:
    """Route llama.cpp's log through qdiff and initialise the backends, once per process."""
    log = LlamaLog()
    llama_cpp.llama_backend_init()
    return log

