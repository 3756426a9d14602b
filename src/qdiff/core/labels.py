"""Names of what qdiff compares: a combination (model, device, dequant) and a pair of them.

A combination's label is ``device.dequant`` (e.g. ``cpu-fa.f32``); a pair's file stem is
``a__b`` of the two labels. Every place that formats, parses or matches a label uses this
module, so the spelling lives here only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The files a combination can load: the model itself, or a dequantized copy of it.
DEQUANT_COPIES = ("f32", "f16", "bf16")
DEQUANT_MODES = ("none", *DEQUANT_COPIES)
PAIR_SEPARATOR = "__"  # device names may not contain it (config.SAFE_NAME)
# The report's plots, ``<model>.<kind>[.<detail>].png``: the report draws them, the workflow
# flags them for Snakemake's report by this pattern (model names contain dots, so the model
# is everything before a known kind).
PLOT_KINDS = (
    "heatmap",
    "largest-pair",
    "forced-positions",
    "depth",
    "budget",
    "divergence",
    "delta-p",
)
PLOT_PATTERN = "{model}.{plot,(" + "|".join(PLOT_KINDS) + r")(\..+)?}.png"


def plot_name(model: str, kind: str, detail: str | None = None) -> str:
    assert kind in PLOT_KINDS, kind
    return f"{model}.{kind}" + (f".{detail}" if detail else "") + ".png"


@dataclass(frozen=True, order=True)
class Combination:
    model: str
    device: str
    dequant: str

    @property
    def label(self) -> str:
        return f"{self.device}.{self.dequant}"

    @property
    def key(self) -> tuple[str, str]:
        """(device, dequant): the combination within its model."""
        return (self.device, self.dequant)

    @classmethod
    def parse(cls, model: str, label: str) -> Combination:
        """``device.dequant`` -> Combination (device names may contain dots)."""
        device, dot, dequant = label.rpartition(".")
        if not dot or not device or dequant not in DEQUANT_MODES:
            raise ValueError(f"{label!r} is not a combination label (write device.dequant)")
        return cls(model, device, dequant)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Combination:
        return cls(record["model"], record["device"], record["dequant"])

    def with_dequant(self, dequant: str) -> Combination:
        return Combination(self.model, self.device, dequant)


@dataclass(frozen=True)
class Pair:
    """Two combinations of one model; ``a`` is the reference side of every metric."""

    a: Combination
    b: Combination

    def __post_init__(self) -> None:
        if self.a.model != self.b.model:
            raise ValueError(f"a pair compares one model: {self.a.model} vs {self.b.model}")

    @property
    def model(self) -> str:
        return self.a.model

    @property
    def stem(self) -> str:
        """The pair's file name without suffix: ``cpu.none__cpu-fa.none``."""
        return f"{self.a.label}{PAIR_SEPARATOR}{self.b.label}"

    @property
    def labels(self) -> tuple[str, str]:
        return (self.a.label, self.b.label)

    @property
    def same_file(self) -> bool:
        """Both sides load the same weights file: the question is the device or a setting."""
        return self.a.dequant == self.b.dequant

    @property
    def same_device(self) -> bool:
        return self.a.device == self.b.device

    def involves(self, combo: Combination) -> bool:
        return combo in (self.a, self.b)

    def other(self, combo: Combination) -> Combination:
        return self.b if combo == self.a else self.a

    @classmethod
    def from_result(cls, result: Mapping[str, Any]) -> Pair:
        model = result["model"]
        return cls(Combination.parse(model, result["a"]), Combination.parse(model, result["b"]))

    @classmethod
    def parse(cls, model: str, a: str, b: str) -> Pair:
        return cls(Combination.parse(model, a), Combination.parse(model, b))
