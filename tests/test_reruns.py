"""Reruns follow content across failures and re-made files: a failure that is fixed is paid
for once, and a model file made again, byte for byte, costs no job its inference (the real
workflow, a real HTTP server on 127.0.0.1, tiny real models)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from conftest import Workspace, tiny_config
from modelserver import serving

pytestmark = pytest.mark.workflow


def by_rule(ws: Workspace) -> Counter:
    return Counter(j.rule for j in ws.planned_jobs())


def status(ws: Workspace, path: str) -> str:
    return str(json.loads((ws.root / path).read_text())["status"])


def test_a_fixed_failure_is_paid_for_once(workspace: Workspace, tiny_gguf: Path) -> None:
    """A download that failed (404) and runs that timed out: once the server and the
    timeout are fixed, the next invocation retries them and what depends on them, and the
    one after plans nothing."""
    payload = tiny_gguf.read_bytes()
    with serving(payload) as server:
        server.gone.add("/later.gguf")
        config = tiny_config(tiny_gguf, dequant=["none"], run_timeout_s=0.01)
        config["models"] = {
            "local": {"path": str(tiny_gguf)},
            "served": {
                "url": f"{server.base}/later.gguf",
                "sha256": hashlib.sha256(payload).hexdigest(),
            },
        }
        workspace.write_config(config)
        workspace.snakemake()
        assert status(workspace, "resources/models/served.gguf.json") == "failed"
        assert json.loads((workspace.root / "results/runs/local/cpu/none/record.json").read_text())[
            "error"
        ]["kind"] == ("timeout")
        server.gone.clear()
        config["run_timeout_s"] = 600  # not a param: the failed records' tokens rerun them
        workspace.write_config(config)
        retried = by_rule(workspace)
        assert retried["fetch_model"] == 1 and retried["run_combination"] == 4
        workspace.snakemake()
    assert status(workspace, "resources/models/served.gguf.json") == "ok"
    for model in ("local", "served"):
        for device in ("cpu", "cpu-fa"):
            assert status(workspace, f"results/runs/{model}/{device}/none/record.json") == "ok"
    assert by_rule(workspace) == Counter()  # nothing twice
    assert "Nothing to be done" in workspace.snakemake("--dry-run").stdout


def test_models_made_again_cost_no_inference(workspace: Workspace, tiny_gguf: Path) -> None:
    """resources/ deleted, then a device added: the models are made again, byte for byte,
    and Snakemake runs every job downstream of them, but each job whose inputs and params
    are those its outputs were made of keeps them; only the new device's jobs compute."""
    workspace.write_config(tiny_config(tiny_gguf))
    workspace.snakemake()
    records = {p: p.read_bytes() for p in (workspace.root / "results").rglob("record.json")}
    shutil.rmtree(workspace.root / "resources")
    config = workspace.read_config()
    config["devices"]["extra"] = {"backend": "cpu", "threads": 1, "n_batch": 64}
    workspace.write_config(config)
    out = workspace.snakemake()
    said = out.stdout + out.stderr
    # 2 models x 2 devices x 2 files x 3 stages, 2 exact references and their 2 emulations
    # (the new device rounds as `cpu` does: the same sets of switches)
    assert said.count("kept its outputs") == 28, said[-3000:]
    assert all(p.read_bytes() == content for p, content in records.items())
    assert status(workspace, "results/runs/tiny/extra/f32/record.json") == "ok"
    assert "Nothing to be done" in workspace.snakemake("--dry-run").stdout
