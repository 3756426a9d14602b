"""The README as a user reads and types it: at most 300 lines, its set-up and test commands
what CI runs, and every other command run exactly as written, in a checkout set up as
./setup leaves it, on a small experiment of tiny real models."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import REPO, SETUP, Clone, readme_commands, tiny_config

pytestmark = pytest.mark.workflow
QUICK_START = f"{SETUP}. .venv/bin/activate && snakemake --cores 4"
TESTS = f"{SETUP}.venv/bin/python -m pytest"


def test_the_readme_is_short_and_its_two_set_up_commands_are_what_ci_runs() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 300
    commands = readme_commands()
    assert [c for c in commands if c.startswith("./setup")] == [QUICK_START, TESTS]
    assert TESTS in (REPO / ".ci/run").read_text()  # CI runs the README's test command


def test_every_readme_command_runs_as_written(tmp_path: Path, tiny_gguf: Path) -> None:
    """After the set-up, each command in the README's order: the quick start's run, a dry
    run, the report pages, an unlock; each must succeed, and do what the README says."""
    clone = Clone.of_repo(tmp_path / "qdiff")
    config = tiny_config(tiny_gguf, dequant=["none"], capture={"enabled": False})
    (clone.root / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    said = {}
    for written in readme_commands():
        if written == TESTS:
            continue  # CI runs it, and it runs this test
        command = written.removeprefix(SETUP)  # the set-up itself is CI's first step
        proc = clone.shell(command)
        said[command] = proc.stdout + proc.stderr
    assert (clone.root / "results/summary.md").is_file()
    assert "Nothing to be done" in said["snakemake -n"]
    assert "Nothing to be done" in said["snakemake --cores 4"]  # and again: nothing
    assert "1. Summary" in (clone.root / "report.html").read_text()
    with zipfile.ZipFile(clone.root / "report.zip") as z:
        assert any(n.endswith("summary.html") for n in z.namelist())
    assert set(said) == {
        ". .venv/bin/activate && snakemake --cores 4",
        "snakemake -n",
        "snakemake --cores 4",
        "snakemake --report report.html",
        "snakemake --report report.zip",
        "snakemake --unlock",
    }, "a command was added to the README: say here what it must do"
