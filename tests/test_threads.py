"""qdiff.core.threads: shares of rows on threads compute what the whole does, bit for bit,
and no thread outlives the block that shares (a process with idle threads may not fork)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from qdiff.core import threads
from qdiff.exact import ExactModel
from tinymodel import write_tiny_model


@pytest.fixture
def many_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four threads, and a share worth a thread from 64 values: tiny inputs are shared."""
    monkeypatch.setattr(threads, "workers", lambda: 4)
    monkeypatch.setattr(threads, "LEAST_VALUES", 64)


def test_shares_on_threads_equal_the_whole(many_shares: None) -> None:
    x = np.random.default_rng(0).standard_normal((37, 50))
    whole = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    shares: list[tuple[str, int]] = []

    def softmax(rows: np.ndarray) -> np.ndarray:
        shares.append((threading.current_thread().name, len(rows)))
        return np.exp(rows) / np.exp(rows).sum(axis=1, keepdims=True)

    with threads.sharing():
        shared = threads.shared_rows(softmax, x)
    assert np.array_equal(shared, whole)
    assert len(shares) == 4 and all(name.startswith("qdiff") for name, _ in shares)
    assert sum(n for _, n in shares) == len(x)


def test_outside_sharing_the_rows_stay_on_this_thread(many_shares: None) -> None:
    """Outside ``sharing()``, and in a task that shares again (which would otherwise wait
    for the busy threads it runs on)."""
    seen: list[tuple[str, slice]] = []
    threads.in_shares(lambda rows: seen.append((threading.current_thread().name, rows)), 100)
    assert seen == [(threading.current_thread().name, slice(0, 100))]
    inner: list[slice] = []

    def shares_again(rows: slice) -> None:
        threads.in_shares(inner.append, 1000)

    with threads.sharing():
        threads.in_shares(shares_again, 1000)
    assert inner == [slice(0, 1000)] * 4


def test_no_thread_outlives_sharing_and_a_tasks_error_reaches_the_caller(
    many_shares: None,
) -> None:
    before = threading.active_count()

    def fails(rows: slice) -> None:
        raise ValueError(f"rows {rows.start}")

    with pytest.raises(ValueError, match="rows"), threads.sharing():
        with threads.sharing():  # nested: the outer block's threads
            threads.in_shares(lambda rows: None, 1000)
        threads.in_shares(fails, 1000)
    assert threading.active_count() == before
    assert threads._open.get() is None


def test_the_exact_engine_answers_alike_on_any_number_of_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma's architecture takes every shared step (softmax by heads, RMSNorm, RoPE, GELU);
    one thread and four give the same logits bit for bit, and leave no thread behind."""
    path = write_tiny_model(tmp_path / "gemma3.gguf", "gemma3", n_layer=3)
    tokens = list(range(1, 40))

    def logits(n_workers: int) -> np.ndarray:
        monkeypatch.setattr(threads, "workers", lambda: n_workers)
        monkeypatch.setattr(threads, "LEAST_VALUES", 64)
        return ExactModel(path).forward(tokens, slice(0, None))

    before = threading.active_count()
    one, four = logits(1), logits(4)
    assert threading.active_count() == before
    assert one.shape[0] == len(tokens) and np.array_equal(one, four)
