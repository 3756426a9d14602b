"""Validate an experiment configuration and expand it into the run matrix.

Everything here is pure Python: the Snakefile calls it at parse time, so a bad config
stops the workflow before any job runs, with every problem named by its key.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
from dataclasses import dataclass
from importlib import resources
from itertools import combinations as pairs_of
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import yaml

from qdiff.quant import QUANT_TYPES
from qdiff.settings import DeviceSettings

SOURCE_KINDS = ("url", "hf", "path", "package")
DEQUANT_MODES = ("none", "f32", "f16", "bf16")
# Names become path components and Snakemake wildcards: no separators, no "..",
# and no "__", which separates the two combinations in a comparison's file name.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
REQUANT_INFIX = ".requant-"


class ConfigError(ValueError):
    """A configuration problem; the message names every bad key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            "invalid qdiff configuration:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\n(config/README.md explains every key)"
        )


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: dict[str, Any] | None  # {"kind": "url"|"hf"|"path"|"package", ...}; None if derived
    sha256: str | None
    parent: str | None = None  # derived models: the model they are requantized from
    quant: str | None = None  # derived models: the llama.cpp quant type

    @property
    def derived(self) -> bool:
        return self.parent is not None


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


@dataclass(frozen=True, order=True)
class Combination:
    model: str
    device: str
    dequant: str

    @property
    def label(self) -> str:
        return f"{self.device}.{self.dequant}"


@dataclass(frozen=True)
class Experiment:
    models: dict[str, ModelSpec]  # fetched models first, each followed by its derived ones
    devices: dict[str, DeviceSettings]
    dequant: tuple[str, ...]
    prompts: tuple[Prompt, ...]
    generation: dict[str, Any]
    strict_devices: bool
    run_timeout_s: float
    repeats: int = 1
    reference: str | None = None  # "device.dequant" the report measures everything against
    teacher_forcing: dict[str, Any] | None = None  # {"enabled": bool, "top_k": int}
    capture: dict[str, Any] | None = None  # {"enabled", "prompts", "tensors", "pairs"}

    @property
    def capture_enabled(self) -> bool:
        return bool(self.capture and self.capture["enabled"])

    def capture_spec(self, combo: Combination) -> dict[str, Any]:
        """A tensor capture's params: the run's, minus repeats, plus what to capture."""
        assert self.capture is not None
        spec = {k: v for k, v in self.run_spec(combo).items() if k != "repeats"}
        prompts = self.capture["prompts"] or [self.prompts[0].id]
        return {
            **spec,
            "prompts": [p for p in spec["prompts"] if p["id"] in prompts],
            # one forward pass over the prompt: the number of tokens to generate is moot
            "generation": {k: v for k, v in spec["generation"].items() if k != "n_tokens"},
            "mode": "capture",
            "capture": {"prompts": prompts, "tensors": self.capture["tensors"]},
        }

    @property
    def forcing_enabled(self) -> bool:
        return bool(self.teacher_forcing and self.teacher_forcing["enabled"])

    def teacher(self, model: str) -> Combination:
        """The combination whose greedy output every other is forced along (qdiff.forcing):
        the reference, or else the model's first combination."""
        if self.reference:
            device, _, dequant = self.reference.rpartition(".")
            return Combination(model, device, dequant)
        return self.combinations(model)[0]

    def combinations(self, model: str) -> list[Combination]:
        return [
            Combination(model, device, dq) for device in self.devices for dq in self.dequant
        ]

    def all_combinations(self) -> list[Combination]:
        return [c for model in self.models for c in self.combinations(model)]

    def pairs(self, model: str) -> list[tuple[Combination, Combination]]:
        """Every unordered pair of a model's combinations, in matrix order."""
        return list(pairs_of(self.combinations(model), 2))

    def run_spec(self, combo: Combination) -> dict[str, Any]:
        """The slice of the config one run depends on: its job's params."""
        return {
            "model": combo.model,
            "device": combo.device,
            "dequant": combo.dequant,
            "settings": self.devices[combo.device].as_dict(),
            "prompts": [{"id": p.id, "text": p.text} for p in self.prompts],
            "generation": dict(sorted(self.generation.items())),
            "strict_devices": self.strict_devices,
            "timeout_s": self.run_timeout_s,
            # only when asked for, so that existing runs keep their params (and their cache)
            **({"repeats": self.repeats} if self.repeats > 1 else {}),
        }

    def forced_spec(self, combo: Combination) -> dict[str, Any]:
        """A teacher-forced pass's params: the run's, minus repeats, plus the teacher."""
        spec = {k: v for k, v in self.run_spec(combo).items() if k != "repeats"}
        teacher = self.teacher(combo.model)
        assert self.teacher_forcing is not None
        return {
            **spec,
            "mode": "force",
            "forcing": {"teacher": teacher.label, "top_k": self.teacher_forcing["top_k"]},
        }


