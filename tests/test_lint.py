"""The workflow and the library pass their linters, formatters and type checker, as the
project requires (configured in pyproject.toml)."""

import subprocess
import sys

import pytest

from conftest import REPO

PYTHON = ["src", "tests", "workflow/scripts", "docs"]
SNAKEMAKE_FILES = [
    REPO / "Snakefile",
    REPO / "workflow/Snakefile",
    *sorted((REPO / "workflow/rules").glob("*.smk")),
]


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(
            [
                "snakemake",
                "--lint",
                "--snakefile",
                str(REPO / "Snakefile"),
                "--directory",
                str(REPO),
            ],
            id="snakemake-lint",
        ),
        pytest.param(["snakefmt", "--check", *map(str, SNAKEMAKE_FILES)], id="snakefmt"),
        pytest.param(["ruff", "check", *PYTHON], id="ruff-check"),
        pytest.param(["ruff", "format", "--check", *PYTHON], id="ruff-format"),
        pytest.param(["mypy"], id="mypy"),
    ],
)
def test_clean(command: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", *command], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
