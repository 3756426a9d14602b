"""The text stage's pure parts: windows cut as llama-perplexity cuts them, and its
statistics computed as it computes them (qdiff.core.text, qdiff.compare.text)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from qdiff.compare.forced import with_probabilities
from qdiff.compare.text import compare_text, mean_and_uncertainty, perplexity_stats
from qdiff.core import threads
from qdiff.core.forced import (
    ForcedRecorder,
    leading_ids,
    log_sum_exp,
    log_sum_exp_rows,
    slice_pass,
    top_ids,
)
from qdiff.core.text import as_run, split, windows


def test_windows_are_cut_as_llama_perplexity_cuts_them() -> None:
    tokens = list(range(100, 123))  # 23 tokens: two whole windows of 10, a remainder dropped
    cut = windows(tokens, 10, None, bos=1)
    assert cut == [[1, *range(101, 110)], [1, *range(111, 120)]]
    assert windows(tokens, 10, 1, bos=None) == [list(range(100, 110))]
    assert windows(tokens, 24, None, bos=1) == []
    # positions n_ctx/2 .. n_ctx-2 are scored, each against the next token
    head, forced = split(cut[1])
    assert head == [1, *range(111, 116)] and forced == list(range(116, 120))
    run = as_run(cut, 10)
    assert run["generation"]["n_ctx"] == 10
    assert [p["id"] for p in run["prompts"]] == ["window-1", "window-2"]
    assert run["prompts"][1]["prompt_tokens"] + run["prompts"][1]["tokens"] == cut[1]


def _pass(
    logits: np.ndarray, tokens: np.ndarray, top_k: int, ids: np.ndarray | None = None
) -> dict:
    """A text pass over windows × positions of full logits, as the stage records one."""
    n_windows, n_pos, _ = logits.shape
    recorder = ForcedRecorder(n_windows, n_pos, top_k, n_top=10)
    for w in range(n_windows):
        recorder.begin_prompt(w, 1, list(tokens[w]))
        recorder.add_rows(w, logits[w], None if ids is None else ids[w])
    return recorder.arrays


def _llama_perplexity(base: np.ndarray, other: np.ndarray, tokens: np.ndarray) -> dict:
    """tools/perplexity/perplexity.cpp's kl_divergence, position by position over the full
    vocabulary, without its uint16 storage and its -16 cut: what qdiff must equal when the
    kept slice holds every token."""
    sums = dict.fromkeys(
        ("nll", "nll2", "base", "base2", "cross", "kld", "kld2", "dp2", "dp4"), 0.0
    )
    same, n = 0, 0
    for lb, lq, tok in zip(
        base.reshape(-1, base.shape[-1]),
        other.reshape(-1, other.shape[-1]),
        tokens.ravel(),
        strict=True,
    ):
        log_pb = lb.astype(np.float64) - log_sum_exp(lb)
        log_pq = lq.astype(np.float64) - log_sum_exp(lq)
        nll, nll_base = -log_pq[tok], -log_pb[tok]
        kld = float(np.sum(np.exp(log_pb) * (log_pb - log_pq)))
        dp = np.exp(-nll) - np.exp(-nll_base)
        for key, value in (("nll", nll), ("base", nll_base), ("kld", kld), ("dp2", dp * dp)):
            sums[key] += value
        sums["nll2"] += nll * nll
        sums["base2"] += nll_base * nll_base
        sums["cross"] += nll * nll_base
        sums["kld2"] += kld * kld
        sums["dp4"] += dp**4
        same += int(np.argmax(lb) == np.argmax(lq))
        n += 1

    def mean_unc(s: float, s2: float) -> tuple[float, float]:
        f = s / n
        return f, np.sqrt((s2 / n - f * f) / (n - 1))

    log_ppl, log_ppl_base = (
        mean_unc(sums["nll"], sums["nll2"]),
        mean_unc(sums["base"], sums["base2"]),
    )
    cov = (sums["cross"] / n - log_ppl[0] * log_ppl_base[0]) / (n - 1)
    mse = mean_unc(sums["dp2"], sums["dp4"])
    return {
        "ppl": np.exp(log_ppl[0]),
        "ppl_base": np.exp(log_ppl_base[0]),
        "cor": cov / (log_ppl[1] * log_ppl_base[1]),
        "ln_ratio": (
            log_ppl[0] - log_ppl_base[0],
            np.sqrt(log_ppl[1] ** 2 + log_ppl_base[1] ** 2 - 2 * cov),
        ),
        "kld": mean_unc(sums["kld"], sums["kld2"]),
        "rms": np.sqrt(mse[0]),
        "same": same / n,
    }


@pytest.fixture
def two_passes() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    base = (rng.standard_normal((3, 20, 50)) * 3).astype(np.float32)
    other = (base + rng.standard_normal(base.shape) * 0.3).astype(np.float32)
    tokens = rng.integers(0, 50, (3, 20))
    return base, other, tokens


def test_the_statistics_equal_llama_perplexity_where_the_slice_holds_every_token(
    two_passes,
) -> None:
    base, other, tokens = two_passes
    a = _pass(base, tokens, 50)
    b = _pass(other, tokens, 50, a["slice_ids"])
    got = perplexity_stats(with_probabilities(a), with_probabilities(b))
    want = _llama_perplexity(base, other, tokens)
    assert got["n"] == 60
    assert got["ppl"][0] == pytest.approx(want["ppl"], rel=1e-9)
    assert got["ppl_base"][0] == pytest.approx(want["ppl_base"], rel=1e-9)
    assert got["cor_ln_ppl"] == pytest.approx(want["cor"], rel=1e-9)
    assert got["ln_ppl_ratio"] == pytest.approx(list(want["ln_ratio"]), rel=1e-9)
    assert got["kld"] == pytest.approx(list(want["kld"]), rel=1e-9)
    assert got["p_diff_rms"][0] == pytest.approx(want["rms"], rel=1e-9)
    assert got["same_top"][0] == pytest.approx(want["same"])
    assert got["identical_positions"] == 0
    assert len(got["kld_by_window"]) == 3 and len(got["kld_by_block"]) == 3  # 20 positions each
    assert np.mean(got["kld_by_window"]) == pytest.approx(got["kld"][0], rel=1e-9)
    ppl_diff = got["ppl"][0] - got["ppl_base"][0]
    assert got["ppl_diff"][0] == pytest.approx(ppl_diff) and got["ppl_diff"][1] > 0


def test_a_smaller_slice_gives_a_lower_bound_of_the_kl(two_passes) -> None:
    base, other, tokens = two_passes
    full = _llama_perplexity(base, other, tokens)["kld"][0]
    a = _pass(base, tokens, 8)
    b = _pass(other, tokens, 8, a["slice_ids"])
    bounded = perplexity_stats(with_probabilities(a), with_probabilities(b))["kld"][0]
    assert 0 < bounded < full


def test_a_pass_against_itself_is_bit_identical_and_has_no_divergence(two_passes) -> None:
    base, _, tokens = two_passes
    a = _pass(base, tokens, 50)
    s = perplexity_stats(with_probabilities(a), with_probabilities(a))
    assert s["identical_positions"] == s["n"] == 60
    assert s["kld"] == [0.0, 0.0] and s["same_top"][0] == 1.0 and s["top1_in_top5"] == 1.0


def test_nearest_and_farthest_are_decided_window_by_window(two_passes) -> None:
    base, other, tokens = two_passes
    rng = np.random.default_rng(4)
    exact = _pass(base, tokens, 50)
    near = _pass(
        (base + rng.standard_normal(base.shape) * 0.01).astype(np.float32),
        tokens,
        50,
        exact["slice_ids"],
    )
    far = _pass(other, tokens, 50, exact["slice_ids"])
    result = compare_text({"cpu.f32": near, "cpu.none": far}, exact)
    extremes = result["extremes"]
    assert (extremes["nearest"], extremes["runner_up"]) == ("cpu.f32", "cpu.none")
    assert extremes["farthest"] == "cpu.none"
    assert extremes["spread"]["verdict"] == "farther" and extremes["spread"]["n"] == 3  # blocks
    assert list(result["pairs"]) == ["cpu.f32 vs cpu.none"]
    # the teacher is the base of every pair it is in, as llama-perplexity's base is
    assert list(compare_text({"cpu.f32": near, "cpu.none": far}, None, "cpu.none")["pairs"]) == [
        "cpu.none vs cpu.f32"
    ]
    with pytest.raises(ValueError, match="different tokens"):
        compare_text({"a": near, "b": _pass(other, tokens[::-1], 50, exact["slice_ids"])}, None)


def test_mean_and_uncertainty_is_llama_perplexitys() -> None:
    x = np.arange(1.0, 13.0)
    mean, unc = mean_and_uncertainty(x)
    assert mean == 6.5 and unc == pytest.approx(np.sqrt((np.mean(x * x) - 6.5**2) / 11))
    assert mean_and_uncertainty(np.arange(10.0))[1] == 0.0  # 10 values or fewer: none


def test_rows_are_recorded_as_one_by_one() -> None:
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((20, 300)) * 4).astype(np.float32)
    assert np.array_equal(log_sum_exp_rows(rows, block=7), [log_sum_exp(r) for r in rows])
    one = ForcedRecorder(1, 20, 16, n_top=10)
    one.begin_prompt(0, 1, list(range(20)))
    for t in range(20):
        one.add(0, t, rows[t], None)
    for workers in (1, 3, 32):  # one, unequal shares of the 20 rows, more workers than rows
        many = ForcedRecorder(1, 20, 16, n_top=10, workers=workers)
        many.begin_prompt(0, 1, list(range(20)))
        many.add_rows(0, rows, None)
        for key, value in one.arrays.items():
            assert np.array_equal(value, many.arrays[key], equal_nan=value.dtype.kind == "f"), key


def test_a_slices_log_sum_exp_is_float64s_to_its_tails_own_precision() -> None:
    """Float32 rows: float32 exponentials outside the slice, so the log-sum-exp's error is
    a tiny share of the tail's own mass (within 1e-7 of it), not of the row's: where the
    tail is 1e-12 of the row or less it is float64's to its last digits (a float32 total
    less the slice would be about 1e-8 off there, which the KL's tail term multiplies);
    float64 rows in float64. The largest logit outside the slice is found on the way."""
    rng = np.random.default_rng(7)
    for width, k, scale in [(300, 16, 4.0), (49152, 1024, 3.0), (2000, 100, 10.0)]:
        rows = (rng.standard_normal((40, width)) * scale).astype(np.float32)
        rows[20:, :5] += 40  # tails of 1e-12 and less
        ids = np.stack([top_ids(r, k) for r in rows])
        ids[3, -2:] = -1  # a slice cut short
        exact = np.array([log_sum_exp(r) for r in rows])
        outside = rows.astype(np.float64)
        for row, kept in zip(outside, ids, strict=True):
            row[kept[kept >= 0]] = -np.inf
        tail = np.exp(outside - exact[:, None]).sum(axis=1)
        lse, kept, largest = slice_pass(rows, ids)
        assert (np.abs(lse - exact) <= 1e-7 * tail + 1e-13).all(), (width, k)
        assert np.array_equal(largest, outside.max(axis=1))
        assert np.array_equal(kept, np.take_along_axis(rows, ids, axis=1))  # -1: the last
        # each row alone: the rows after the short slice, in blocks that start elsewhere
        assert all(
            map(np.array_equal, slice_pass(rows[4:], ids[4:]), (lse[4:], kept[4:], largest[4:]))
        )
        # any block size, one row to all of them a block (add_rows sizes them by workers)
        for block_bytes in (1, 2**20, 8 * 2**20, rows.nbytes):
            again = slice_pass(rows, ids, block_bytes)
            assert all(map(np.array_equal, again, (lse, kept, largest))), block_bytes
        in_float64 = slice_pass(rows.astype(np.float64), ids).lse
        assert np.abs(in_float64 - exact).max() < 1e-13
    whole = np.stack([np.arange(300)] * 2)  # the slice holds the row: nothing outside
    assert (slice_pass(rows[:2, :300], whole).outside == -np.inf).all()


def test_rows_at_the_teachers_ids_are_recorded_as_one_by_one() -> None:
    """Each row's own leading ids read from the teacher's slice equal a whole-row ranking,
    also where a leading token lies outside the slice, ties straddle it, or a logit is NaN."""
    rng = np.random.default_rng(6)
    rows = (rng.standard_normal((24, 300)) * 4).astype(np.float32)
    near = rows + rng.standard_normal(rows.shape).astype(np.float32)  # a teacher, not the rows
    ids = np.stack([top_ids(r, 16) for r in near])
    outside = next(i for i in range(300) if i not in ids[3])
    rows[3, outside] = rows[3].max() + 1  # the top-1 outside the slice
    rows[5, ids[5, 4]] = rows[5, ids[5, 0]]  # a tie inside the slice
    tenth = np.sort(rows[7, ids[7]])[-10]
    rows[7, next(i for i in range(300) if i not in ids[7])] = tenth  # a tie across its edge
    rows[9, ids[9, 2]] = np.nan
    rows[11, ids[11, :14]] = rows[11].max() + 1  # 14 ids tied for the top 10, in the slice
    expected = np.stack([top_ids(r, 10) for r in rows])
    assert np.array_equal(expected[11], np.sort(ids[11, :14])[:10])  # lowest ids first
    assert np.array_equal(leading_ids(rows, ids, 10), expected)
    assert np.array_equal(leading_ids(rows, ids[:, :8], 10), expected)  # slice too small
    padded = np.concatenate([ids, np.full((3, 16), -1)])  # a teacher with longer prompts
    padded[2, 15] = -1  # and a row whose slice is cut short
    assert np.array_equal(leading_ids(rows, padded, 10), expected)
    one = ForcedRecorder(1, 24, 16, n_top=10)
    one.begin_prompt(0, 1, list(range(24)))
    for t in range(24):
        one.add(0, t, rows[t], ids[t])
    for workers in (1, 5):
        many = ForcedRecorder(1, 24, 16, n_top=10, workers=workers)
        many.begin_prompt(0, 1, list(range(24)))
        many.add_rows(0, rows, ids)
        for key, value in one.arrays.items():
            assert np.array_equal(value, many.arrays[key], equal_nan=value.dtype.kind == "f"), key


def test_the_report_names_no_nearest_when_the_windows_cannot_tell() -> None:
    from qdiff.report.sections.text import _extremes

    def ratio(verdict: str) -> dict:
        return {"ratio": 1.1, "low": 0.9, "high": 1.3, "n": 4, "farther_on": 3, "verdict": verdict}

    said = _extremes(
        {
            "nearest": "cpu.f32",
            "runner_up": "cpu-fa.f32",
            "farthest": "cpu.none",
            "lead": ratio("indistinguishable"),
            "spread": ratio("farther"),
        }
    )
    assert (
        "`cpu.f32` has the smallest KLD from exact and `cpu-fa.f32` the next, and the two cannot be told apart"
        in said
    )
    assert "The farthest, `cpu.none`" in said and "larger on 3 of 4 blocks" in said
    none = _extremes(
        {
            "nearest": "a",
            "runner_up": "b",
            "farthest": "c",
            "lead": ratio("indistinguishable"),
            "spread": ratio("indistinguishable"),
        }
    )
    assert none.startswith("The nearest and the farthest by KLD from exact, `a` and `c`, cannot")


def test_two_models_compare_over_the_ids_both_kept(two_passes) -> None:
    """A reference model's pass kept its own teacher's ids, this model's pass its own: the
    KL over the ids both kept and a bucket is that of the two full distributions coarsened
    to those ids (checked by hand), below the full KL; another tokenizer is not compared."""
    from qdiff.compare.text import against_reference_model, on_shared_ids

    base, other, tokens = two_passes
    reference = {**_pass(base, tokens, 16), "window_tokens": np.zeros((3, 8))}
    own = {**_pass(other, tokens, 16), "window_tokens": np.zeros((3, 8))}
    a, b = on_shared_ids(reference, own)
    w, t = 1, 7
    shared = a["slice_ids"][w, t][a["slice_ids"][w, t] >= 0]
    assert set(shared) == set(reference["slice_ids"][w, t]) & set(own["slice_ids"][w, t])
    log_p = base[w, t].astype(np.float64) - log_sum_exp(base[w, t])
    log_q = other[w, t].astype(np.float64) - log_sum_exp(other[w, t])
    rest_p, rest_q = 1 - np.exp(log_p[shared]).sum(), 1 - np.exp(log_q[shared]).sum()
    by_hand = np.sum(np.exp(log_p[shared]) * (log_p[shared] - log_q[shared]))
    by_hand += rest_p * np.log(rest_p / rest_q)
    rows = against_reference_model({"cpu.none": own}, reference)
    got = rows["cpu.none"]
    assert got["comparable"] and got["kld_by_window"][w] > 0
    from qdiff.compare.forced import kl_with_tail

    kl = kl_with_tail(with_probabilities(a), with_probabilities(b))
    # the recorded log-sum-exps take float32 exponentials outside the slice (within about
    # 1e-7 of the tail's mass: slice_pass), by hand float64 throughout
    assert kl[w, t] == pytest.approx(by_hand, rel=1e-7)
    assert got["kld"][0] < _llama_perplexity(base, other, tokens)["kld"][0]
    elsewhere = {**own, "window_tokens": np.ones((3, 8))}
    assert not against_reference_model({"x": elsewhere}, reference)["x"]["comparable"]


def test_the_nearest_is_ranked_by_the_statistic_its_interval_tests() -> None:
    """Ranked by the arithmetic mean, A (one bad block) would be the farthest while the
    paired test over blocks puts it nearest: the ranking and the verdict must agree."""
    from qdiff.compare.text import _block_means, _extremes

    rows = {
        "A": {"kld_by_block": [0.1] * 7 + [10.0]},
        "B": {"kld_by_block": [0.6] * 8},
        "C": {"kld_by_block": [0.7] * 8},
    }
    extremes = _extremes(rows)
    assert (extremes["nearest"], extremes["farthest"]) == ("A", "C")
    assert extremes["lead"]["ratio"] >= 1 and extremes["spread"]["ratio"] >= 1
    # a window's 255 scored positions in 8 blocks of 31-32; blocks never span windows
    values = np.arange(2 * 255, dtype=np.float64).reshape(2, 255)
    means = _block_means(values, np.ones((2, 255), bool))
    assert len(means) == 16 and means[7] < 255 <= means[8]


def test_the_section_draws_delta_p_percentiles_against_exact(two_passes, tmp_path) -> None:
    """Every combination's Δp percentiles against exact, 1 to 99, drawn in the section as a
    PNG (symmetric-log, or linear when every percentile is 0); none without exact."""
    from qdiff.report import figures
    from qdiff.report.sections.text import DELTA_P_LEVELS, section
    from qdiff.report.view import ModelView

    base, other, tokens = two_passes
    exact = _pass(base, tokens, 50)
    passes = {"cpu.f32": exact, "cpu.none": _pass(other, tokens, 50, exact["slice_ids"])}
    result = {
        **compare_text(passes, exact),
        "status": "ok",
        **{"n_text_tokens": 90, "n_windows": 3, "n_scored": 60, "n_ctx": 40, "top_k": 50},
        **{"teacher": "cpu.f32", "not_run": {}},
    }
    view = ModelView("m", {"text": [{"status": "ok"}]}, [], text=result, plot_dir=tmp_path)
    said = section(view)
    assert "![Δp percentiles against exact](plots/m.delta-p.png)" in said
    assert (tmp_path / "m.delta-p.png").stat().st_size > 5000
    assert DELTA_P_LEVELS == [1, 5, 10, 25, 50, 75, 90, 95, 99]
    assert "m.delta-p.png" not in section(ModelView("m", view.stages, [], text=result))  # no plots
    without_exact = {**result, "vs_exact": {}, "extremes": None, "exact_status": "off"}
    assert "delta-p" not in section(
        ModelView("m", view.stages, [], text=without_exact, plot_dir=tmp_path / "x")
    )
    zero = tmp_path / "zero.png"
    figures.delta_p_percentiles({"cpu.f32": [0.0] * 9}, DELTA_P_LEVELS, zero, "bit-identical")
    assert zero.stat().st_size > 5000


def test_the_recording_takes_the_cpus_the_process_may_run_on() -> None:
    """A job pinned to one CPU (as a cluster's share pins it) records with one worker."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from qdiff.core.forced import ForcedRecorder; from qdiff.core.threads import workers; "
        "print(workers(), ForcedRecorder(1, 1, 1).workers)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]
    assert 1 <= threads.workers() <= min(threads.MAX_WORKERS, len(os.sched_getaffinity(0)))


def test_windows_recorded_beside_the_next_ones_scoring_are_recorded_alike(tiny_gguf) -> None:
    """On a GPU the stage records a window while the next is scored: real llama.cpp scoring
    of a tiny model, recorded so and one window after another, gives the same arrays, on the
    teacher and at its ids."""
    from qdiff.core.forced import ARRAY_NAMES
    from qdiff.core.settings import DeviceSettings
    from qdiff.core.text import LEADING_KEPT
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel
    from qdiff.engine.worker import score_windows

    log = init_backend()  # kept while llama.cpp runs
    with LoadedModel(tiny_gguf, DeviceSettings(backend="cpu", threads=1), 32) as model:
        text = " ".join(f"word{i} and more {i * 7}" for i in range(80))
        cut = windows(model.tokenize(text, parse_special=False), 32, 5, model.bos_added())
        assert len(cut) == 5
        passes = {}
        for teacher in (True, False):
            ids = None if teacher else passes[True, False]["slice_ids"]
            for overlap in (False, True):
                recorder = ForcedRecorder(len(cut), len(split(cut[0])[1]), 6, n_top=LEADING_KEPT)
                score_windows(model, recorder, cut, ids, overlap=overlap)
                passes[teacher, overlap] = recorder.arrays
    del log
    for teacher in (True, False):
        for name in ARRAY_NAMES:
            np.testing.assert_array_equal(
                passes[teacher, True][name], passes[teacher, False][name], err_msg=name
            )
    assert np.isfinite(passes[False, True]["lse"]).all()


def test_a_window_of_one_batch_is_read_in_place_and_holds_what_a_copy_holds(tiny_gguf) -> None:
    """llama.cpp's output buffer, read in place where a window is one batch (as
    llama-perplexity reads it), holds what a copy of it holds, in the model's own context and
    in a spare one; a window of several batches is copied batch by batch, every row of it."""
    from qdiff.core.settings import DeviceSettings
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel

    log = init_backend()  # kept while llama.cpp runs
    window = list(range(3, 35))
    with LoadedModel(tiny_gguf, DeviceSettings(backend="cpu", threads=1), 32) as model:
        copied = model.score(window, 16, np.empty((16, model.n_vocab), np.float32))
        seen = model.score(window, 16)
        assert not seen.flags.owndata and not seen.flags.writeable
        np.testing.assert_array_equal(seen, copied)
        with model.spare_context() as spare:
            np.testing.assert_array_equal(model.score(window, 16, context=spare), copied)
    settings = DeviceSettings(backend="cpu", threads=1, n_batch=8, n_ubatch=8)
    with LoadedModel(tiny_gguf, settings, 32) as model:
        batched = model.score(window, 16)
    del log
    assert batched.flags.owndata and batched.shape == copied.shape
    assert np.isfinite(batched).all()


def test_leading_ids_rank_as_whole_rows_do_among_many_ties() -> None:
    """Rows of few distinct logits (ties at every rank, at the n-th place too), some NaN, some
    slices cut short: the slice's ranking, row by row, is the whole row's."""
    rng = np.random.default_rng(1)
    for trial in range(100):
        n, k = int(rng.integers(1, 12)), int(rng.integers(12, 40))
        rows = rng.integers(0, int(rng.integers(3, 60)), (30, 200)).astype(np.float32)
        if trial % 3 == 0:
            rows[rng.random(rows.shape) < 0.01] = np.nan
        near = rows + rng.standard_normal(rows.shape).astype(np.float32) * rng.random()
        ids = np.stack([top_ids(np.nan_to_num(r, nan=-1e9), k) for r in near])
        ids[rng.integers(0, 30), -1] = -1
        expected = np.stack([top_ids(r, n) for r in rows])
        assert np.array_equal(leading_ids(rows, ids, n), expected), trial
