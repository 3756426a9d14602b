"""Localisation logic on constructed captures (the workflow tests capture real models)."""

from __future__ import annotations

import numpy as np

from qdiff.compare.localise import (
    FLOOR_FACTOR,
    choose_pairs,
    floor_pair,
    localise,
    op_family,
    tensor_rows,
)
from qdiff.core.labels import Pair
from qdiff.report.sections.localised import section as localised
from qdiff.report.view import ModelView


def capture(names_ops: list[tuple[str, str]], values: list[np.ndarray]) -> tuple[list, dict]:
    meta = [
        {
            "key": f"p0.t{i}",
            "name": n,
            "op": op,
            "type": "f32",
            "ne": [len(v), 1, 1, 1],
            "weight": "blk.0.ffn_up.weight q4_K" if op == "MUL_MAT" else None,
            "kept": "last position",
        }
        for i, ((n, op), v) in enumerate(zip(names_ops, values, strict=True))
    ]
    return meta, {m["key"]: v.astype(np.float32) for m, v in zip(meta, values, strict=True)}


GRAPH = [
    ("embd", "GET_ROWS"),
    ("norm-0", "RMS_NORM"),
    ("ffn_up-0", "MUL_MAT"),
    ("l_out-0", "ADD"),
    ("norm-0", "RMS_NORM"),
    ("result_output", "MUL_MAT"),
]


