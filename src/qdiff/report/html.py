"""The Markdown summary as one self-contained HTML page, for Snakemake's report
(``snakemake --report``), whose viewer shows no Markdown and resolves no relative links."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from markdown_it import MarkdownIt

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 80rem; margin: 1rem auto;
       padding: 0 1rem; line-height: 1.45; color: #1b1b1b; }
table { border-collapse: collapse; margin: 0.5rem 0; font-size: 0.85rem; display: block;
        overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.45rem; text-align: left;
         vertical-align: top; }
th { background: #f2f2f2; position: sticky; top: 0; }
code { background: #f4f4f4; padding: 0 0.2rem; border-radius: 3px; font-size: 0.9em; }
pre { background: #f4f4f4; padding: 0.6rem; overflow-x: auto; }
img { max-width: 100%; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2rem; }
"""

# a plot the report links: one file name in the plots folder (no other folder, no scheme)
_IMAGE = re.compile(r'<img src="([^":/]+/[^"/]+\.png)"')


def markdown_to_html(markdown: str, title: str, plot_dir: Path, plot_href: str) -> str:
    """``markdown`` as a standalone page; the PNGs it links as ``<plot_href>/<name>`` are
    embedded from ``plot_dir``, so the page shows them wherever it is opened. Any other or
    missing image stays a link. Raw HTML is never rendered: the Markdown's untrusted text
    is escaped already (qdiff.core.markdown), and this is the second guard."""
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)

    def embed(match: re.Match[str]) -> str:
        src = html.unescape(match.group(1))
        name = src.removeprefix(f"{plot_href}/")
        path = plot_dir / name
        if not src.startswith(f"{plot_href}/") or name.startswith(".") or not path.is_file():
            return match.group(0)
        data = base64.b64encode(path.read_bytes()).decode()
        return f'<img src="data:image/png;base64,{data}"'

    body = _IMAGE.sub(embed, body)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body>\n{body}</body></html>\n"
    )
