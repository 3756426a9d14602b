"""The workflow and the library pass their linters, formatters, type checker and layers
contract, as the project requires (configured in pyproject.toml); and no function is longer
than a reader can hold."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PYTHON = ["src", "tests", "workflow/scripts", "benchmarks", "docs"]
SNAKEMAKE_FILES = [
    REPO / "Snakefile",
    REPO / "workflow/Snakefile",
    *sorted((REPO / "workflow/rules").glob("*.smk")),
]
MAX_FUNCTION_LINES = 60  # beside ruff's complexity, branch and statement limits


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(
            [
                "-m",
                "snakemake",
                "--lint",
                "--snakefile",
                str(REPO / "Snakefile"),
                "--directory",
                str(REPO),
            ],
            id="snakemake-lint",
        ),
        pytest.param(["-m", "snakefmt", "--check", *map(str, SNAKEMAKE_FILES)], id="snakefmt"),
        pytest.param(["-m", "ruff", "check", *PYTHON], id="ruff-check"),
        pytest.param(["-m", "ruff", "format", "--check", *PYTHON], id="ruff-format"),
        pytest.param(["-m", "mypy"], id="mypy"),
        # the layers of qdiff (docs/architecture.md), as import-linter's contract states them
        pytest.param(
            ["-c", "from importlinter.cli import lint_imports_command as c; c()"],
            id="import-linter",
        ),
    ],
)
def test_clean(command: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_function_is_longer_than_a_reader_can_hold() -> None:
    long = []
    for folder in PYTHON:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines > MAX_FUNCTION_LINES:
                        long.append(
                            f"{Path(path).relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines"
                        )
    assert long == []
