"""The per-model diagnosis: the rules of qdiff.judge.diagnosis applied to the measured matrix."""

from __future__ import annotations

from qdiff.judge.diagnosis import diagnose
from qdiff.report.view import ModelView


def diagnosis(view: ModelView) -> str:
    findings = diagnose(view.records, view.pairs, view.exact)
    if not findings:
        return "_Nothing to diagnose: fewer than two devices ran this model._"
    legend = (
        "Each line applies one rule of `src/qdiff/judge/diagnosis.py` to the measured pairs and "
        "shows the numbers it rests on.\n\n"
    )
    return legend + "\n".join(f"- **{f.rule}**: {f.text}" for f in findings)
