"""Validate an experiment configuration and expand it into the run matrix.

Everything here is pure Python: the Snakefile calls it at parse time, so a bad config
stops the workflow before any job runs, with every problem named by its key.
"""

from __future__ import annotations

import copy
import functools
import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from itertools import combinations as pairs_of
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import yaml

from qdiff.core import secrets
from qdiff.core.backends import BACKENDS
from qdiff.core.formats import KV_CACHE_TYPES, QUANT_TYPES
from qdiff.core.labels import DEQUANT_MODES, PAIR_SEPARATOR, Combination, Pair
from qdiff.core.serving import cases as serving_cases
from qdiff.core.settings import DeviceSettings
from qdiff.core.stages import CAPTURE, FORCED, RUN, SERVING, TEXT, Stage

SOURCE_KINDS = ("url", "hf", "path", "package")
# Names become path components and Snakemake wildcards: no separators, no "..", and no
# "__", which separates the two combinations in a comparison's file name.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
REQUANT_INFIX = ".requant-"
DEQUANT_INFIX = ".dequant-"
MODELS_DIR = "resources/models"


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
    chat_template: bool | str | None = None  # overrides generation.chat_template
    run: bool = True  # False: only a source for derived models

    @property
    def derived(self) -> bool:
        return self.parent is not None


def model_file(model: str, dequant: str = "none") -> str:
    """The GGUF file a combination loads: the model itself or one of its dequantized copies."""
    if dequant == "none":
        return f"{MODELS_DIR}/{model}.gguf"
    return f"{MODELS_DIR}/{model}{DEQUANT_INFIX}{dequant}.gguf"


