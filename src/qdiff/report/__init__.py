"""The Markdown report and its TSV tables, rendered from records and comparisons.

The report is a list of sections, each a short function of one model's ``ModelView``
(``report.sections``). A section that fails is replaced by a line that says so (the
traceback goes to the job's log): one broken section never costs the rest of the report.
"""

from __future__ import annotations

import multiprocessing
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import import_module
from pathlib import Path
from typing import Any

from qdiff.core.io import write_text
from qdiff.core.stages import STAGES
from qdiff.jobs import child_preexec
from qdiff.judge.diagnosis import plural
from qdiff.report.fmt import code, text
from qdiff.report.html import markdown_to_html
from qdiff.report.sections import diagnosis, distance, generations, overview, pairs, plots, runs
from qdiff.report.tables import pairs_frame, runs_frame
from qdiff.report.view import ModelView, Results, split_by_model

__all__ = ["ModelView", "ReportFiles", "Results", "failed_report", "render", "write_report"]

TITLE = "# qdiff report: why the same GGUF gives different text on different devices"
PAGE_TITLE = TITLE.removeprefix("# ")

Section = Callable[[ModelView], str]


def _stage_sections() -> list[tuple[str, Section]]:
    """The sections the stage table names (qdiff.core.stages): each stage's own."""
    return [
        (s.section[0], import_module(f"qdiff.report.sections.{s.section[1]}").section)
        for s in STAGES.values()
        if s.section is not None
    ]


# (heading, section) in the order a reader meets them
MODEL_SECTIONS: list[tuple[str, Section]] = [
    ("Runs", runs.runs),
    ("Diagnosis", diagnosis.diagnosis),
    ("Pairwise differences, largest first", pairs.pairs_table),
    ("Free-running generations", generations.generations),
    *_stage_sections(),
    ("Distance from the exact answer", distance.exact_distance),
    ("Error budget", distance.error_budget),
    ("Distance from the reference", pairs.reference_distance),
    ("Distance from the reference model", distance.reference_model_distance),
    ("Tolerances for tests", pairs.tolerance_table),
    ("Plots", plots.overview_plots),
    ("Generated text", runs.texts),
]


def safely(section: Callable[..., str], *args: Any) -> str:
    """A section's text, or a line saying it could not be rendered and why."""
    try:
        return section(*args)
    except Exception as exc:  # one broken section must not cost the report
        traceback.print_exc(file=sys.stderr)
        return (
            f"_This section could not be rendered ({text(f'{type(exc).__name__}: {exc}')}); "
            "`results/logs/report.log` has the details._"
        )


def _file_line(view: ModelView) -> str:
    """The model's own file (not a dequantized copy), where it came from and its licence."""
    records = view.ok or view.records
    record = next((r for r in records if r["dequant"] == "none"), records[0])
    info = record["provenance"]["model_file"]
    if info.get("status", "ok") != "ok":
        return f"File {code(info['file'])} is not available: {text(info.get('error', {}).get('message', '?'))}"
    file_type = info.get("file_type") if record["status"] == "ok" else None
    return (
        f"File {code(info['file'])} ({text(file_type or 'type unknown')}), from "
        f"{text(info['origin'])}, sha256 {code(info['sha256'])}. "
        f"Licence: {text(info.get('licence', 'not recorded'))}."
    )


def render_model(view: ModelView) -> list[str]:
    out = ["", f"## Model `{view.model}`", "", safely(_file_line, view)]
    for heading, section in MODEL_SECTIONS:
        out += ["", f"### {heading}", "", safely(section, view)]
    return out


