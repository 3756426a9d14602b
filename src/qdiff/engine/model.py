"""One model and one context in llama.cpp, through llama-cpp-python's low-level binding.

The high-level ``llama_cpp.Llama`` class hides settings that change numerics
(``use_extra_bufts``, ``op_offload``, the split mode) and builds its own context
parameters, so qdiff sets every parameter itself here.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.core.formats import GGML_TYPES
from qdiff.core.settings import DeviceSettings
from qdiff.engine.bindings import llama_cpp

ALL_LAYERS = 0x7FFFFFFF  # llama.cpp clamps this to the model's layer count


class ModelLoadError(RuntimeError):
    """llama.cpp could not load the model file."""


class ContextError(RuntimeError):
    """llama.cpp loaded the model but refused a context with the device's settings."""


def _model_params(
    device: DeviceSettings, gpu: int | None
) -> tuple[llama_cpp.llama_model_params, Any]:
    """The model's parameters, and the device list they point to (keep it alive while the
    model loads). A GPU run names its one device (``gpu``, a ggml_backend_dev_t): left to
    itself, llama.cpp skips a second backend's device of the same GPU (Vulkan0 beside
    CUDA0), and ``main_gpu`` would index every backend's GPUs together."""
    params = llama_cpp.llama_model_default_params()
    chosen = None
    if device.on_gpu:
        if not gpu:
            raise ValueError("a GPU run needs its device")
        chosen = (ctypes.c_void_p * 2)(gpu, None)  # NULL-terminated
        params.devices = ctypes.cast(chosen, ctypes.c_void_p)
    params.n_gpu_layers = ALL_LAYERS if device.on_gpu else 0
    # one device only: a split across GPUs would be another numerics variable
    params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_NONE
    params.main_gpu = 0  # the first (only) device of the list above
    params.use_extra_bufts = device.extra_bufts
    return params, chosen


