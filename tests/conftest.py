"""Shared fixtures: tiny real GGUF models and a driver for the real Snakemake workflow."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from qdiff.core.text import DEFAULT_TEXT
from qdiff.engine.quant import quantize
from tinymodel import write_tiny_llama

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An F32 random-weight llama, written with the gguf package."""
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_gguf_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models_b") / "tiny-b.gguf", seed=1)


@dataclass
class Job:
    rule: str
    wildcards: dict[str, str]
    resources: dict[str, str]


@dataclass
class Workspace:
    """A working directory for the real workflow, with its own config."""

    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "config" / "config.yaml"

    def write_config(self, config: dict[str, Any]) -> None:
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def read_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.config_path.read_text())

    def command(self, *args: str) -> list[str]:
        """The snakemake command line of this workspace, as a user runs the workflow."""
        return [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(self.root),
            "--cores",
            "2",
            *args,
        ]

    def snakemake(
        self, *args: str, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = self.command(*args)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=REPO)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"snakemake {' '.join(args)} failed ({proc.returncode}):\n"
                f"{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
            )
        return proc

    def planned_jobs(self) -> list[Job]:
        """The jobs a dry run plans, with their wildcards (the `all` target excluded)."""
        return self.planned_jobs_with()

    def planned_jobs_with(self, *args: str, env: dict[str, str] | None = None) -> list[Job]:
        out = self.snakemake("--dry-run", *args, env=env)
        text = out.stdout + out.stderr
        jobs = []
        for block in re.split(r"\n(?=(?:local)?rule \w+:)", text):
            m = re.match(r"(?:local)?rule (\w+):", block.strip())
            if not m or m[1] == "all":
                continue
            jobs.append(Job(m[1], _key_values(block, "wildcards"), _key_values(block, "resources")))
        return jobs

    def pairs(self, model: str) -> list[dict[str, Any]]:
        """Every pair comparison of ``model`` (results/compare/<model>.json)."""
        path = self.root / f"results/compare/{model}.json"
        return list(json.loads(path.read_text())["pairs"])

    def pair(self, model: str, a: str, b: str) -> dict[str, Any]:
        return next(p for p in self.pairs(model) if (p["a"], p["b"]) == (a, b))

    def copy_to(self, dest: Path) -> Workspace:
        shutil.copytree(self.root, dest, symlinks=True)  # copy2 keeps mtimes
        return Workspace(dest)


def _key_values(block: str, field: str) -> dict[str, str]:
    """The `field: a=1, b=2` line of a job in Snakemake's dry-run output."""
    line = re.search(rf"^\s+{field}: (.*)$", block, re.M)
    return dict(kv.split("=", 1) for kv in line[1].split(", ")) if line else {}


def tiny_config(model_path: Path, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "models": {"tiny": {"path": str(model_path), "requantize": ["q8_0"]}},
        "devices": {
            "cpu": {"backend": "cpu", "threads": 1},
            "cpu-fa": {"backend": "cpu", "threads": 1, "flash_attn": True},
        },
        "dequant": ["none", "f32"],
        "prompts": [
            {"id": "rust", "text": "What is Rust?"},
            {"id": "france", "text": "The capital of France is"},
        ],
        "generation": {"n_tokens": 8, "n_ctx": 256},
        # on by default for users; here only where a test is about it (tests/test_serving.py)
        "serving": {"enabled": False},
    }
    config.update(overrides)
    return config


TINY_TEXT = " ".join(
    [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "wizards",
        "quietly",
        "box",
        "a",
        "jovial",
        "sphinx",
        "of",
        "black",
        "quartz",
        "and",
        "judge",
        "my",
        "vow",
    ]
    * 6
)