def render_models(views: list[ModelView], workers: int = 1) -> list[str]:
    """Every model's part of the summary, in order. With ``workers`` > 1, models render in
    that many forked processes: matplotlib's figures are most of a report's time, and each
    model's are its own. A model whose process died renders again here, so that whatever
    failed shows in its sections."""
    if workers <= 1 or len(views) <= 1:
        return [line for view in views for line in render_model(view)]
    parts = []
    with ProcessPoolExecutor(
        min(workers, len(views)),
        mp_context=multiprocessing.get_context("fork"),  # no imports again
        initializer=child_preexec,  # ends with this process
    ) as pool:
        for view, future in [(view, pool.submit(render_model, view)) for view in views]:
            try:
                parts.append(future.result())
            except Exception:  # the worker died: not a section's error, which it renders
                traceback.print_exc(file=sys.stderr)
                parts.append(render_model(view))
    return [line for part in parts for line in part]


def _first_step_scope(views: list[ModelView]) -> list[str]:
    """A warning under the title when first steps were compared over a slice only."""
    scopes = sorted({v.first_step_scope for v in views if v.first_step_top_k is not None})
    if not scopes:
        return []
    return [
        "",
        "**Runs kept no full first-step logits** (`first_step_logits: top_k`): every "
        f"first-step max |Δ|, RMS, NMSE and KL in this report, the diagnosis's included, is "
        f"over {' / '.join(scopes)}, a lower bound "
        "of the full vocabulary's. Top-1 agreement, margins and bit-identity are exact.",
    ]


def render(
    views: list[ModelView],
    records: list[dict[str, Any]],
    writeup_claims: bool = False,
    workers: int = 1,
) -> str:
    status = Counter(r["status"] for r in records)
    n_prompts = max((len(r["prompts"]) for r in records if r["status"] == "ok"), default=0)
    devices = {r["device"] for r in records}
    dequants = {r["dequant"] for r in records}
    out = [
        TITLE,
        "",
        f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by the qdiff workflow. "
        f"{plural(len(views), 'model')} × {plural(len(devices), 'device')} × "
        f"{plural(len(dequants), 'dequant mode')}, {plural(n_prompts, 'prompt')} each: "
        f"{plural(status['ok'], 'combination')} ran, "
        f"{status['failed']} failed, {status['unavailable']} left out.",
        *_first_step_scope(views),
        "",
        "## What this experiment found",
        "",
        safely(overview.found, views),
        "",
        "## Left out and failed",
        "",
        safely(overview.failures, views),
    ]
    if writeup_claims:
        out += ["", "## The candle write-up's claims, checked", "", safely(overview.claims, views)]
    out += render_models(views, workers)
    out += ["", "## Provenance", "", safely(overview.provenance, records), ""]
    return "\n".join(out)


@dataclass(frozen=True)
class ReportFiles:
    """Where the report goes: the summary, its page, the tables and the plots folder
    (linked from the summary as ``plot_href``)."""

    summary: Path
    html: Path
    pairs_tsv: Path
    runs_tsv: Path
    plot_dir: Path
    plot_href: str = "plots"


def write_report(
    results: Results,
    files: ReportFiles,
    reference: str | None = None,
    writeup_claims: bool = False,
    workers: int = 1,
) -> None:
    """Write the summary, the tables, the plots and the summary as a self-contained page;
    ``workers``: processes that render models."""
    write_text(files.pairs_tsv, pairs_frame(results.pairs).to_csv(sep="\t", index=False))
    write_text(files.runs_tsv, runs_frame(results.runs).to_csv(sep="\t", index=False))
    files.plot_dir.mkdir(parents=True, exist_ok=True)  # a declared output, even if empty
    views = split_by_model(results, reference, files.plot_dir, files.plot_href)
    summary = render(views, results.runs, writeup_claims, workers)
    write_text(files.summary, summary)
    page = markdown_to_html(summary, PAGE_TITLE, files.plot_dir, files.plot_href)
    write_text(files.html, page)


def failed_report(summary_path: Path, error: dict[str, Any], html_path: Path | None = None) -> None:
    """What the report (and its page) says when it cannot be rendered at all."""
    summary = (
        f"{TITLE}\n\nThe report could not be rendered: {text(error['message'])}. "
        "`results/logs/report.log` has the details.\n"
    )
    write_text(summary_path, summary)
    if html_path is not None:
        write_text(html_path, markdown_to_html(summary, PAGE_TITLE, Path(), "plots"))