def model_info_file(model: str, dequant: str = "none") -> str:
    """The JSON sidecar of a model file: its sha256 and origin, or why it is missing."""
    return model_file(model, dequant) + ".json"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


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
    teacher_forcing: dict[str, Any] | None = None  # {"enabled", "top_k", "n_tokens"}
    capture: dict[str, Any] | None = None  # {"enabled", "prompts", "tensors", "pairs"}
    serving: dict[str, Any] | None = None  # qdiff.core.serving; {"enabled", "prompts", ...}
    text: dict[str, Any] | None = None  # qdiff.core.text; {"enabled", "file", "n_ctx", ...}
    download: dict[str, Any] | None = None  # qdiff.sources.DownloadLimits.from_config
    exact: dict[str, Any] | None = None  # {"enabled"}
    reference_model: str | None = None  # a model every other model is measured against
    report: dict[str, Any] | None = None  # {"writeup_claims": bool}
    first_step_logits: str = "full"  # "full" | "top_k": what a run keeps (qdiff.compare.forced)

    # ---- the matrix ----

    @property
    def run_models(self) -> list[str]:
        """The models whose files are run (a model with ``run: false`` is only a source)."""
        return [name for name, spec in self.models.items() if spec.run]

    def combinations(self, model: str) -> list[Combination]:
        return [Combination(model, device, dq) for device in self.devices for dq in self.dequant]

    def all_combinations(self) -> list[Combination]:
        return [c for model in self.run_models for c in self.combinations(model)]

    def pairs(self, model: str) -> list[Pair]:
        """Every unordered pair of a model's combinations, in matrix order."""
        return [Pair(a, b) for a, b in pairs_of(self.combinations(model), 2)]

    def all_pairs(self) -> list[Pair]:
        return [p for model in self.run_models for p in self.pairs(model)]

    def generation_of(self, model: str) -> dict[str, Any]:
        """The generation settings of one model: the config's, with the model's own chat
        template where it names one."""
        template = self.models[model].chat_template
        return (
            self.generation if template is None else {**self.generation, "chat_template": template}
        )

    def measured_against_reference_model(self) -> list[str]:
        """The models measured against ``reference_model``: every other one."""
        return [m for m in self.run_models if self.reference_model and m != self.reference_model]

    def teacher(self, model: str) -> Combination:
        """The combination whose greedy output every other is forced along (qdiff.compare.forced):
        the reference, or else the model's first combination."""
        if self.reference:
            return Combination.parse(model, self.reference)
        return self.combinations(model)[0]

    # ---- the stages ----

    @property
    def forcing_enabled(self) -> bool:
        return bool(self.teacher_forcing and self.teacher_forcing["enabled"])

    @property
    def capture_enabled(self) -> bool:
        return bool(self.capture and self.capture["enabled"])

    @property
    def serving_enabled(self) -> bool:
        return bool(self.serving and self.serving["enabled"])

    @property
    def text_enabled(self) -> bool:
        return bool(self.text and self.text["enabled"])

    @property
    def exact_enabled(self) -> bool:
        return bool(self.exact and self.exact["enabled"])

    def stage_enabled(self, stage: Stage) -> bool:
        return {
            RUN: True,
            FORCED: self.forcing_enabled,
            CAPTURE: self.capture_enabled,
            SERVING: self.serving_enabled,
            TEXT: self.text_enabled,
        }[stage]

    def keeps_data(self, stage: Stage) -> bool:
        """Whether a stage's jobs write its data file: every stage does, except a run with
        ``first_step_logits: top_k`` (its first steps are then the forced pass's position 0)."""
        return stage is not RUN or self.first_step_logits == "full"

    def spec(self, stage: Stage, combo: Combination) -> dict[str, Any]:
        """The slice of the config one stage's job depends on: its params."""
        builders: dict[Stage, Callable[[Combination], dict[str, Any]]] = {
            RUN: self._run_spec,
            FORCED: self._forced_spec,
            CAPTURE: self._capture_spec,
            SERVING: self._serving_spec,
            TEXT: self._text_spec,
        }
        return {**builders[stage](combo), "stage": stage.name}

    def _run_spec(self, combo: Combination) -> dict[str, Any]:
        return {
            "model": combo.model,
            "device": combo.device,
            "dequant": combo.dequant,
            "settings": self.devices[combo.device].as_dict(),
            "prompts": [{"id": p.id, "text": p.text} for p in self.prompts],
            "generation": dict(sorted(self.generation_of(combo.model).items())),
            # only when asked for, so that existing runs keep their params (and their cache)
            **({"repeats": self.repeats} if self.repeats > 1 else {}),
        }

    def _forced_spec(self, combo: Combination) -> dict[str, Any]:
        """The run's spec, minus repeats, plus the teacher."""
        spec = {k: v for k, v in self._run_spec(combo).items() if k != "repeats"}
        assert self.teacher_forcing is not None
        teacher = self.teacher(combo.model)
        forcing = {"teacher": teacher.label, "top_k": self.teacher_forcing["top_k"]}
        # only when set, so that existing forced passes keep their params (and their cache)
        if self.teacher_forcing["n_tokens"] is not None:
            forcing["n_tokens"] = self.teacher_forcing["n_tokens"]
        return {**spec, "forcing": forcing}

    def _capture_spec(self, combo: Combination) -> dict[str, Any]:
        """The run's spec, minus repeats, plus what to capture; one forward pass per prompt,
        so the number of tokens to generate is moot."""
        assert self.capture is not None
        spec = {k: v for k, v in self._run_spec(combo).items() if k != "repeats"}
        prompts = self.capture["prompts"] or [self.prompts[0].id]
        return {
            **spec,
            "prompts": [p for p in spec["prompts"] if p["id"] in prompts],
            "generation": {k: v for k, v in spec["generation"].items() if k != "n_tokens"},
            "capture": {"prompts": prompts, "tensors": self.capture["tensors"]},
        }

    def _serving_spec(self, combo: Combination) -> dict[str, Any]:
        """The run's spec, minus repeats, plus the needles and the cases (qdiff.core.serving);
        every prompt stays in it, since the others of a batch are the other prompts."""
        assert self.serving is not None
        spec = {k: v for k, v in self._run_spec(combo).items() if k != "repeats"}
        return {
            **spec,
            "serving": {
                "prompts": self.serving["prompts"] or [p.id for p in self.prompts[:2]],
                "n_tokens": self.serving["n_tokens"],
                "long_prompt_tokens": self.serving["long_prompt_tokens"],
                "cases": [c.as_dict() for c in serving_cases(self.serving)],
            },
        }

    def _text_spec(self, combo: Combination) -> dict[str, Any]:
        """The combination, its settings and the text (no prompts, no generation: editing
        them never reruns the text), plus the teacher whose token ids every position keeps."""
        assert self.text is not None
        keep = ("model", "device", "dequant", "settings")
        spec = {k: v for k, v in self._run_spec(combo).items() if k in keep}
        text = {k: self.text[k] for k in ("file", "sha256", "n_ctx", "windows", "top_k")}
        return {
            **spec,
            "generation": {"n_ctx": self.text["n_ctx"]},
            "text": {**text, "teacher": self.teacher(combo.model).label},
        }


