"""The text stage through the real workflow: a tiny real GGUF run by llama.cpp on a text,
scored in windows as llama-perplexity scores it, against the float64 engine along the same
windows, with the report's section; a text that is not the configured one fails its own
jobs and the report still renders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_TEXT, Workspace, in_child, tiny_config, tiny_text
from qdiff.core.io import load_arrays
from qdiff.core.text import split

N_CTX, WINDOWS = 32, 3  # tiny_text's windows


def _config(model: Path, root: Path) -> dict:
    return tiny_config(
        model,
        models={"tiny": {"path": str(model)}},
        devices={
            "cpu": {"backend": "cpu", "threads": 1},
            "cpu-fa": {"backend": "cpu", "threads": 1, "flash_attn": True},
        },
        dequant=["none"],
        capture={"enabled": False},
        text=tiny_text(root, about="a pangram, <b>six</b> times"),
    )


@pytest.fixture(scope="module")
def scored(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    ws = Workspace(tmp_path_factory.mktemp("text") / "ws")
    ws.write_config(_config(tiny_gguf, ws.root))
    ws.snakemake()
    return ws


def _llama_logprobs(model: str, window: list[int], first: int) -> list[float]:
    """llama-cpp-python's own high-level Llama, every position's logits kept: the
    log-probability of the text's next token at each scored position."""
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=N_CTX, logits_all=True, verbose=False, n_threads=1)
    llm.eval(window)
    logits = np.array(llm.scores[: len(window)], dtype=np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    return [float(logp[i, window[i + 1]]) for i in range(first, len(window) - 1)]


def test_the_text_is_scored_at_llama_perplexitys_positions(
    scored: Workspace, tiny_gguf: Path
) -> None:
    """Each scored position is the log-probability of the text's next token at that very
    position (a high-level Llama keeping every position's logits agrees), and the float64
    engine along the same windows is close to llama.cpp's f32 run."""
    record = json.loads((scored.root / "results/text/tiny/cpu/none/record.json").read_text())
    assert record["status"] == "ok", record.get("error")
    assert record["n_windows"] == WINDOWS and record["n_scored"] == WINDOWS * (
        N_CTX - N_CTX // 2 - 1
    )
    arrays = load_arrays(scored.root / "results/text/tiny/cpu/none/text.npz")
    window = arrays["window_tokens"][1].tolist()
    head, forced = split(window)
    assert arrays["tokens"][1].tolist() == forced
    theirs = in_child(_llama_logprobs, str(tiny_gguf), window, len(head) - 1)
    np.testing.assert_allclose(arrays["forced_logprob"][1], theirs, atol=1e-4)
    exact = load_arrays(scored.root / "results/exact/tiny/text.npz")
    # close, as an f16 KV cache leaves them (a window or a position off would be nats off)
    np.testing.assert_allclose(exact["forced_logprob"], arrays["forced_logprob"], atol=0.05)
    assert not np.array_equal(exact["forced_logprob"], arrays["forced_logprob"])


def test_the_text_statistics_and_their_section(scored: Workspace) -> None:
    result = json.loads((scored.root / "results/compare/tiny.text.json").read_text())
    assert result["status"] == "ok" and result["exact_status"] == "ok"
    assert set(result["vs_exact"]) == {"cpu.none", "cpu-fa.none"}
    for stats in result["vs_exact"].values():
        assert stats["n"] == WINDOWS * (N_CTX - N_CTX // 2 - 1)
        assert 0 < stats["kld"][0] < 1e-3 and stats["same_top"][0] > 0.9
        assert stats["ppl"][0] == pytest.approx(stats["ppl_base"][0], rel=1e-3)
        assert stats["identical_positions"] == 0  # float32 is never the float64 answer
    (pair,) = result["pairs"].values()
    assert (pair["a"], pair["b"]) == ("cpu.none", "cpu-fa.none")
    summary = (scored.root / "results/summary.md").read_text()
    section = summary.split("### A real text, scored as llama-perplexity scores it")[1].split(
        "\n### "
    )[0]
    assert "**Against the exact answer**" in section and "| `cpu-fa.none`" in section
    assert f"{WINDOWS} windows" in section and "<b>" not in section  # the config's text, escaped
    assert "**Pairs of combinations**" in section


def test_a_text_that_is_not_the_configured_one_fails_its_jobs(
    scored: Workspace, tmp_path: Path
) -> None:
    ws = scored.copy_to(tmp_path / "ws")
    (ws.root / "text.txt").write_text(TINY_TEXT + " and one more line")
    ws.snakemake()  # the jobs fail; the workflow and its report do not
    record = json.loads((ws.root / "results/text/tiny/cpu/none/record.json").read_text())
    assert record["status"] == "failed"
    assert "not the configured text.sha256" in record["error"]["message"]
    summary = (ws.root / "results/summary.md").read_text()
    section = summary.split("### A real text, scored as llama-perplexity scores it")[1].split(
        "\n### "
    )[0]
    assert "The text was not scored" in section and "text.sha256" in section


def test_a_model_along_the_text_against_the_reference_model(
    tiny_gguf: Path, tiny_gguf_b: Path, tmp_path: Path
) -> None:
    """With a reference_model, each other model's combinations are also scored against its
    reference pass (two tiny models, one tokenizer), and the report has their table."""
    ws = Workspace(tmp_path / "ws")
    config = _config(tiny_gguf, ws.root)
    config["models"] = {"tiny": {"path": str(tiny_gguf)}, "tiny-b": {"path": str(tiny_gguf_b)}}
    config["devices"] = {"cpu": {"backend": "cpu", "threads": 1}}
    config.update(reference="cpu.none", reference_model="tiny", exact={"enabled": False})
    ws.write_config(config)
    ws.snakemake()
    result = json.loads((ws.root / "results/compare/tiny-b.text.json").read_text())
    reference = result["reference_model"]
    assert reference["model"] == "tiny" and reference["status"] == "ok"
    row = reference["rows"]["cpu.none"]
    # two random models: far apart, but over the same tokens
    assert row["comparable"] and row["kld"][0] > 0.01 and row["n"] == result["n_scored"]
    assert "reference_model" not in json.loads(
        (ws.root / "results/compare/tiny.text.json").read_text()
    )
    summary = (ws.root / "results/summary.md").read_text()
    assert "**Against the reference model** `tiny`" in summary
