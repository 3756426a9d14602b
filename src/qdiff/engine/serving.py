"""Serving conditions in llama.cpp: one prompt (the needle) decoded as a server would, and
compared step by step with the same prompt decoded alone (qdiff.core.serving names the
cases).

Every decode goes through ``Slots``: one llama.cpp context holding several sequences, each
fed its own tokens at its own positions in one ``llama_batch``, split into ``n_batch``
pieces as llama-server splits it. Decoding is greedy (argmax, lowest id on ties) for every
sequence, so the others of a batch go on generating beside the needle, as other requests
do. A case's steps are compared with the reference's up to and including the first step
whose greedy tokens differ (the fork): after it the two decode different texts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from qdiff.core.forced import DIGEST_ALGORITHM, digest, digest_algorithm
from qdiff.core.serving import Case
from qdiff.core.settings import DeviceSettings
from qdiff.engine.bindings import llama_cpp
from qdiff.engine.model import LoadedModel


class Slots:
    """One context of ``n_seq`` sequences (a server's slots) over a loaded model."""

    def __init__(
        self,
        loaded: LoadedModel,
        device: DeviceSettings,
        n_seq: int,
        n_ctx_seq: int,
        kv_unified: bool,
    ) -> None:
        self.loaded, self.device = loaded, device
        # a split cache gives every sequence n_ctx / n_seq cells; a unified one shares them
        self.ctx = loaded.new_context(device, n_ctx_seq * n_seq, n_seq, kv_unified)
        self.pos = [0] * n_seq

    def __enter__(self) -> Slots:
        return self

    def __exit__(self, *exc: object) -> None:
        llama_cpp.llama_free(self.ctx)

    def decode(self, feeds: list[tuple[int, list[int]]]) -> dict[int, np.ndarray]:
        """Append each (sequence, tokens) of ``feeds`` to its sequence, all in one batch
        split into pieces of ``n_batch`` tokens; the logits after each sequence's last token."""
        entries = [
            (token, self.pos[seq] + i, seq, i == len(tokens) - 1)
            for seq, tokens in feeds
            for i, token in enumerate(tokens)
        ]
        for seq, tokens in feeds:
            self.pos[seq] += len(tokens)
        logits: dict[int, np.ndarray] = {}
        for start in range(0, len(entries), self.device.n_batch):
            logits |= self._decode_piece(entries[start : start + self.device.n_batch])
        return logits

    def _decode_piece(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
        batch = llama_cpp.llama_batch_init(len(entries), 0, 1)
        try:
            for i, (token, pos, seq, wanted) in enumerate(entries):
                batch.token[i], batch.pos[i] = token, pos
                batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 1, seq, wanted
            batch.n_tokens = len(entries)
            rc = llama_cpp.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
            llama_cpp.llama_synchronize(self.ctx)
            n_vocab = self.loaded.n_vocab
            return {
                seq: np.ctypeslib.as_array(
                    llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(n_vocab,)
                ).copy()
                for i, (_, _, seq, wanted) in enumerate(entries)
                if wanted
            }
        finally:
            llama_cpp.llama_batch_free(batch)

    def share_prefix(self, source: int, target: int, n: int) -> None:
        """``target`` gets ``source``'s first ``n`` cells, as a prompt cache hit does."""
        memory = llama_cpp.llama_get_memory(self.ctx)
        llama_cpp.llama_memory_seq_cp(memory, source, target, 0, n)
        self.pos[target] = n


@dataclass
class Decoded:
    """The needle's greedy decode: its tokens, and the logits each was chosen from."""

    tokens: list[int]
    logits: list[np.ndarray]
    _log_probs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def log_probs(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """A step's log-softmax and softmax in float64, computed once: a reference is
        compared with every case."""
        if step not in self._log_probs:
            log_p = _log_softmax(self.logits[step])
            self._log_probs[step] = log_p, np.exp(log_p)
        return self._log_probs[step]


def decode_together(
    slots: Slots,
    needle: int,
    first: dict[int, np.ndarray],
    n_steps: int,
    is_eog: Callable[[int], bool],
) -> Decoded:
    """Greedy decoding of every sequence of ``first`` (its logits after each prompt)
    together, one token per sequence per batch, until the needle has ``n_steps`` tokens or
    ends its text; another sequence leaves the batch when it ends its text, as a finished
    request leaves a server's."""
    logits = first
    tokens, steps = [], []
    while True:
        steps.append(logits[needle])
        tokens.append(int(np.argmax(logits[needle])))
        if len(tokens) == n_steps or is_eog(tokens[-1]):
            break
        chosen = {seq: int(np.argmax(row)) for seq, row in logits.items()}
        feeds = [(s, [t]) for s, t in chosen.items() if s == needle or not is_eog(t)]
        logits = slots.decode(feeds)
    return Decoded(tokens, steps)


@dataclass
class Needle:
    """One prompt to serve, the others that share the server with it, and its settings."""

    tokens: list[int]
    others: list[list[int]]  # other prompts' tokens, in the order they join
    long_tokens: list[int]  # one user turn padded to long_prompt_tokens (the threads case)
    n_steps: int
    n_ctx: int  # cells per sequence, as the run's context has

    def cells(self, *prompts: list[int]) -> int:
        """Cells per sequence for a slot holding these prompts: the run's n_ctx, or more
        where the longest prompt and its decoded steps need more."""
        return max(self.n_ctx, max(map(len, prompts)) + self.n_steps)


def needles(loaded: LoadedModel, spec: dict[str, Any], most: int) -> dict[str, Needle]:
    """Each needle's tokens; the ``most`` other prompts that join it (the other prompts
    in order, again from the first when there are fewer); and, for the threads case, one
    user turn of the other prompts' texts then the needle's, of at least
    long_prompt_tokens tokens."""
    settings, generation = spec["serving"], spec["generation"]
    chat = generation["chat_template"]
    texts = {p["id"]: p["text"] for p in spec["prompts"]}
    tokens = {pid: loaded.prompt_tokens(text, chat) for pid, text in texts.items()}
    made = {}
    for pid in settings["prompts"]:
        others = [other for other in texts if other != pid] or [pid]
        long_text, k = texts[pid], 0
        while (
            len(long_tokens := loaded.prompt_tokens(long_text, chat))
            < settings["long_prompt_tokens"]
        ):
            long_text = f"{texts[others[k % len(others)]]}\n\n{long_text}"
            k += 1
        made[pid] = Needle(
            tokens=tokens[pid],
            others=[tokens[others[i % len(others)]] for i in range(most)],
            long_tokens=long_tokens,
            n_steps=settings["n_tokens"],
            n_ctx=generation["n_ctx"],
        )
    return made


def reference(loaded: LoadedModel, device: DeviceSettings, needle: Needle) -> Decoded:
    """The needle alone in a fresh context with the device's own settings."""
    return _alone(loaded, device, needle.tokens, needle)


def _alone(
    loaded: LoadedModel, device: DeviceSettings, tokens: list[int], needle: Needle
) -> Decoded:
    with Slots(loaded, device, 1, needle.cells(tokens), kv_unified=False) as slots:
        return decode_together(slots, 0, slots.decode([(0, tokens)]), needle.n_steps, loaded.is_eog)


def run_case(
    loaded: LoadedModel, device: DeviceSettings, case: Case, needle: Needle
) -> tuple[Decoded, Decoded | None]:
    """The needle decoded under ``case``, and the reference it is compared with when it
    is not the plain one (the threads case's long prompt with the device's threads)."""
    if case.kind == "repeat":
        return reference(loaded, device, needle), None
    if case.kind == "ubatch":
        return _alone(loaded, replace(device, n_ubatch=case.n_ubatch), needle.tokens, needle), None
    if case.kind == "threads":
        own = _alone(loaded, device, needle.long_tokens, needle)
        return _alone(
            loaded, replace(device, threads=case.threads), needle.long_tokens, needle
        ), own
    if case.kind == "prefix":
        return _prefix(loaded, device, needle), None
    return _batched(loaded, device, case, needle), None


def _batched(loaded: LoadedModel, device: DeviceSettings, case: Case, needle: Needle) -> Decoded:
    """The needle as the last of 1 + k sequences: prefilled with the others in one batch,
    or (staggered) after them; then all decoded together."""
    others = needle.others[: case.others]
    n = len(others)
    with Slots(
        loaded, device, n + 1, needle.cells(needle.tokens, *others), case.kv_unified
    ) as slots:
        feeds = list(enumerate(others))
        if case.kind == "staggered":
            first = slots.decode(feeds) | slots.decode([(n, needle.tokens)])
        else:
            first = slots.decode([*feeds, (n, needle.tokens)])
        return decode_together(slots, n, first, needle.n_steps, loaded.is_eog)


def _prefix(loaded: LoadedModel, device: DeviceSettings, needle: Needle) -> Decoded:
    """The prompt's first half prefilled for sequence 1, shared with sequence 0 (the
    needle), then the rest of the prompt on sequence 0 alone."""
    half = len(needle.tokens) // 2
    if half == 0:
        raise ValueError("the prompt has one token: it has no prefix to share")
    with Slots(loaded, device, 2, needle.cells(needle.tokens), kv_unified=True) as slots:
        slots.decode([(1, needle.tokens[:half])])
        slots.share_prefix(1, 0, half)
        first = slots.decode([(0, needle.tokens[half:])])
        return decode_together(slots, 0, first, needle.n_steps, loaded.is_eog)


def compare_steps(reference: Decoded, served: Decoded) -> dict[str, Any]:
    """Step by step, the served decode against the reference, up to and including the
    first step whose tokens differ (the fork): bit-identity, max |Δ| and KL(ref‖served)
    of the logits. Steps after the fork decode other texts and are not compared."""
    n = min(len(reference.tokens), len(served.tokens))
    identical, max_abs, kl = [], [], []
    fork = None
    for i in range(n):
        a, b = reference.logits[i], served.logits[i]
        identical.append(a.tobytes() == b.tobytes())  # bits: -0.0 is not 0.0, NaN is NaN
        max_abs.append(0.0 if identical[-1] else float(np.abs(a - b).max()))
        kl.append(0.0 if identical[-1] else _kl(reference, served, i))
        if reference.tokens[i] != served.tokens[i]:
            fork = i
            break
    first_differing = next((i for i, same in enumerate(identical) if not same), None)
    return {
        "n_steps": len(identical),
        "identical_steps": sum(identical),
        "first_differing_step": first_differing,
        "fork_step": fork,
        "max_abs": max(max_abs, default=0.0),
        "max_abs_first_step": max_abs[0] if max_abs else None,
        # as the teacher-forced comparison summarises a pair: the median step's max |Δ|
        "max_abs_median_step": float(np.median(max_abs)) if max_abs else None,
        "kl_max": max(kl, default=0.0),
        "step_max_abs": max_abs,
        "step_kl": kl,
        "tokens": served.tokens,
    }


def _kl(reference: Decoded, served: Decoded, step: int) -> float:
    """KL(reference ‖ served) at one step, over the full vocabulary, in float64."""
    log_p, p = reference.log_probs(step)
    return float(max(np.dot(p, log_p - _log_softmax(served.logits[step])), 0.0))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64)
    shifted -= shifted.max()
    return shifted - np.log(np.exp(shifted).sum())


def serve_case(
    loaded: LoadedModel,
    device: DeviceSettings,
    case: Case,
    needle: Needle,
    alone: Decoded,
    own_run: dict[str, Any],
    pid: str,
) -> dict[str, Any]:
    """One case of one needle, compared with its reference, timed apart from the
    comparison; a failure is this case's."""
    row: dict[str, Any] = {"id": pid}
    if case.kind == "process":
        return row | against_own_run(alone, own_run, pid)
    if case.kind == "threads" and device.threads == case.threads:
        return row | {"status": "n/a", "reason": f"the device already runs {case.threads} thread"}
    start = time.perf_counter()
    try:
        served, own_reference = run_case(loaded, device, case, needle)
    except Exception as exc:  # this case's failure, recorded; the other cases run
        return row | {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    decoded = time.perf_counter()
    result = compare_steps(own_reference or alone, served)
    row |= {"status": "ok", **result, "text": loaded.detokenize(served.tokens)}
    if case.kind == "threads":
        row["prompt_tokens"] = len(needle.long_tokens)
        if result["n_steps"] < 2:  # the text ended at once: no decoded step to compare
            row |= {"status": "n/a", "reason": "the long prompt's answer ended at its first token"}
    compared = time.perf_counter()
    return row | {"decode_s": round(decoded - start, 4), "compare_s": round(compared - decoded, 4)}


def against_own_run(alone: Decoded, own_run: dict[str, Any], pid: str) -> dict[str, Any]:
    """The reference against the run stage's own process: its first step's logits (by
    digest: the run keeps no later step's) and its greedy tokens, as far as both go."""
    if own_run["status"] != "ok":
        return {"status": "n/a", "reason": f"the run is {own_run['status']}"}
    run = next((p for p in own_run["prompts"] if p["id"] == pid), None)
    if run is None:
        return {"status": "n/a", "reason": "the run left this prompt out"}
    if digest_algorithm(own_run) != DIGEST_ALGORITHM:
        return {"status": "n/a", "reason": f"the run's digests are {digest_algorithm(own_run)}"}
    n = min(len(run["tokens"]), len(alone.tokens))
    fork = next((i for i in range(n) if run["tokens"][i] != alone.tokens[i]), None)
    first_same = digest(alone.logits[0]) == run["first_logits_digest"]
    return {
        "status": "ok",
        "n_steps": 1,  # steps whose logits were compared
        "tokens_compared": n,
        "first_differing_step": None if first_same else 0,
        "fork_step": fork,
        "tokens": run["tokens"][:n],
    }


def step_arrays(
    cases: list[Case], rows: dict[str, list[dict[str, Any]]], n_prompts: int, n_steps: int
) -> dict[str, np.ndarray]:
    """Per case, needle and step: max |Δ| and KL against the reference (NaN where not
    compared: after a fork, after the text ended, in a case that did not run); the rows
    give up their step lists to these arrays."""
    shape = (len(cases), n_prompts, n_steps)
    arrays = {"max_abs": np.full(shape, np.nan), "kl": np.full(shape, np.nan)}
    for i, case in enumerate(cases):
        for j, row in enumerate(rows[case.id]):
            for name, key in (("max_abs", "step_max_abs"), ("kl", "step_kl")):
                values = row.pop(key, [])
                arrays[name][i, j, : len(values)] = values
    return arrays