# libyaml's parser where PyYAML has it: every invocation parses the config, the prompts and the
# schema, and the pure-Python parser is a tenth of a no-op rerun
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def _schema() -> dict[str, Any]:
    """The JSON schema, with the enums that live in qdiff's tables filled in (read-only)."""
    text = resources.files("qdiff.core").joinpath("config.schema.yaml").read_text()
    schema: dict[str, Any] = yaml.load(text, Loader=_YAML_LOADER)
    device = schema["properties"]["devices"]["additionalProperties"]["properties"]
    device["backend"]["enum"] = list(BACKENDS)
    device["kv_cache_type"]["enum"] = list(KV_CACHE_TYPES)
    schema["properties"]["dequant"]["items"]["enum"] = list(DEQUANT_MODES)
    return schema


def _validator_with_defaults() -> type:
    """A Draft 2020-12 validator that fills in `default:` values while validating."""
    base = jsonschema.Draft202012Validator

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from base.VALIDATORS["properties"](validator, properties, instance, schema)

    return jsonschema.validators.extend(base, {"properties": set_defaults})


def _key_path(path: Any, root: str = "config") -> str:
    return root + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _describe(error: jsonschema.ValidationError, root: str = "config") -> str:
    where = _key_path(error.absolute_path, root)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unexpected = sorted(set(error.instance) - set(allowed))
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"{where}: unknown key {', '.join(map(repr, unexpected))}{hint}"
    if error.validator == "minLength" and error.instance == "":
        return f"{where}: must not be empty"
    if where.endswith(".prompts") and error.validator == "type":
        return f"{where}: must be a list of {{id, text}} or the path of a YAML file with that list"
    return f"{where}: {error.message}"