def _schema() -> dict[str, Any]:
    text = resources.files("qdiff").joinpath("config.schema.yaml").read_text()
    return yaml.safe_load(text)


def _validator_with_defaults() -> type:
    """A Draft 2020-12 validator that fills in `default:` values while validating."""
    base = jsonschema.Draft202012Validator

    def set_defaults(validator, properties, instance, schema):  # type: ignore[no-untyped-def]
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from base.VALIDATORS["properties"](validator, properties, instance, schema)

    return jsonschema.validators.extend(base, {"properties": set_defaults})


def _key_path(path: Any) -> str:
    return "config" + "".join(
        f"[{p}]" if isinstance(p, int) else f".{p}" for p in path
    )


def _describe(error: jsonschema.ValidationError) -> str:
    where = _key_path(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unexpected = sorted(set(error.instance) - set(allowed))
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"{where}: unknown key {', '.join(map(repr, unexpected))}{hint}"
    if error.validator == "required":
        return f"{where}: {error.message}"
    if error.validator == "oneOf" and where.endswith(".prompts"):
        return f"{where}: must be a list of {{id, text}} or the path of a YAML file with that list"
    return f"{where}: {error.message}"


def _schema_problems(data: dict[str, Any]) -> list[str]:
    validator = _validator_with_defaults()(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    return [_describe(e) for e in errors]


def _name_problem(kind: str, name: str) -> str | None:
    if not SAFE_NAME.match(name) or ".." in name or "__" in name:
        return (
            f"config.{kind}: name {name!r} is not usable as a file name: use letters, "
            "digits and . _ + - (no '/', no '..', no '__', not empty)"
        )
    return None


def _is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def url_problem(url: str) -> str | None:
    """Why a download URL is refused, or None. Plain http is allowed to loopback only."""
    parsed = urlparse(url)
    if parsed.scheme == "https" and parsed.hostname:
        return None
    if parsed.scheme == "http" and _is_loopback(parsed.hostname):
        return None
    if parsed.scheme == "http":
        return f"plain http:// is refused for {parsed.hostname} (use https://)"
    return f"{url!r} is not an https:// URL"


def _model_specs(models: dict[str, Any], problems: list[str]) -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    for name, entry in models.items():
        key = f"config.models.{name}"
        if problem := _name_problem("models", name):
            problems.append(problem)
            continue
        kinds = [k for k in SOURCE_KINDS if k in entry]
        if len(kinds) != 1:
            problems.append(
                f"{key}: give exactly one source ({', '.join(SOURCE_KINDS)}), found "
                + (", ".join(kinds) or "none")
            )
            continue
        kind = kinds[0]
        source = {"kind": kind, kind: entry[kind]}
        if "token_env" in entry:
            if kind != "url":
                problems.append(f"{key}.token_env: only `url` sources take a token_env")
            source["token_env"] = entry["token_env"]
        if kind == "url":
            if problem := url_problem(entry["url"]):
                problems.append(f"{key}.url: {problem}")
            if "sha256" not in entry:
                problems.append(f"{key}: a `url` source needs sha256 (the file's SHA-256)")
        sha = entry.get("sha256", "").lower() or None
        specs[name] = ModelSpec(name=name, source=source, sha256=sha)
        for quant in entry.get("requantize", []):
            if quant not in QUANT_TYPES:
                problems.append(
                    f"{key}.requantize: unknown quant type {quant!r} "
                    f"(known: {', '.join(QUANT_TYPES)})"
                )
                continue
            derived = f"{name}{REQUANT_INFIX}{quant}"
            specs[derived] = ModelSpec(
                name=derived, source=None, sha256=None, parent=name, quant=quant
            )
    clashes = [n for n in specs if REQUANT_INFIX in n and specs[n].parent is None]
    for name in clashes:
        problems.append(
            f"config.models.{name}: names containing {REQUANT_INFIX!r} are reserved "
            "for derived models"
        )
    return specs


def _device_settings(
    devices: dict[str, Any], problems: list[str]
) -> dict[str, DeviceSettings]:
    settings: dict[str, DeviceSettings] = {}
    for name, entry in devices.items():
        if problem := _name_problem("devices", name):
            problems.append(problem)
            continue
        entry = dict(entry)
        if entry["backend"] == "cpu":
            if entry.get("op_offload"):
                problems.append(
                    f"config.devices.{name}.op_offload: a cpu device cannot offload ops "
                    "to a GPU (that would silently run part of it on another backend)"
                )
            entry["op_offload"] = False
        else:
            entry.setdefault("op_offload", True)
        settings[name] = DeviceSettings.from_config(entry)
    return settings


def _prompts(value: Any, base_dir: Path, problems: list[str]) -> tuple[Prompt, ...]:
    if isinstance(value, str):
        path = base_dir / value
        try:
            value = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            problems.append(f"config.prompts: cannot read prompt file {path}: {exc}")
            return ()
        item_schema = _schema()["properties"]["prompts"]["oneOf"][1]
        for error in jsonschema.Draft202012Validator(item_schema).iter_errors(value):
            problems.append(f"{_describe(error).replace('config', f'{path}', 1)}")
        if problems:
            return ()
    prompts, seen = [], set()
    for i, item in enumerate(value):
        pid = item["id"]
        if pid in seen:
            problems.append(f"config.prompts[{i}]: duplicate prompt id {pid!r}")
        elif problem := _name_problem("prompts", pid):
            problems.append(problem)
        seen.add(pid)
        prompts.append(Prompt(id=pid, text=item["text"]))
    return tuple(prompts)


def _reference(
    data: dict[str, Any], devices: dict[str, DeviceSettings], problems: list[str]
) -> str | None:
    if "reference" not in data:
        first = next(iter(devices), None)
        return f"{first}.f32" if first and "f32" in data["dequant"] else None
    device, _, dequant = data["reference"].rpartition(".")
    if device not in devices or dequant not in data["dequant"]:
        problems.append(
            f"config.reference: {data['reference']!r} is not a configured combination "
            "(write device.dequant, e.g. cpu.f32)"
        )
    return data["reference"]


def _check_capture(
    capture: dict[str, Any], devices: dict[str, DeviceSettings], dequant: list[str],
    prompts: tuple[Prompt, ...], problems: list[str],
) -> None:
    known = {p.id for p in prompts}
    for pid in capture["prompts"]:
        if known and pid not in known:
            problems.append(f"config.capture.prompts: {pid!r} is not a prompt id")
    try:
        re.compile(capture["tensors"])
    except re.error as exc:
        problems.append(f"config.capture.tensors: not a regular expression: {exc}")
    labels = {f"{d}.{q}" for d in devices for q in dequant}
    for i, pair in enumerate(capture["pairs"]):
        for item in pair:
            if item not in labels:
                problems.append(
                    f"config.capture.pairs[{i}]: {item!r} is not a configured combination "
                    "(write device.dequant, e.g. cpu.none)"
                )


def load_experiment(config: dict[str, Any], base_dir: Path | str = ".") -> Experiment:
    """Validate ``config`` (a parsed config.yaml) and expand it, or raise ConfigError."""
    data = copy.deepcopy(config)
    problems = _schema_problems(data)
    if problems:
        raise ConfigError(problems)
    models = _model_specs(data["models"], problems)
    devices = _device_settings(data["devices"], problems)
    prompts = _prompts(data["prompts"], Path(base_dir), problems)
    reference = _reference(data, devices, problems)
    _check_capture(data["capture"], devices, data["dequant"], prompts, problems)
    if problems:
        raise ConfigError(problems)
    return Experiment(
        models=models,
        devices=devices,
        dequant=tuple(data["dequant"]),
        prompts=prompts,
        generation=data["generation"],
        strict_devices=data["strict_devices"],
        run_timeout_s=float(data["run_timeout_s"]),
        repeats=data["repeats"],
        reference=reference,
        teacher_forcing=data["teacher_forcing"],
        capture=data["capture"],
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping with the same key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    [
                        f"{self.name}: duplicate key {key!r} on line {key_node.start_mark.line + 1} "
                        f"(first on line {seen[key]}): the first definition would be silently lost"
                    ]
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def check_duplicate_keys(paths: list[Path | str]) -> None:
    """Raise ConfigError if a YAML file defines a key twice in one mapping."""
    for path in paths:
        with open(path) as f:
            loader = _UniqueKeyLoader(f)
            loader.name = str(path)
            try:
                loader.get_single_data()
            finally:
                loader.dispose()


def canonical_json(value: Any) -> str:
    """Stable text for Snakemake params, which it compares by repr()."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
