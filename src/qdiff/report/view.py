"""What the report knows about one model: every section renders from a ``ModelView``."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from qdiff.core.labels import Combination, plot_name
from qdiff.core.stages import FORCED, RUN

Records = dict[str, list[dict[str, Any]]]  # every stage's records, by stage name


@dataclass
class ModelView:
    model: str
    stages: Records  # every stage's records of this model, in matrix order (qdiff.core.stages)
    pairs: list[dict[str, Any]]
    localised: dict[str, Any] | None = None  # None: capture is off
    exact: dict[str, Any] | None = None  # distance from exact (qdiff.compare.distance); None: off
    reference_model: dict[str, Any] | None = None  # against config.reference_model
    text: dict[str, Any] | None = None  # along the text (qdiff.compare.text); None: off
    is_reference_model: bool = False
    reference: str | None = None  # label of the reference combination
    logits: dict[Combination, Path] = field(default_factory=dict)
    plot_dir: Path | None = None  # where plots are written; None: no plots are drawn
    plot_href: str = "plots"  # the plots folder as the summary links it

    @property
    def records(self) -> list[dict[str, Any]]:
        """The runs: what most sections start from."""
        return self.stages.get(RUN.name, [])

    @property
    def forced(self) -> list[dict[str, Any]]:
        return self.stages.get(FORCED.name, [])

    @cached_property
    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["status"] == "ok"]

    @cached_property
    def ok_pairs(self) -> list[dict[str, Any]]:
        return [p for p in self.pairs if p["status"] == "ok"]

    @cached_property
    def first_step_top_k(self) -> int | None:
        """The tokens first steps were compared over: None for the full vocabulary, else
        the teacher's top-k (``first_step_logits: top_k``; qdiff.compare.pairs, qdiff.compare.distance)."""
        rows = self.ok_pairs + (self.exact["rows"] if self.exact else [])
        return next((r["first_step_top_k"] for r in rows if r.get("first_step_top_k")), None)

    @property
    def first_step_scope(self) -> str:
        """The tokens a first-step figure is over, in a few words (a column, a title)."""
        k = self.first_step_top_k
        return "the full vocabulary" if k is None else f"the teacher's top {k} tokens"

    @property
    def first_step_tokens(self) -> str:
        """What a first-step figure of this model is over, in a sentence's words."""
        if self.first_step_top_k is None:
            return f"over {self.first_step_scope}"
        return (
            f"over {self.first_step_scope} (runs keep no full first-step logits, "
            "`first_step_logits: top_k`: max \\|Δ\\| and KL are lower bounds of the full "
            "vocabulary's; top-1 and bit-identity are exact)"
        )

    @cached_property
    def forced_pairs(self) -> list[dict[str, Any]]:
        return [p for p in self.pairs if p.get("forced", {}).get("status") == "ok"]

    @cached_property
    def prompts(self) -> dict[str, str]:
        """Prompt id -> text, from the first run that ran."""
        return {
            p["id"]: p.get("prompt_text", p["id"])
            for p in (self.ok[0]["prompts"] if self.ok else [])
        }

    def plot(self, kind: str, detail: str | None = None) -> Path | None:
        """Where a plot of this model goes, or None when plots are off."""
        if self.plot_dir is None:
            return None
        return self.plot_dir / plot_name(self.model, kind, detail)

    def link(self, path: Path, alt: str) -> str:
        assert self.plot_dir is not None
        return f"![{alt}]({self.plot_href}/{path.name})"


@dataclass
class Results:
    """Everything the report renders, as the workflow's files hold it."""

    records: Records  # every stage's records (qdiff.core.stages), by stage name
    pairs: list[dict[str, Any]]  # every pair of every model (qdiff.compare.pairs)
    localised: list[dict[str, Any]] | None = None  # per model; None: capture is off
    exact: list[dict[str, Any]] | None = None  # distances from exact, per model; None: off
    against_reference_model: list[dict[str, Any]] = field(default_factory=list)
    text: list[dict[str, Any]] = field(default_factory=list)  # per model (qdiff.compare.text)
    logits: dict[Combination, Path] = field(default_factory=dict)  # runs' first steps, if kept

    @property
    def runs(self) -> list[dict[str, Any]]:
        return self.records.get(RUN.name, [])


def split_by_model(
    results: Results, reference: str | None, plot_dir: Path | None, plot_href: str = "plots"
) -> list[ModelView]:
    """One view per model that ran, in the order of the runs."""
    models = list(dict.fromkeys(r["model"] for r in results.runs))

    def of(model: str, rows: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        return next((x for x in rows or [] if x["model"] == model), None)

    reference_models = {x["reference_model"] for x in results.against_reference_model}
    return [
        ModelView(
            model=m,
            stages={
                name: [r for r in records if r["model"] == m]
                for name, records in results.records.items()
            },
            pairs=[p for p in results.pairs if p["model"] == m],
            localised=of(m, results.localised) if results.localised is not None else None,
            exact=of(m, results.exact) if results.exact is not None else None,
            reference_model=of(m, results.against_reference_model),
            text=of(m, results.text),
            is_reference_model=m in reference_models,
            reference=reference,
            logits={c: p for c, p in results.logits.items() if c.model == m},
            plot_dir=plot_dir,
            plot_href=plot_href,
        )
        for m in models
    ]
