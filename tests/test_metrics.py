"""Metrics and pair comparison on constructed inputs (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest

from qdiff.compare import compare_runs, what_differs
from qdiff.metrics import fork_step, logit_metrics


def test_logit_metrics_match_their_definitions() -> None:
    a = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 1.0]], dtype=np.float32)
    b = np.array([[1.0, 2.5, 3.0, 3.0], [0.0, 0.0, 0.0, 1.0]], dtype=np.float32)
    m = logit_metrics(a, b)
    assert m["max_abs"].tolist() == [1.0, 0.0]
    assert m["mean_abs"][0] == pytest.approx(1.5 / 4)
    assert m["rms"][0] == pytest.approx(np.sqrt((0.25 + 1.0) / 4))
    assert m["nmse"][0] == pytest.approx(1.25 / 30)  # test-backend-ops: sum d^2 / sum a^2
    pa = np.exp(a[0]) / np.exp(a[0]).sum()
    pb = np.exp(b[0]) / np.exp(b[0]).sum()
    assert m["kl"][0] == pytest.approx(float((pa * np.log(pa / pb)).sum()))
    assert m["kl"][1] == 0.0
    assert m["top1_a"].tolist() == [3, 3] and m["top1_b"].tolist() == [2, 3]  # ties: lowest id
    assert m["margin_a"][0] == pytest.approx(1.0)
    assert m["bit_identical"].tolist() == [False, True]


def test_kl_is_stable_for_large_logits() -> None:
    a = np.array([[1000.0, 0.0, -1000.0]])
    m = logit_metrics(a, a + np.array([[0.0, 1.0, 0.0]]))
    assert np.isfinite(m["kl"]).all() and m["kl"][0] >= 0


def test_shapes_must_match() -> None:
    with pytest.raises(ValueError, match="logit shapes differ"):
        logit_metrics(np.zeros((1, 3)), np.zeros((1, 4)))


@pytest.mark.parametrize(
    ("a", "b", "step"),
    [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1), ([7], [8], 0), ([1, 2], [1, 2, 3], 2)],
)
def test_fork_step(a, b, step) -> None:
    assert fork_step(a, b) == step


def record(device: str, dequant: str, tokens: list[list[int]], status: str = "ok", **settings) -> dict:
    return {
        "model": "m",
        "device": device,
        "dequant": dequant,
        "status": status,
        "settings": {"backend": "cpu", "flash_attn": False, **settings},
        "prompts": [
            {"id": f"p{i}", "tokens": t, "text": str(t), "n_prompt_tokens": 3} for i, t in enumerate(tokens)
        ],
    }


def test_compare_runs_summarises_prompts() -> None:
    a = record("cpu", "none", [[1, 2, 3], [4, 5, 6]])
    b = record("cpu-fa", "none", [[1, 2, 3], [4, 9, 6]], flash_attn=True)
    la = np.array([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]], dtype=np.float32)
    lb = la + np.array([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]], dtype=np.float32)
    result = compare_runs(a, la, b, lb)
    assert result["status"] == "ok"
    assert result["differs"] == ["flash_attn off→on"]
    s = result["summary"]
    assert s["max_abs"] == 0.5 and s["forked"] == 1 and s["first_fork_step"] == 1
    assert s["top1_agree"] == 2 and s["bit_identical"] == 1
    assert [p["fork_step"] for p in result["prompts"]] == [None, 1]


def test_a_failed_run_makes_the_pair_not_applicable_never_equal() -> None:
    a = record("cpu", "none", [[1]])
    b = record("gpu", "none", [], status="failed")
    result = compare_runs(a, np.zeros((1, 3), np.float32), b, np.zeros((0, 0), np.float32))
    assert result["status"] == "n/a" and "gpu.none failed" in result["reason"]
    assert "summary" not in result


def test_what_differs_lists_backend_first() -> None:
    a = record("cpu", "none", [], n_batch=512)
    b = record("cuda", "f32", [], n_batch=8, backend="cuda")
    assert what_differs(a, b) == ["dequant none→f32", "backend cpu→cuda", "n_batch 512→8"]
