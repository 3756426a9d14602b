"""The per-job functions' signatures, given to Snakemake once (qdiff.workflow.signature_once),
still give each function exactly the arguments it takes."""

from __future__ import annotations

import inspect

import pytest
import snakemake.common
from snakemake.iocontainers import Wildcards

from qdiff.workflow import signature_once


def test_snakemake_takes_a_decorated_function_s_signature_without_asking_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @signature_once
    def mem_mb(wildcards: Wildcards, input: list[str]) -> int:
        return len(input)

    def no_signature(*args: object, **kwargs: object) -> None:
        raise AssertionError("inspect.signature was called again")

    wildcards = Wildcards()
    monkeypatch.setattr(inspect, "signature", no_signature)
    # Snakemake's own helpers, as its rules call them for every job
    assert list(snakemake.common.get_function_params(mem_mb)) == ["wildcards", "input"]
    offered = {"input": ["a", "b"], "threads": 2, "attempt": 1}
    aux = snakemake.common.get_input_function_aux_params(mem_mb, offered)
    assert aux == {"input": ["a", "b"]}  # only what the function takes
    assert mem_mb(wildcards, **aux) == 2
