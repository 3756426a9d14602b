"""Formatting shared by every section: numbers, table cells, tables. Untrusted text (a
prompt, a model's output, a config value, a file's metadata, an error message) reaches the
Markdown only through ``text`` or ``code`` (qdiff.core.markdown)."""

from __future__ import annotations

import re
from typing import Any

from tabulate import tabulate

from qdiff.core.markdown import NEWLINE, code, text

__all__ = ["cell", "code", "count", "num", "piece", "table", "text"]
_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


def num(value: float | None, digits: int = 3) -> str:
    """A number as the report prints it: plain up to 1e6, 3 significant digits."""
    if value is None:
        return "–"
    if value == 0:
        return "0"
    if value == float("inf"):
        return "∞"
    if 100 <= abs(value) < 1e6:
        return f"{value:.0f}"
    return f"{value:.{digits}g}" if 1e-3 <= abs(value) < 100 else f"{value:.2e}"


def cell(markdown: str) -> str:
    """qdiff's own Markdown (never untrusted text: ``text``) inside a table cell."""
    return markdown.replace("|", "\\|").replace("\r", "").replace("\n", NEWLINE)


def table(rows: list[dict[str, Any]]) -> str:
    """GitHub's table of ``rows``; a ``|`` inside a cell (a code span's) is escaped, as
    GitHub's tables require, so that no cell breaks out."""
    if not rows:
        return "_none_"
    cells = [{k: _UNESCAPED_PIPE.sub(r"\\|", str(v)) for k, v in row.items()} for row in rows]
    return tabulate(cells, headers="keys", tablefmt="github", disable_numparse=True)


def count(k: int, n: int) -> str:
    return f"{k}/{n}"


def piece(pieces: dict[str, str], token: int) -> str:
    """A token's text as the model's vocabulary spells it, quoted as Python would."""
    return code(repr(pieces.get(str(token), "?")))