def perturbed(base: list[np.ndarray], scales: list[float], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [v + s * rng.normal(size=v.shape) for v, s in zip(base, scales, strict=True)]


def test_op_families_name_the_kernel() -> None:
    assert (
        op_family("ffn_up-3", "MUL_MAT", "blk.3.ffn_up.weight q4_K") == "matmul with q4_K weights"
    )
    assert (
        op_family("FLASH_ATTN_EXT (unnamed)", "FLASH_ATTN_EXT", None)
        == "attention (flash-attention kernel)"
    )
    assert op_family("kq_soft_max-0", "SOFT_MAX", None) == "attention (soft_max)"
    assert (
        op_family("kq-0", "MUL_MAT", "cache_k_l0 (view) (permuted) f16")
        == "attention (mul_mat, with f16 KV cache)"
    )
    assert op_family("attn_norm-0", "MUL", None) == "normalisation (scale by weight)"
    assert op_family("l_out-2", "ADD", None) == "residual add"
    # Gemma's attention output projection has no name of its own: the weight says what it is
    unnamed = op_family("MUL_MAT (unnamed)", "MUL_MAT", "blk.0.attn_output.weight q4_K")
    assert unnamed == "matmul with q4_K weights (blk.0.attn_output.weight)"


def test_floor_pair_is_the_same_devices_on_the_f32_copy() -> None:
    def floor(a: str, b: str) -> tuple[str, str] | None:
        found = floor_pair(Pair.parse("m", a, b))
        return None if found is None else found.labels

    assert floor("cpu.none", "cuda.none") == ("cpu.f32", "cuda.f32")
    assert floor("cpu.f16", "cuda.none") == ("cpu.f32", "cuda.f32")
    assert floor("cpu.f32", "cuda.f32") is None  # it is the floor already
    assert floor("cpu.none", "cpu.f32") is None  # one device: no cross-device floor


def test_the_chosen_pair_runs_one_file_on_two_devices() -> None:
    """The largest pair overall is often none vs f16 on one device: its weights differ, so
    it parts at the embedding table and says nothing about devices. Localise the largest
    pair that ran the same file on two devices instead."""

    def result(a: str, b: str, max_abs: float) -> dict:
        return {"model": "m", "a": a, "b": b, "status": "ok", "summary": {"max_abs_max": max_abs}}

    results = [
        result("cpu.none", "cpu.f16", 5.0),
        result("cpu.none", "cpu-fa.none", 1.8),
        result("cpu.f16", "cpu-fa.f16", 0.03),
        result("cpu.none", "cpu-fa.f16", 4.9),
    ]
    ((chosen, why),) = choose_pairs(results, [])
    assert chosen.labels == ("cpu.none", "cpu-fa.none") and "one file" in why


def test_repeated_names_match_by_occurrence_and_identical_captures_do_not_part() -> None:
    base = [np.arange(1, 9, dtype=np.float64) * (i + 1) for i in range(len(GRAPH))]
    meta, data = capture(GRAPH, base)
    rows = tensor_rows(meta, data, meta, data)
    assert [(r["name"], r["occurrence"]) for r in rows][1::3] == [("norm-0", 0), ("norm-0", 1)]
    result = localise(rows, None)
    assert result["first_difference"] is None and result["first_divergence"] is None


def test_divergence_is_where_the_pair_leaves_its_float_rounding_floor() -> None:
    base = [np.linspace(1, 2, 16) for _ in GRAPH]
    meta, data = capture(GRAPH, base)
    # the floor pair differs by 1e-6 from norm-0 on; the pair as well, until ffn_up-0 (a
    # quantized matmul) jumps to 1e-3
    floor_meta, floor_data = capture(GRAPH, perturbed(base, [0, 1e-6, 1e-6, 1e-6, 1e-6, 1e-6], 1))
    pair_meta, pair_data = capture(GRAPH, perturbed(base, [0, 1e-6, 1e-3, 1e-3, 1e-3, 1e-3], 2))
    rows = tensor_rows(meta, data, pair_meta, pair_data)
    floor_rows = tensor_rows(meta, data, floor_meta, floor_data)
    result = localise(rows, floor_rows)
    assert result["first_difference"]["name"] == "norm-0"
    d = result["first_divergence"]
    assert d["name"] == "ffn_up-0" and d["family"] == "matmul with q4_K weights"
    assert d["nmse"] > FLOOR_FACTOR * d["floor_nmse"]
    firm = result["robustness"]
    assert firm["ratio"] > 100 and not firm["marginal"]
    assert firm["later_above"] == firm["later_compared"] == 3  # it stays above the floor
    # without a floor no divergence is named: only the first difference
    plain = localise(rows, None)
    assert plain["first_divergence"] is None and plain["first_difference"]["name"] == "norm-0"


def test_a_divergence_that_barely_crosses_the_threshold_says_so() -> None:
    base = [np.linspace(1, 2, 16) for _ in GRAPH]
    meta, data = capture(GRAPH, base)
    floor_meta, floor_data = capture(GRAPH, perturbed(base, [0, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4], 1))
    # ffn_up-0 crosses the 10x threshold at 12x; result_output jumps to 10^4x
    pair_meta, pair_data = capture(GRAPH, perturbed(base, [0, 1e-4, 3.5e-4, 1e-4, 1e-4, 1e-2], 2))
    result = localise(
        tensor_rows(meta, data, pair_meta, pair_data),
        tensor_rows(meta, data, floor_meta, floor_data),
    )
    firm = result["robustness"]
    assert result["first_divergence"]["name"] == "ffn_up-0" and firm["marginal"]
    assert FLOOR_FACTOR < firm["ratio"] < 3 * FLOOR_FACTOR
    assert (
        firm["next_above"]["name"] == "result_output" and firm["largest"]["name"] == "result_output"
    )
    view = ModelView(
        "m",
        {"run": []},
        [],
        localised={
            "floor_factor": FLOOR_FACTOR,
            "pairs": [
                {
                    "a": "cpu.none",
                    "b": "cuda.none",
                    "why": "test",
                    "status": "ok",
                    "floor": ["cpu.f32", "cuda.f32"],
                    "prompts": [{"prompt": "p", "capture_changed_logits": [], **result}],
                }
            ],
        },
    )
    text = localised(view)
    assert (
        "only just crosses the 10× threshold" in text
        and "Next above the threshold: `result_output`" in text
    )


def test_ops_only_one_graph_computes_are_named_before_the_next_shared_tensor() -> None:
    plain = [
        ("attn_norm-0", "MUL"),
        ("kq-0", "MUL_MAT"),
        ("kq_soft_max-0", "SOFT_MAX"),
        ("kqv_out-0", "CONT"),
        ("attn_out-0", "MUL_MAT"),
    ]
    flash = [
        ("attn_norm-0", "MUL"),
        ("FLASH_ATTN_EXT (unnamed)", "FLASH_ATTN_EXT"),
        ("attn_out-0", "MUL_MAT"),
    ]
    values = [np.ones(4) for _ in plain]
    meta_a, data_a = capture(plain, values)
    meta_b, data_b = capture(flash, [np.ones(4), np.ones(4), np.ones(4) + 1e-3])
    rows = tensor_rows(meta_a, data_a, meta_b, data_b)
    assert [r["name"] for r in rows] == ["attn_norm-0", "attn_out-0"]
    first = localise(rows, None)["first_difference"]
    assert first["name"] == "attn_out-0"
    assert first["only_a_before"] == [
        "kq-0 (attention (mul_mat))",
        "kq_soft_max-0 (attention (soft_max))",
        "kqv_out-0 (attention (cont))",
    ]
    assert first["only_b_before"] == [
        "FLASH_ATTN_EXT (unnamed) (attention (flash-attention kernel))"
    ]


def _view(entry: dict) -> ModelView:
    return ModelView(
        "m", {"run": []}, [], localised={"floor_factor": FLOOR_FACTOR, "pairs": [entry]}
    )


def test_report_says_when_capturing_changed_the_logits() -> None:
    meta, data = capture(GRAPH, [np.ones(4) for _ in GRAPH])
    rows = tensor_rows(meta, data, meta, data)
    entry = {
        "a": "cpu.none",
        "b": "cuda.none",
        "why": "largest first-step max |Δ|",
        "status": "ok",
        "floor": None,
        "prompts": [
            {"prompt": "p", "capture_changed_logits": ["cuda.none"], **localise(rows, None)}
        ],
    }
    text = localised(_view(entry))
    assert "**Capturing changed the logits of `cuda.none`**" in text
    entry["prompts"][0]["capture_changed_logits"] = []
    text = localised(_view(entry))
    assert "Capturing left both combinations' logits bit-identical." in text
    assert "All 6 compared tensors are bit-identical" in text


def test_nothing_compared_is_never_read_as_identical() -> None:
    """Captures that share no tensor (a capture.tensors pattern that matches nothing) say
    that nothing was compared, not that the pair does not part."""
    result = localise([], None)
    assert result["n_tensors"] == 0 and result["first_difference"] is None
    entry = {
        "a": "cpu.none",
        "b": "cuda.none",
        "why": "w",
        "status": "ok",
        "floor": ["cpu.f32", "cuda.f32"],
        "prompts": [{"prompt": "p", "capture_changed_logits": [], **localise([], [])}],
    }
    text = localised(_view(entry))
    assert "**Nothing was compared**" in text and "bit-identical:" not in text
    # a floor that shares no tensor with the pair: no divergence is named
    meta, data = capture(GRAPH, [np.linspace(1, 2, 4) for _ in GRAPH])
    other_meta, other_data = capture(
        GRAPH, perturbed([np.linspace(1, 2, 4) for _ in GRAPH], [0, 1e-3] * 3, 3)
    )
    rows = tensor_rows(meta, data, other_meta, other_data)
    lonely = localise(rows, [])
    assert lonely["n_with_floor"] == 0 and lonely["first_divergence"] is None
    entry["prompts"] = [{"prompt": "p", "capture_changed_logits": [], **lonely}]
    assert "The floor pair shares none of these tensors" in localised(_view(entry))
