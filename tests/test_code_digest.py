"""The code digest a rule takes as its ``code`` param: which modules it covers, and which
edits change it (a change to what the code does) or leave it (a docstring)."""

import shutil
from pathlib import Path

import pytest

from qdiff import workflow

SCRIPTS = Path(__file__).resolve().parents[1] / "workflow" / "scripts"


@pytest.fixture
def source_copy(tmp_path, monkeypatch):
    """A copy of the qdiff package that the digest reads instead of the real one."""
    root = tmp_path / "qdiff"
    shutil.copytree(workflow._ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(workflow, "_ROOT", root)
    workflow._module_tree.cache_clear()
    yield root
    workflow._module_tree.cache_clear()


def closure(script: str) -> set[str]:
    return workflow._imported_closure(workflow._qdiff_imports(SCRIPTS / script))


def test_report_covers_the_sections_it_loads_by_name():
    # the report imports each stage's section with import_module, which no import names
    modules = closure("render_report.py")
    assert {"qdiff.report.sections.forced", "qdiff.report.sections.localised"} <= modules


def test_a_stage_does_not_cover_the_report():
    modules = closure("combination_stage.py")
    assert "qdiff.engine.worker" in modules
    assert not any(m.startswith("qdiff.report") for m in modules)


def test_docstrings_leave_the_digest_and_code_changes_it(source_copy):
    def digest(script: str) -> str:
        workflow._module_tree.cache_clear()
        return workflow.code_digest(SCRIPTS / script)

    report, stage = digest("render_report.py"), digest("combination_stage.py")
    section = source_copy / "report" / "sections" / "forced.py"
    text = section.read_text()
    section.write_text('"""Another docstring."""\n' + text.split('"""', 2)[2].lstrip("\n"))
    assert digest("render_report.py") == report
    section.write_text(section.read_text() + "\nCHANGED = 1\n")
    assert digest("render_report.py") != report
    # a module the stage never runs leaves the stage's digest as it was
    assert digest("combination_stage.py") == stage
