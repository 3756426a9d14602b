"""Hostile text in the report: a prompt, a config value, a model file's metadata and an error
message that carry HTML, script, Markdown and table syntax reach summary.md and summary.html
only as text (the real workflow, on a tiny real model whose licence metadata is hostile)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import Workspace
from qdiff.core.markdown import code, text
from tinymodel import write_tiny_llama

pytestmark = pytest.mark.workflow

SCRIPT = "<script>alert('prompt')</script>"
IMG = '<img src=x onerror="alert(1)">'
LINK = "[click](javascript:alert(2))"
PROMPT = f"{SCRIPT} {IMG} {LINK} a|b `tick` *em* &lt; $x$"
LICENCE = "<script>alert('licence')</script> | <b onmouseover=alert(3)>MIT</b>"
ENV_VALUE = "<img src=y onerror=alert(4)>|z"
MISSING = "/nonexistent/<svg onload=alert(5)>|m.gguf"
# what markdown-it makes of qdiff's own Markdown, and nothing else
ALLOWED_TAGS = {
    "html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "ul", "li",
    "strong", "em", "code", "pre", "table", "thead", "tbody", "tr", "th", "td", "a", "img",
}  # fmt: skip


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.data: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))

    def handle_data(self, data: str) -> None:
        self.data.append(data)


def table_rows_are_whole(markdown: str) -> list[str]:
    """Rows of a table whose cell count differs from its header's: a cell that broke out."""
    broken, width = [], None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            width = None
            continue
        cells = len(re.findall(r"(?<!\\)\|", line))
        if width is None:
            width = cells
        elif cells != width:
            broken.append(line)
    return broken


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("hostile_models")
    ws = Workspace(tmp_path_factory.mktemp("hostile") / "ws")
    ws.write_config(
        {
            "models": {
                "tiny": {"path": str(write_tiny_llama(models / "t.gguf", licence=LICENCE))},
                "missing": {"path": MISSING},
            },
            "devices": {
                "cpu": {"backend": "cpu", "threads": 1, "env": {"GGML_QDIFF_NOTE": ENV_VALUE}},
                "cpu-fa": {"backend": "cpu", "threads": 1, "flash_attn": True},
            },
            "dequant": ["none"],
            "prompts": [{"id": "evil", "text": PROMPT}],
            "generation": {"n_tokens": 4, "n_ctx": 128},
            "teacher_forcing": {"enabled": False},
            "capture": {"enabled": False},
            "exact": {"enabled": False},
        }
    )
    ws.snakemake()
    return ws.root / "results"


def test_no_hostile_text_becomes_markup_in_the_html_page(hostile: Path) -> None:
    page = Tags()
    page.feed((hostile / "summary.html").read_text())
    tags = {tag for tag, _ in page.tags}
    assert tags <= ALLOWED_TAGS, tags - ALLOWED_TAGS
    for tag, attrs in page.tags:
        for name, value in attrs:
            assert not name.startswith("on"), (tag, name, value)
            assert not (value or "").strip().lower().startswith("javascript:"), (tag, value)
    shown = "".join(page.data)
    # each hostile string is on the page, as the text it is
    for hostile_text in (SCRIPT, IMG, LINK, "a|b `tick` *em* &lt; $x$", LICENCE, ENV_VALUE):
        assert hostile_text in shown, hostile_text
    assert "<svg onload=alert(5)>|m.gguf" in shown  # inside the failure's message


def test_hostile_text_keeps_summary_md_tables_whole(hostile: Path) -> None:
    summary = (hostile / "summary.md").read_text()
    assert table_rows_are_whole(summary) == []
    raw_tags = re.findall(r"(?<!\\)<(?:script|img|svg|b)\b[^\n]{0,40}", summary)
    assert raw_tags == []  # escaped wherever they are (a code block holds none)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f]", summary)
    tsv = (hostile / "runs.tsv").read_text()  # the machine-readable table keeps the text
    assert "evil" in tsv


def test_text_and_code_render_any_string_literally() -> None:
    """Pure logic: NUL and other control characters become visible code points, newlines ⏎;
    backticks inside a code span get a longer fence."""
    assert text("a\x00b\nc|d") == "a<U+0000>b⏎c\\|d".replace("<", "\\<").replace(">", "\\>")
    assert code("x`y") == "``x`y``"
    assert code("`") == "`` ` ``"
    assert code("a|b") == "`a|b`"  # (fmt.table escapes a cell's |)
