"""Drive llama.cpp through llama-cpp-python's low-level binding.

The high-level ``llama_cpp.Llama`` class hides settings that change numerics
(``use_extra_bufts``, ``op_offload``, the split mode) and builds its own context
parameters, so qdiff sets every parameter itself here. This module loads native code:
only the isolated worker process (``qdiff.worker``) and the quantize step import it.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

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


def _libggml() -> ctypes.CDLL:
    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml.so", "libggml.dylib", "ggml.dll"):
        if (libdir / name).exists():
            lib = ctypes.CDLL(str(libdir / name))
            break
    else:
        raise RuntimeError(f"libggml not found in {libdir}")
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
    device: DeviceSettings, n_ctx: int
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
        if len(prompt_tokens) + n_new > self.n_ctx:
            raise ValueError(
                f"prompt ({len(prompt_tokens)} tokens) + {n_new} new tokens exceed "
                f"generation.n_ctx = {self.n_ctx}"
            )
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)
        start = time.perf_counter()
        self._decode(prompt_tokens)
        first_logits = self._last_logits()
        prompt_seconds = time.perf_counter() - start

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


class ModelLoadError(RuntimeError):
    pass


def init_backend() -> LlamaLog:
    """Route llama.cpp's log through qdiff and initialise the backends, once per process."""
    log = LlamaLog()
    llama_cpp.llama_backend_init()
    return log

