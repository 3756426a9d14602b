"""Metrics and pair comparison on constructed inputs (pure logic), one pair and in bulk."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from qdiff.compare.metrics import (
    BLOCK,
    PAIR_METRICS,
    fork_step,
    logit_metrics,
    median,
    percentile,
    summarise,
)
from qdiff.compare.pairs import PairCache, RunFiles, compare_model, compare_runs, what_differs
from qdiff.core.forced import ForcedRecorder
from qdiff.core.hashcache import HashCache
from qdiff.core.io import save_arrays
from qdiff.core.labels import Combination, Pair


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


def test_median_and_percentile_are_numpys_bit_for_bit() -> None:
    """qdiff's own median and percentile (numpy's first call imports numpy.ma) give numpy's
    values exactly, on odd and even counts, ties, one value, NaN and no value at all."""
    rng = np.random.default_rng(1)
    samples = [rng.lognormal(-12, 4, size=n) for n in (1, 2, 3, 4, 5, 12, 19, 20, 101)]
    samples += [np.array([0.5, 0.5, 0.25, 0.5]), np.array([3, 1, 2, 8]), np.array([1e-300, 0.0])]
    for values in samples:
        assert median(values) == float(np.median(values)), values
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(values, q) == float(np.percentile(values, q)), (values, q)
    with_nan = np.array([1.0, np.nan, 2.0])
    assert np.isnan(median(with_nan)) and np.isnan(percentile(with_nan, 90))
    assert np.isnan(median(np.array([]))) and np.isnan(percentile([], 99))


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


def test_the_metrics_match_their_float64_definitions_on_a_large_vocabulary() -> None:
    """``compare_rows`` reads only delta = b - a (and lse) for every metric; against the
    textbook float64 formulas it agrees to rounding, also for runs that barely differ."""
    rng = np.random.default_rng(1)
    a = rng.normal(scale=4.0, size=(3, 50_000)).astype(np.float32)
    b = np.stack(
        [
            a[0] + rng.normal(scale=0.3, size=a.shape[1]).astype(np.float32),
            np.nextafter(a[1], np.float32(np.inf)),  # one ulp apart everywhere
            a[2],
        ]
    )
    values = logit_metrics(a, b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    la = a64 - a64.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b64 - b64.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(-1)
    kl_ba = (np.exp(lb) * (lb - la)).sum(-1)
    d = b64 - a64
    np.testing.assert_array_equal(values["max_abs"], np.abs(d).max(-1))
    np.testing.assert_allclose(values["mean_abs"], np.abs(d).mean(-1), rtol=1e-12)
    np.testing.assert_allclose(values["rms"], np.sqrt((d**2).mean(-1)), rtol=1e-12)
    np.testing.assert_allclose(values["nmse"], (d**2).sum(-1) / (a64**2).sum(-1), rtol=1e-12)
    # KL as a difference of sums: within 1e-7 relative, or 1e-14 absolute near zero
    np.testing.assert_allclose(values["kl"], kl, rtol=1e-7, atol=1e-14)
    np.testing.assert_allclose(values["kl_ba"], kl_ba, rtol=1e-7, atol=1e-14)
    top = a.argmax(-1)
    rows = np.arange(3)
    np.testing.assert_allclose(
        values["dp_top"], np.exp(lb[rows, top]) - np.exp(la[rows, top]), atol=1e-15
    )
    assert values["kl"][2] == values["kl_ba"][2] == 0.0 and values["bit_identical"][2]
    assert not values["bit_identical"][1] and values["kl"][1] < 1e-12
    margin = np.sort(a64, -1)[:, -1] - np.sort(a64, -1)[:, -2]
    np.testing.assert_array_equal(values["top1_margin_a"], margin)


def write_run(tmp_path: Path, device: str, logits: np.ndarray, tokens: list[list[int]]) -> RunFiles:
    folder = tmp_path / device
    folder.mkdir(exist_ok=True)
    (folder / "record.json").write_text(json.dumps(record(device, "none", tokens)))
    np.save(folder / "logits.npy", logits)
    return RunFiles(folder / "record.json", folder / "logits.npy")


def test_comparing_a_model_in_bulk_equals_comparing_each_pair_alone(tmp_path: Path) -> None:
    """Bit for bit: one sweep over every run's rows gives each pair what a sweep over its two
    rows gives, across several blocks of the vocabulary."""
    rng = np.random.default_rng(2)
    base = rng.normal(size=(4, 2 * BLOCK + 300)).astype(np.float32)
    logits = {d: base + rng.normal(scale=0.05, size=base.shape).astype(np.float32) for d in "xyz"}
    tokens = {"x": [[1], [2], [3], [4]], "y": [[1], [2], [9], [4]], "z": [[1], [2], [3], [4]]}
    files = {
        Combination("m", d, "none"): write_run(tmp_path, d, logits[d], tokens[d]) for d in "xyz"
    }
    pairs = [Pair(a, b) for a, b in itertools.combinations(files, 2)]
    results = compare_model(pairs, files)
    for pair, result in zip(pairs, results, strict=True):
        alone = compare_runs(
            json.loads(files[pair.a].record.read_text()),
            logits[pair.a.device],
            json.loads(files[pair.b].record.read_text()),
            logits[pair.b.device],
        )
        assert result == alone


def test_a_run_of_another_vocabulary_fails_only_its_own_pairs(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    sizes = {"x": 50, "y": 50, "z": 60}
    files = {
        Combination("m", d, "none"): write_run(
            tmp_path, d, rng.normal(size=(2, n)).astype(np.float32), [[1], [2]]
        )
        for d, n in sizes.items()
    }
    pairs = [Pair(a, b) for a, b in itertools.combinations(files, 2)]
    results = compare_model(pairs, files)
    assert [r["status"] for r in results] == ["ok", "failed", "failed"]
    assert "logit shapes differ: (50,) vs (60,)" in results[1]["reason"]


def test_a_changed_run_recomputes_only_its_pairs_and_a_broken_one_fails_only_its_own(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(3)
    logits = {d: rng.normal(size=(2, 100)).astype(np.float32) for d in "xyz"}
    files = {
        Combination("m", d, "none"): write_run(tmp_path, d, logits[d], [[1], [2]]) for d in "xyz"
    }
    pairs = [Pair(a, b) for a, b in itertools.combinations(files, 2)]
    said: list[str] = []

    def compare() -> list[dict]:
        cache = PairCache(tmp_path / "cache.json", "code", HashCache(tmp_path / "hashes.json"))
        results = compare_model(pairs, files, cache, say=said.append)
        cache.save()
        return results

    first = compare()
    assert "compared 3 pairs (6 prompt-pairs" in said[-1] and "reused 0 pairs" in said[-1]
    os.utime(files[Combination("m", "x", "none")].logits)  # touched: same content
    assert compare() == first and "compared 0 pairs" in said[-1] and "reused 3" in said[-1]
    np.save(tmp_path / "z/logits.npy", logits["z"] + np.float32(1.0))  # z changed
    again = compare()
    assert "compared 2 pairs" in said[-1] and "reused 1 pairs" in said[-1]
    assert again[0] == first[0] and again[1] != first[1]
    (tmp_path / "y/logits.npy").write_bytes(b"\x93NUMPY truncated")  # y unreadable
    broken = compare()
    assert [r["status"] for r in broken] == ["failed", "ok", "failed"]
    assert "comparison failed" in broken[0]["reason"]
    assert "reused 1 pairs" in said[-1]  # x vs z: neither file changed
    compare()  # a failure is never cached: its pairs are computed again
    assert "compared 2 pairs" in said[-1]


def write_forced(folder: Path, logits: np.ndarray, ids: list | None, status: str = "ok") -> list:
    """A forced pass of one position per prompt (position 0: the run's first step), as the
    worker writes it; returns the slice ids it kept."""
    recorder = ForcedRecorder(len(logits), 1, 4)
    used = []
    for p, row in enumerate(logits):
        recorder.begin_prompt(p, 3, [int(row.argmax())])
        used.append(recorder.add(p, 0, row, None if ids is None else ids[p]))
    save_arrays(folder / "forced.npz", recorder.arrays)
    record = {
        "status": status,
        "teacher": "x.none",
        "top_k": 4,
        "prompt_ids": [f"p{p}" for p in range(len(logits))],
    }
    (folder / "forced.json").write_text(json.dumps(record))
    return used


def test_without_first_step_logits_pairs_compare_on_the_forced_slice_or_say_why_not(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(4)
    logits = {d: rng.normal(size=(2, 50)).astype(np.float32) for d in "xyz"}
    files, ids = {}, None
    for d in "xyz":
        full = write_run(tmp_path, d, logits[d], [[1], [2]])
        used = write_forced(tmp_path / d, logits[d], ids, "failed" if d == "z" else "ok")
        ids = ids or used
        files[Combination("m", d, "none")] = RunFiles(
            full.record, None, tmp_path / d / "forced.json", tmp_path / d / "forced.npz"
        )
    pairs = [Pair(a, b) for a, b in itertools.combinations(files, 2)]
    xy, xz, _ = compare_model(pairs, files)
    assert xy["status"] == "ok" and xy["first_step_top_k"] == 4, xy.get("reason")
    full = compare_runs(
        json.loads(files[pairs[0].a].record.read_text()),
        logits["x"],
        json.loads(files[pairs[0].b].record.read_text()),
        logits["y"],
    )
    assert full["first_step_top_k"] is None
    for mine, theirs in zip(xy["prompts"], full["prompts"], strict=True):
        assert mine["top1_agree"] == theirs["top1_agree"]
        assert mine["max_abs"] <= theirs["max_abs"]
    assert xz["status"] == "n/a" and "m.z.none failed" not in xz["reason"]
    assert "first_step_logits: top_k" in xz["reason"] and "z.none failed" in xz["reason"]
