"""Untrusted text in qdiff's Markdown: shown literally, never as markup.

Text that comes from a prompt, a model's output, a config value, a model file's metadata or
an error message goes into the report (and into the diagnosis's sentences) only through
``text`` (prose) or ``code`` (a code span). It never becomes markup (a link, an emphasis,
raw HTML), never breaks a table (``|``, a newline) and carries no control character (a NUL)
into ``summary.md``. The HTML page adds a second guard: it renders no raw HTML at all
(qdiff.report.html).
"""

from __future__ import annotations

import re

# What CommonMark and GitHub give a meaning to inside a line: escapes, code, emphasis,
# links and images, raw HTML and autolinks, entities, tables, strikethrough and math
# (an underscore inside a word, as in llama_model_quantize, emphasises nothing: kept)
_MARKUP = re.compile(r"([\\`*\[\]<>&|~$]|(?<!\w)_|_(?!\w))")
# control characters (C0 but tab and newline, DEL, C1) and Unicode's line separators
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
NEWLINE = "⏎"


def _visible(value: object) -> str:
    """``value`` on one line: newlines as ⏎, control characters as their code point."""
    one_line = str(value).replace("\r\n", "\n").replace("\n", NEWLINE)
    return _CONTROL.sub(lambda m: f"<U+{ord(m[0]):04X}>", one_line)


def text(value: object) -> str:
    """Untrusted text as Markdown that shows it literally, on one line, safe in a table cell."""
    return _MARKUP.sub(r"\\\1", _visible(value))


def code(value: object) -> str:
    """Untrusted text (or a name) as one code span: a fence longer than any run of
    backticks inside. (In a table, ``qdiff.report.fmt.table`` escapes its ``|``.)"""
    inner = _visible(value)
    fence = "`" * (max((len(run) for run in re.findall("`+", inner)), default=0) + 1)
    pad = " " if inner.startswith("`") or inner.endswith("`") or not inner.strip() else ""
    return f"{fence}{pad}{inner}{pad}{fence}"
