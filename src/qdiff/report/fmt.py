"""Formatting shared by every section: numbers, table cells, tables."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate


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


def cell(text: str) -> str:
    """Text safe inside a GitHub table cell, with newlines kept visible."""
    return text.replace("|", "\\|").replace("\r", "").replace("\n", "⏎")


def code(text: str) -> str:
    return f"`{text}`"


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_none_"
    return tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True)


def count(k: int, n: int) -> str:
    return f"{k}/{n}"


def piece(pieces: dict[str, str], token: int) -> str:
    return f"`{cell(repr(pieces.get(str(token), '?')))}`"