def _schema_problems(data: dict[str, Any]) -> list[str]:
    validator = _validator_with_defaults()(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    return [_describe(e) for e in errors]


def _name_problem(kind: str, name: str) -> str | None:
    if not SAFE_NAME.match(name) or ".." in name or PAIR_SEPARATOR in name:
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
    """Why a download URL is refused, or None; the reason never quotes the URL's query or
    credentials. Plain http is allowed to loopback only; credentials in the URL are refused
    (they would be logged wherever the URL is), and so are spaces and control characters,
    which the HTTP client refuses later with an error that quotes the whole URL."""
    parsed = urlparse(url)
    if secrets.has_credentials(url):
        return (
            "credentials in the URL (user:password@) are refused: send a token with "
            "token_env instead"
        )
    if re.search(r"[\x00-\x20\x7f]", url):
        return (
            f"{secrets.redact_url(url)} contains a space or a control character: "
            "percent-encode it (a space is %20)"
        )
    if parsed.scheme == "https" and parsed.hostname:
        return None
    if parsed.scheme == "http" and _is_loopback(parsed.hostname):
        return None
    if parsed.scheme == "http":
        return f"plain http:// is refused for {parsed.hostname} (use https://)"
    return f"{secrets.redact_url(url)!r} is not an https:// URL"


def _model_specs(models: dict[str, Any], problems: list[str]) -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    for name, entry in models.items():
        key = f"config.models.{name}"
        if problem := _name_problem("models", name):
            problems.append(problem)
            continue
        problems += [
            f"{key}: names containing {infix!r} are reserved for the models and copies qdiff "
            "derives (their files would collide)"
            for infix in (REQUANT_INFIX, DEQUANT_INFIX)
            if infix in name
        ]
        source = _source(key, entry, problems)
        if source is None:
            continue
        sha = entry.get("sha256", "").lower() or None
        template = entry.get("chat_template")
        specs[name] = ModelSpec(
            name=name, source=source, sha256=sha, chat_template=template, run=entry["run"]
        )
        for quant in entry.get("requantize", []):
            if quant not in QUANT_TYPES:
                problems.append(
                    f"{key}.requantize: unknown quant type {quant!r} "
                    f"(known: {', '.join(QUANT_TYPES)})"
                )
                continue
            derived = f"{name}{REQUANT_INFIX}{quant}"
            specs[derived] = ModelSpec(
                derived, None, None, parent=name, quant=quant, chat_template=template
            )
    _file_collisions(specs, problems)
    return specs


def _source(key: str, entry: dict[str, Any], problems: list[str]) -> dict[str, Any] | None:
    """A model's one source, ``{"kind": kind, kind: value}`` (and a url's token_env), or
    None when it names none or several."""
    kinds = [k for k in SOURCE_KINDS if k in entry]
    if len(kinds) != 1:
        problems.append(
            f"{key}: give exactly one source ({', '.join(SOURCE_KINDS)}), found "
            + (", ".join(kinds) or "none")
        )
        return None
    kind = kinds[0]
    source = {"kind": kind, kind: entry[kind]}
    if "token_env" in entry:
        if kind != "url":
            problems.append(f"{key}.token_env: only `url` sources take a token_env")
        if not secrets.ENV_NAME.fullmatch(entry["token_env"]):
            problems.append(
                f"{key}.token_env: must be the name of the environment variable that holds "
                "the token (capital letters, digits and _, e.g. HF_TOKEN), not the token "
                "itself; the value given is not shown"
            )
        source["token_env"] = entry["token_env"]
    if kind == "url":
        if problem := url_problem(entry["url"]):
            problems.append(f"{key}.url: {problem}")
        if "sha256" not in entry:
            problems.append(f"{key}: a `url` source needs sha256 (the file's SHA-256)")
    return source


def _file_collisions(specs: dict[str, ModelSpec], problems: list[str]) -> None:
    """Two models whose files would be the same file (also on case-insensitive file systems,
    as macOS uses): Snakemake could not tell which rule makes it."""
    owner: dict[str, str] = {}
    for name, spec in specs.items():
        for dq in DEQUANT_MODES:
            path = model_file(name, dq).lower()
            if path in owner and owner[path] != name:
                configured = spec.parent if spec.derived else name
                problems.append(
                    f"config.models.{configured}: model {name!r} would write "
                    f"{model_file(name, dq)}, which model {owner[path]!r} writes too "
                    "(names that differ only in case collide on case-insensitive file systems)"
                )
            owner.setdefault(path, name)


def _device_settings(devices: dict[str, Any], problems: list[str]) -> dict[str, DeviceSettings]:
    settings: dict[str, DeviceSettings] = {}
    for name, configured in devices.items():
        if problem := _name_problem("devices", name):
            problems.append(problem)
            continue
        entry = dict(configured)
        if not BACKENDS[entry["backend"]].on_gpu:
            if entry.get("op_offload"):
                problems.append(
                    f"config.devices.{name}.op_offload: a {entry['backend']} device cannot "
                    "offload ops to a GPU (that would silently run part of it on another backend)"
                )
            entry["op_offload"] = False
        else:
            entry.setdefault("op_offload", True)
        settings[name] = DeviceSettings.from_config(entry)
    return settings


def _prompt_list(value: Any, where: str, problems: list[str]) -> list[dict[str, Any]] | None:
    item_schema = _schema()["$defs"]["prompt_list"]
    errors = list(jsonschema.Draft202012Validator(item_schema).iter_errors(value))
    problems += [_describe(e, where) for e in sorted(errors, key=lambda e: list(e.absolute_path))]
    return None if errors else value


def _prompts(value: Any, base_dir: Path, problems: list[str]) -> tuple[Prompt, ...]:
    where = "config.prompts"
    if isinstance(value, str):
        path = base_dir / value
        try:
            value = load_yaml_strict(path)
        except UnicodeDecodeError as exc:
            line = exc.object[: exc.start].count(b"\n") + 1
            problems.append(
                f"config.prompts: prompt file {path} is not UTF-8 text (byte "
                f"{exc.object[exc.start]:#04x} on line {line}, offset {exc.start}): save it as UTF-8"
            )
            return ()
        except (OSError, yaml.YAMLError) as exc:
            problems.append(f"config.prompts: cannot read prompt file {path}: {exc}")
            return ()
        except ConfigError as exc:
            problems += exc.problems
            return ()
        where = str(path)
    items = _prompt_list(value, where, problems)
    if items is None:
        return ()
    prompts, seen = [], set()
    for i, item in enumerate(items):
        pid = item["id"]
        if pid in seen:
            problems.append(f"{where}[{i}]: duplicate prompt id {pid!r}")
        elif problem := _name_problem("prompts", pid):
            problems.append(problem)
        if "\x00" in item["text"]:
            problems.append(
                f"{where}[{i}].text (prompt {pid!r}): contains a NUL character, at which "
                "llama.cpp's chat templates cut the text: remove it"
            )
        seen.add(pid)
        prompts.append(Prompt(id=pid, text=item["text"]))
    return tuple(prompts)


def _combination_label(
    value: str,
    where: str,
    devices: dict[str, DeviceSettings],
    dequant: list[str],
    problems: list[str],
) -> None:
    try:
        combo = Combination.parse("", value)
    except ValueError:
        combo = None
    if combo is None or combo.device not in devices or combo.dequant not in dequant:
        problems.append(
            f"{where}: {value!r} is not a configured combination (write device.dequant, "
            "e.g. cpu.f32)"
        )


def _reference(
    data: dict[str, Any], devices: dict[str, DeviceSettings], problems: list[str]
) -> str | None:
    if "reference" not in data:
        first = next(iter(devices), None)
        return Combination("", first, "f32").label if first and "f32" in data["dequant"] else None
    _combination_label(data["reference"], "config.reference", devices, data["dequant"], problems)
    return str(data["reference"])


def _check_capture(
    capture: dict[str, Any],
    devices: dict[str, DeviceSettings],
    dequant: list[str],
    prompts: tuple[Prompt, ...],
    problems: list[str],
) -> None:
    known = {p.id for p in prompts}
    for pid in capture["prompts"]:
        if known and pid not in known:
            problems.append(f"config.capture.prompts: {pid!r} is not a prompt id")
    try:
        re.compile(capture["tensors"])
    except re.error as exc:
        problems.append(f"config.capture.tensors: not a regular expression: {exc}")
    for i, pair in enumerate(capture["pairs"]):
        for item in pair:
            _combination_label(item, f"config.capture.pairs[{i}]", devices, dequant, problems)


def _check_serving(
    serving: dict[str, Any], prompts: tuple[Prompt, ...], problems: list[str]
) -> None:
    known = {p.id for p in prompts}
    for pid in serving["prompts"]:
        if known and pid not in known:
            problems.append(f"config.serving.prompts: {pid!r} is not a prompt id")
    for kind, key in (("batch", "others"), ("staggered", "others"), ("ubatch", "n_ubatch")):
        if kind in serving["cases"] and not serving[key]:
            problems.append(f"config.serving.{key}: empty, so the {kind} cases would not run")
    if serving["enabled"] and not serving["cases"]:
        problems.append("config.serving.cases: empty; set enabled: false to run none")


def _check_text(text: dict[str, Any], base_dir: Path, problems: list[str]) -> None:
    if not text["enabled"]:
        return
    for key in ("file", "sha256"):
        if text[key] is None:
            problems.append(f"config.text.{key}: needed when text.enabled is true")
    if text["file"] is not None and not (base_dir / text["file"]).is_file():
        problems.append(
            f"config.text.file: {text['file']} does not exist (./setup fetches the default "
            "text; see config/README.md)"
        )


def validate(
    config: dict[str, Any], base_dir: Path | str = "."
) -> tuple[Experiment, dict[str, Any]]:
    """Validate ``config`` (a parsed config.yaml); return the experiment and the config with
    every default filled in. Raises ConfigError naming every problem."""
    data = copy.deepcopy(config)
    problems = _schema_problems(data)
    if problems:
        raise ConfigError(problems)
    models = _model_specs(data["models"], problems)
    devices = _device_settings(data["devices"], problems)
    prompts = _prompts(data["prompts"], Path(base_dir), problems)
    reference = _reference(data, devices, problems)
    _check_capture(data["capture"], devices, data["dequant"], prompts, problems)
    _check_serving(data["serving"], prompts, problems)
    _check_text(data["text"], Path(base_dir), problems)
    _check_reference_model(data, models, reference, problems)
    _check_first_step_logits(data, problems)
    if problems:
        raise ConfigError(problems)
    experiment = Experiment(
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
        serving=data["serving"],
        text=data["text"],
        download=data["download"],
        exact=data["exact"],
        reference_model=data.get("reference_model"),
        report=data["report"],
        first_step_logits=data["first_step_logits"],
    )
    return experiment, data


def _check_reference_model(
    data: dict[str, Any], models: dict[str, ModelSpec], reference: str | None, problems: list[str]
) -> None:
    if data.get("reference_model") is None:
        return
    if data["reference_model"] not in models:
        problems.append(
            f"config.reference_model: {data['reference_model']!r} is not a configured model "
            f"(models: {', '.join(models)})"
        )
    if reference is None:
        problems.append("config.reference_model: needs `reference` (a combination, e.g. cpu.f32)")


def _check_first_step_logits(data: dict[str, Any], problems: list[str]) -> None:
    """``top_k`` keeps first steps in the forced pass, over a slice of the vocabulary."""
    if data["first_step_logits"] != "top_k":
        return
    if not data["teacher_forcing"]["enabled"]:
        problems.append(
            "config.first_step_logits: top_k keeps first steps in the teacher-forced pass, "
            "so it needs teacher_forcing.enabled: true"
        )
    if data.get("reference_model") is not None:
        problems.append(
            "config.first_step_logits: top_k cannot measure against reference_model, "
            "which compares two models' full first-step logits; use full"
        )
    if data["report"]["writeup_claims"]:
        problems.append(
            "config.first_step_logits: top_k cannot check report.writeup_claims, whose "
            "bounds need the full vocabulary's max |Δ| (top_k gives a lower bound); use full"
        )


def load_experiment(config: dict[str, Any], base_dir: Path | str = ".") -> Experiment:
    """Validate ``config`` and expand it, or raise ConfigError."""
    return validate(config, base_dir)[0]


class _UniqueKeyLoader(_YAML_LOADER):  # type: ignore[misc,valid-type]
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


def load_yaml_strict(path: Path | str) -> Any:
    """Parse a YAML file, raising ConfigError if a mapping defines a key twice (and
    UnicodeDecodeError, which names the byte, if it is not UTF-8)."""
    loader = _UniqueKeyLoader(Path(path).read_bytes().decode("utf-8"))
    loader.name = str(path)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


YTE_KEY = "__use_yte__"


def check_config_files(paths: list[Path | str]) -> None:
    """Raise ConfigError if a config file defines a key twice in one mapping (YAML would
    silently keep the last one), or is a YTE template: Snakemake runs a file that sets
    ``__use_yte__`` as Python code when it loads it, so qdiff refuses it (config/README.md)."""
    for path in paths:
        loaded = load_yaml_strict(path)
        if isinstance(loaded, dict) and loaded.get(YTE_KEY):
            raise ConfigError(
                [
                    f"{path}: sets {YTE_KEY}, which makes Snakemake run the file as a YTE "
                    "template, Python code included; qdiff refuses templated configs: write "
                    "the values out"
                ]
            )


def canonical_json(value: Any) -> str:
    """Stable text for Snakemake params, which it compares by repr()."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
