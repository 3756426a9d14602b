"""Metrics and pair comparison on constructed inputs (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest

from qdiff.compare import compare_runs, what_differs
from qdiff.metrics import PAIR_METRICS, fork_step, logit_metrics, summarise


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
    assert m["top1_agree"].tolist() == [False, True]  # a: token 3; b: a tie, lowest id (2)
    assert m["top1_margin_a"][0] == pytest.approx(1.0)
    assert m["bit_identical"].tolist() == [False, True]


def test_kl_is_stable_for_large_logits() -> None:
    a = np.array([[1000.0, 0.0, -1000.0]])
    m = logit_metrics(a, a + np.array([[0.0, 1.0, 0.0]]))
    assert np.isfinite(m["kl"]).all() and m["kl"][0] >= 0


def test_shapes_must_match_and_empty_logits_are_not_compared() -> None:
    with pytest.raises(ValueError, match="logit shapes differ"):
        logit_metrics(np.zeros((1, 3)), np.zeros((1, 4)))
    # nothing to compare is never "bit-identical"
    with pytest.raises(ValueError, match="no logits to compare"):
        logit_metrics(np.zeros((1, 0)), np.zeros((1, 0)))


def test_every_declared_metric_is_computed_summarised_and_kept_per_prompt() -> None:
    """A metric is one entry in PAIR_METRICS: computed, summarised and stored with no
    other file to edit (this test iterates the table, so a new entry is tested too)."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 16)).astype(np.float32)
    b = (a + rng.normal(scale=0.1, size=a.shape)).astype(np.float32)
    values = logit_metrics(a, b)
    summary = summarise(values)
    recs = [record(d, "none", [[1], [2], [3]]) for d in ("cpu", "cpu2")]
    result = compare_runs(recs[0], a, recs[1], b)
    for m in PAIR_METRICS:
        assert values[m.key].shape == (3,)
        assert all(m.key in p for p in result["prompts"])
        for stat in m.summaries:
            assert m.summary_key(stat) in summary and m.summary_key(stat) in result["summary"]
        for stat in m.shown:
            assert stat in m.summaries


@pytest.mark.parametrize(
    ("a", "b", "step"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 5, 3], 1),
        ([7], [8], 0),
        ([1, 2], [1, 2, 3], 2),
    ],
)
def test_fork_step(a, b, step) -> None:
    assert fork_step(a, b) == step


def record(
    device: str, dequant: str, tokens: list[list[int]], status: str = "ok", **settings
) -> dict:
    return {
        "model": "m",
        "device": device,
        "dequant": dequant,
        "status": status,
        "settings": {"backend": "cpu", "flash_attn": False, **settings},
        "prompts": [
            {"id": f"p{i}", "tokens": t, "text": str(t), "n_prompt_tokens": 3}
            for i, t in enumerate(tokens)
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
    assert result["relation"] == "settings"
    s = result["summary"]
    assert s["max_abs_max"] == 0.5 and s["forked"] == 1 and s["first_fork_step"] == 1
    assert s["top1_agree_count"] == 2 and s["bit_identical_count"] == 1
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