def _context_params(
    device: DeviceSettings,
    n_ctx: int,
    eval_callback: Any = None,
    n_seq_max: int = 1,
    kv_unified: bool = False,
) -> llama_cpp.llama_context_params:
    """A context's parameters: the device's settings, and how many sequences it holds in
    one KV cache (``kv_unified``) or in one per sequence (qdiff.engine.serving)."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = device.n_batch
    params.n_ubatch = min(device.n_ubatch, device.n_batch)
    params.n_seq_max = n_seq_max
    params.kv_unified = kv_unified
    params.n_threads = device.threads
    params.n_threads_batch = device.threads
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if device.flash_attn
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    on_gpu = device.on_gpu
    params.offload_kqv = on_gpu
    params.op_offload = on_gpu and device.op_offload
    params.type_k = GGML_TYPES[device.kv_cache_type]
    params.type_v = GGML_TYPES[device.kv_cache_type]
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
    top1_probs: list[float]  # per step, the softmax probability of the token chosen


def top1_probability(logits: np.ndarray) -> float:
    """The softmax probability of the most likely token, in float64 (1 / Σ exp(l - max))."""
    x = np.asarray(logits, dtype=np.float64)
    return float(1.0 / np.exp(x - x.max()).sum())


class LoadedModel:
    """One model and one context, loaded with a device's settings."""

    def __init__(
        self, path: Path, device: DeviceSettings, n_ctx: int, gpu: int | None = None
    ) -> None:
        """``gpu``: the ggml device (handle) a GPU device's run uses."""
        self.device = device
        self.n_ctx = n_ctx
        start = time.perf_counter()
        params, _devices = _model_params(device, gpu)
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(
                f"llama.cpp could not load {path}: see the llama.cpp log above for the reason"
            )
        self._ctx = llama_cpp.llama_init_from_model(self._model, _context_params(device, n_ctx))
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ContextError("llama.cpp refused a context with this device's settings")
        self.load_seconds = time.perf_counter() - start
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

    def new_context(
        self, device: DeviceSettings, n_ctx: int, n_seq_max: int, kv_unified: bool
    ) -> Any:
        """Another context of this model (a llama_context; free it with llama_free), with
        ``device``'s settings and ``n_seq_max`` sequences (qdiff.engine.serving)."""
        params = _context_params(device, n_ctx, n_seq_max=n_seq_max, kv_unified=kv_unified)
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not ctx:
            raise ContextError(
                f"llama.cpp refused a context of {n_ctx} cells for {n_seq_max} sequences "
                f"({'unified' if kv_unified else 'split'} KV cache)"
            )
        return ctx

    def bos_added(self) -> int | None:
        """The BOS token where the model's tokenizer adds one, else None."""
        if not llama_cpp.llama_vocab_get_add_bos(self._vocab):
            return None
        return int(llama_cpp.llama_vocab_bos(self._vocab))

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def set_eval_callback(self, callback: Any) -> None:
        """Recreate the context with llama.cpp's eval callback (cb_eval), or without (None)."""
        llama_cpp.llama_free(self._ctx)
        self._ctx = llama_cpp.llama_init_from_model(
            self._model, _context_params(self.device, self.n_ctx, callback)
        )
        if not self._ctx:
            raise ContextError("llama.cpp refused a context with an eval callback")

    def prefill(self, prompt_tokens: list[int]) -> tuple[np.ndarray, float]:
        """Decode the prompt from an empty cache: the first-step logits and the seconds."""
        self.clear()
        return self.extend(prompt_tokens)

    def clear(self) -> None:
        """Empty the KV cache."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)

    def extend(self, tokens: list[int]) -> tuple[np.ndarray, float]:
        """Decode ``tokens`` after what the cache holds: the last logits and the seconds."""
        start = time.perf_counter()
        self._decode(tokens)
        return self._last_logits(), time.perf_counter() - start

    def last_ubatch(self, n_tokens: int) -> int:
        """How many of a prompt's ``n_tokens`` llama.cpp computes in its last graph: the
        decode splits the prompt into chunks of ``n_batch`` (``_decode``) and llama.cpp each
        chunk into ubatches of ``n_ubatch``."""
        n_ubatch = min(self.device.n_ubatch, self.device.n_batch)
        last_chunk = (n_tokens - 1) % self.device.n_batch + 1
        return (last_chunk - 1) % n_ubatch + 1

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

    def prompt_tokens(self, text: str, chat: bool | str) -> list[int]:
        """A prompt's tokens: the text as is (``chat`` false), or wrapped in the model's chat
        template (true) or in the built-in template ``chat`` names."""
        if chat is False:
            return self.tokenize(text, parse_special=False)
        wrapped = self.apply_chat_template(text, chat if isinstance(chat, str) else None)
        return self.tokenize(wrapped, parse_special=True)

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
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            pieces += buf.raw[:n]
        return pieces.decode("utf-8", errors="replace")

    def _decode(self, tokens: list[int]) -> None:
        for start in range(0, len(tokens), self.device.n_batch):
            chunk = tokens[start : start + self.device.n_batch]
            array = (llama_cpp.llama_token * len(chunk))(*chunk)
            rc = llama_cpp.llama_decode(self._ctx, llama_cpp.llama_batch_get_one(array, len(chunk)))
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
        top1_probs: list[float] = []
        while True:
            token = int(np.argmax(logits))
            tokens.append(token)
            top1_probs.append(top1_probability(logits))
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
            top1_probs=top1_probs,
        )

    def force(
        self,
        prompt_tokens: list[int],
        forced: list[int],
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

    @contextmanager
    def spare_context(self) -> Iterator[Any]:
        """A second context like this model's own (the device's settings, one sequence of
        ``n_ctx`` cells), freed on leaving: one window's logits stay in its output buffer
        while the next window is scored in the other (``score``'s ``context``)."""
        ctx = self.new_context(self.device, self.n_ctx, 1, kv_unified=False)
        try:
            yield ctx
        finally:
            llama_cpp.llama_free(ctx)

    def score(
        self,
        tokens: list[int],
        first: int,
        out: np.ndarray | None = None,
        context: Any = None,
    ) -> np.ndarray:
        """Decode ``tokens`` from an empty cache in batches of ``n_batch``, as llama-perplexity
        decodes a window, asking for the logits of positions ``first`` onward alone: their
        rows (len(tokens) - first, n_vocab). Where the window is one batch and no ``out`` is
        given, the rows are llama.cpp's own output buffer, read in place as llama-perplexity
        reads it (perplexity.cpp copies no logits): read-only, and valid only until
        ``context`` decodes again. Otherwise they are copied into ``out``'s first rows (a
        buffer used again spares a fresh one's page faults), or into a new array.
        ``context``: the llama_context to decode in (``spare_context``'s; default this
        model's own)."""
        self._check_context(len(tokens), 0, "tokens")
        ctx = self._ctx if context is None else context
        n_rows = len(tokens) - first
        batches = self._decoded_rows(ctx, tokens, first)
        if out is None and len(tokens) <= self.device.n_batch and n_rows > 0:
            (rows,) = batches  # the one batch's rows; running the generator out frees the batch
            rows.flags.writeable = False
            return rows
        out = np.empty((n_rows, self.n_vocab), np.float32) if out is None else out[:n_rows]
        done = 0  # rows copied
        for rows in batches:
            out[done : done + len(rows)] = rows
            done += len(rows)
        llama_cpp.llama_synchronize(ctx)
        return out

    def _decoded_rows(self, ctx: Any, tokens: list[int], first: int) -> Iterator[np.ndarray]:
        """Decode ``tokens`` in ``ctx`` from an empty cache, batch by batch; after each batch
        that outputs any, its rows of logits (positions ``first`` onward) as a view of
        llama.cpp's output buffer, which the next decode overwrites."""
        n_batch = self.device.n_batch
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        try:
            # one sequence throughout: its ids once, the tokens, positions and output flags
            # of each batch through numpy views of the batch's arrays
            for k in range(n_batch):
                batch.seq_id[k][0] = 0
            np.ctypeslib.as_array(batch.n_seq_id, shape=(n_batch,))[:] = 1
            ids = np.ctypeslib.as_array(batch.token, shape=(n_batch,))
            positions = np.ctypeslib.as_array(batch.pos, shape=(n_batch,))
            wanted = np.ctypeslib.as_array(batch.logits, shape=(n_batch,))
            for start in range(0, len(tokens), n_batch):
                chunk = tokens[start : start + n_batch]
                ids[: len(chunk)] = chunk
                positions[: len(chunk)] = np.arange(start, start + len(chunk))
                wanted[: len(chunk)] = positions[: len(chunk)] >= first
                batch.n_tokens = len(chunk)
                rc = llama_cpp.llama_decode(ctx, batch)
                if rc != 0:
                    raise RuntimeError(f"llama_decode failed with code {rc}")
                n_out = int(np.count_nonzero(wanted[: len(chunk)]))
                if n_out:
                    pointer = llama_cpp.llama_get_logits(ctx)  # waits for the device
                    yield np.ctypeslib.as_array(pointer, shape=(n_out, self.n_vocab))
        finally:
            llama_cpp.llama_batch_free(batch)

    def _check_context(self, n_prompt: int, n_more: int, what: str) -> None:
        if n_prompt + n_more > self.n_ctx:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + {n_more} {what} exceed "
                f"generation.n_ctx = {self.n_ctx}"
            )
