"""When two models' runs index the same tokens (qdiff.compare.distance.tokenizer_problem):
the same token texts, and every prompt tokenized to the same ids."""

from __future__ import annotations

from typing import Any

from qdiff.compare.distance import tokenizer_problem


def run(sha: str | None, *prompt_tokens: list[int]) -> dict[str, Any]:
    tokenizer = None if sha is None else {"sha256": sha, "n_tokens": 100}
    return {
        "provenance": {"model_file": {"tokenizer": tokenizer}},
        "prompts": [{"id": f"p{i}", "prompt_tokens": t} for i, t in enumerate(prompt_tokens)],
    }


def test_the_same_tokens_and_ids_compare() -> None:
    assert tokenizer_problem(run("a", [1, 2], [3]), run("a", [1, 2], [3])) is None


def test_other_token_texts_do_not_compare() -> None:
    problem = tokenizer_problem(run("a", [1, 2]), run("b", [1, 2]))
    assert problem is not None and "another tokenizer" in problem


def test_prompts_tokenized_to_other_ids_are_named() -> None:
    problem = tokenizer_problem(run("a", [1, 2], [3], [4]), run("a", [1, 2], [5], [6]))
    assert problem is not None and problem.startswith("prompts p1, p2 tokenize to other ids")


def test_a_tokenizer_not_recorded_says_how_to_record_it() -> None:
    problem = tokenizer_problem(run(None, [1]), run("a", [1]))
    assert problem is not None and "--forcerun fetch_model" in problem