def tiny_text(root: Path, **overrides: Any) -> dict[str, Any]:
    """A short text written in the workspace ``root`` and the ``text`` config that scores
    it: 3 windows of 32 tokens, 64 logits kept per position."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "text.txt").write_text(TINY_TEXT)
    return {
        "enabled": True,
        "file": "text.txt",
        "sha256": hashlib.sha256(TINY_TEXT.encode()).hexdigest(),
        "n_ctx": 32,
        "windows": 3,
        "top_k": 64,
        **overrides,
    }


def in_child(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` in a fresh Python process, its result pickled back: a crash of
    llama.cpp's native code there fails one test, never the whole test session. The function
    must be importable by its module's name (a test module here, or a package)."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.pickle"
        code = (
            f"import pickle, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from {function.__module__} import {function.__name__} as function; "
            f"result = function(*pickle.loads({pickle.dumps(args)!r})); "
            f"open({str(result)!r}, 'wb').write(pickle.dumps(result))"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0, (
            f"{function.__name__} failed in its child process ({proc.returncode}): "
            f"{proc.stderr[-2000:]}"
        )
        value: T = pickle.loads(result.read_bytes())
        return value


def quantize_in_child(src: Path, dst: Path, target: str) -> None:
    """llama_model_quantize in a child process, as the workflow runs it (``in_child``)."""
    code = in_child(quantize, src, dst, target, 1)
    assert code == 0, f"llama_model_quantize to {target} returned {code}"


def captured_models(folder: Path, files_tsv: Path) -> dict[str, Path]:
    """The tiny models that docs/results/cuda-roundings/capture.py made where it captured
    (the H200, lavapipe), made again in ``folder`` from the same seed and quantization;
    their sha256 checked against the capture's ``files.tsv``."""
    source = write_tiny_llama(folder / "f32.gguf", n_embd=256, n_ff=512)
    made = {"f32": source}
    captured = dict(line.split("\t") for line in files_tsv.read_text().splitlines())
    for target in captured:
        if target != "f32":
            made[target] = folder / f"{target}.gguf"
            quantize_in_child(source, made[target], target)
    for target, path in made.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == captured[target], target
    return made


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path / "ws")


# ---- the README's commands, as a user types them ----

SETUP = "./setup && "  # what CI (.ci/run) and the user have run before any other command
CLONE_FILES = ("Snakefile", "workflow", "config", "profiles", "envs")
TEXTS = DEFAULT_TEXT.parent  # the default text's folder, which ./setup fills


def readme_commands() -> list[str]:
    """Every command of the README's ``sh`` blocks, in order, comments dropped."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command:
                commands.append(command)
    return commands


@dataclass
class Clone:
    """A checkout as a user has it after ``./setup``: the workflow's files, a copy, and what
    the set-up made: ``.venv`` and the default text (links to this checkout's). ``shell`` runs a command exactly as written,
    in the environment ``. .venv/bin/activate`` gives (the README's first command leaves
    the user's shell so)."""

    root: Path

    @classmethod
    def of_repo(cls, root: Path) -> Clone:
        root.mkdir(parents=True)
        for name in CLONE_FILES:
            source = REPO / name
            if source.is_dir():
                shutil.copytree(source, root / name)
            else:
                shutil.copy2(source, root / name)
        (root / ".venv").symlink_to(REPO / ".venv")
        (root / TEXTS).parent.mkdir()
        (root / TEXTS).symlink_to(REPO / TEXTS)
        return cls(root)

    def shell(self, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        venv = REPO / ".venv"
        env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{os.environ['PATH']}"}
        proc = subprocess.run(
            ["bash", "-c", command],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=3000,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{command!r} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        return proc


def bigger_llama(folder: Path, quant: str) -> Path:
    """A random llama of 68 M parameters as ``quant``: its float64 weights take 0.5 GiB."""
    f32 = write_tiny_llama(folder / "big-f32.gguf", n_embd=1024, n_layer=4, n_ff=4096)
    quantized = folder / f"big-{quant}.gguf"
    quantize_in_child(f32, quantized, quant)
    f32.unlink()
    return quantized


def processes() -> Iterator[tuple[int, str]]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "cmdline").read_text()
            except OSError:
                continue
