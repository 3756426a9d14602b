"""The JSON files qdiff writes, written down once: their shapes (typed) and builders.

- a model file's sidecar (``resources/models/<file>.gguf.json``): ``ModelInfo``;
- a per-combination stage's ``record.json`` (qdiff.core.stages): ``Record``;
- a model's pair comparisons (``results/compare/<model>.json``, its ``pairs``): ``PairResult``.

Every one of them has a ``status``: ``ok``, or ``failed`` / ``unavailable`` / ``n/a`` with
an ``error`` (or ``reason``) that says what went wrong and what to do. A failure is always
written, never raised, so the report can name it.
"""

from __future__ import annotations

import uuid
from typing import Any, TypedDict

# what a job measures of itself (qdiff.engine.stage.job_usage), in an ok record's timings
JOB_USAGE = ("stage_wall_s", "children_cpu_s", "children_peak_rss_mib")


class ErrorInfo(TypedDict, total=False):
    kind: str  # crash | timeout | error | model | context | misplaced | unavailable | upstream
    stage: str  # the rule that failed
    message: str  # what went wrong, and what to do
    signal: str  # crash: the signal that killed llama.cpp
    exit_code: int
    error_lines: list[str]  # llama.cpp's own words (ERROR-level messages, abort lines)
    log_tail: list[str]
    model_buffers: dict[str, float]  # where the weights were when it failed
    log: str  # the job's log file
    progress: dict[str, Any]  # a crashed stage's work so far and where it was (serving)


class ModelInfo(TypedDict, total=False):
    status: str  # ok | failed
    file: str
    sha256: str | None
    bytes: int
    origin: str  # where it came from: a source, or "<type> of <parent> (sha256 ...)"
    licence: str  # as the file and its source declare it (qdiff.sources.declared_licence)
    tokenizer: dict[str, Any] | None  # qdiff.sources.tokenizer; None: unreadable
    run_token: str | None  # failed: fresh, so the next invocation retries; ok: the job's own
    error: ErrorInfo


class Record(TypedDict, total=False):
    status: str  # ok | failed | unavailable
    stage: str  # qdiff.core.stages name
    model: str
    device: str
    dequant: str
    settings: dict[str, Any]  # the device's settings; hidden env values stay placeholders
    generation: dict[str, Any]
    prompts: list[dict[str, Any]]
    timings: dict[str, Any]
    provenance: dict[str, Any]
    error: ErrorInfo
    run_token: str | None
    determinism: dict[str, Any]


class PairResult(TypedDict, total=False):
    model: str
    a: str  # combination labels; a is the reference side of every metric
    b: str
    differs: list[str]  # "key a→b" for every setting that differs
    relation: str  # qdiff.core.settings.relation of the two devices
    status: str  # ok | n/a | failed
    reason: str
    summary: dict[str, Any]  # qdiff.compare.metrics summaries over prompts
    # the tokens first steps compare over: None for the full vocabulary, else the teacher's
    # top-k (first_step_logits: top_k; qdiff.compare.forced.first_step_metrics)
    first_step_top_k: int | None
    prompts: list[dict[str, Any]]
    forced: dict[str, Any]  # qdiff.compare.forced.compare_forced, or why there is none


def fresh_token() -> str:
    return uuid.uuid4().hex


def model_info(
    file: str,
    sha256: str,
    size: int,
    origin: str,
    licence: str,
    tokenizer: dict[str, Any] | None,
    token: str | None,
) -> ModelInfo:
    """A made model file's sidecar; ``token`` is the job's retry_token param, kept so that
    the next invocation sees the param it compared (qdiff.engine.stage.retry_token)."""
    return {
        "status": "ok",
        "file": file,
        "sha256": sha256,
        "bytes": size,
        "origin": origin,
        "licence": licence,
        "tokenizer": tokenizer,
        "run_token": token,
    }


def failed_model_info(file: str, origin: str, error: ErrorInfo) -> ModelInfo:
    return {
        "status": "failed",
        "file": file,
        "sha256": None,
        "bytes": 0,
        "origin": origin,
        "error": error,
        "run_token": fresh_token(),
    }


def record_head(spec: dict[str, Any], status: str, stage: str) -> Record:
    """The fields every record of a combination starts with."""
    return {
        "status": status,
        "stage": stage,
        "model": spec["model"],
        "device": spec["device"],
        "dequant": spec["dequant"],
        "settings": spec["settings"],
        "generation": spec["generation"],
    }


def failure_record(
    spec: dict[str, Any],
    stage: str,
    status: str,
    error: ErrorInfo,
    provenance: dict[str, Any],
    token: str | None,
) -> Record:
    """A record of a combination that did not run: ``failed`` records get a fresh
    ``run_token`` (the next invocation retries them), ``unavailable`` ones keep ``token``."""
    return {
        **record_head(spec, status, stage),
        "prompts": [],
        "timings": {},
        "error": error,
        "provenance": provenance,
        "run_token": fresh_token() if status == "failed" else token,
    }


def failure_text(item: dict[str, Any]) -> str:
    """One line that says why a record, sidecar or pair is not ok."""
    error = item.get("error") or {}
    return str(error.get("message") or item.get("reason") or item.get("status", "?"))
