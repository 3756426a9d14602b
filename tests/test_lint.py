"""The workflow passes Snakemake's linter and snakefmt, as the project requires."""

import subprocess
import sys

from conftest import REPO


def test_snakemake_lint_is_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint", "--snakefile", str(REPO / "Snakefile"),
         "--directory", str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_snakefmt_is_clean() -> None:
    files = [REPO / "Snakefile", *sorted((REPO / "workflow/rules").glob("*.smk"))]
    proc = subprocess.run(
        [sys.executable, "-m", "snakefmt", "--check", *map(str, files)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
