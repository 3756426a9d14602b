"""The unchanged workflow on a real SLURM cluster: Debian's slurmctld, slurmd and munge on this
machine, driven through the shipped profile (profiles/slurm) and the SLURM executor plugin."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, Workspace, tiny_config
from slurmcluster import Cluster, ensure_installed

pytestmark = pytest.mark.slurm
PROFILE = str(REPO / "profiles" / "slurm")
# quicker polling than a production cluster needs; everything else is the shipped profile
FAST = ("--slurm-init-seconds-before-status-checks", "2", "--jobs", "4")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    ensure_installed()
    # the profile's partitions: "cpu" (the default) and "gpu" (this node has no GPU)
    c = Cluster(tmp_path_factory.mktemp("slurm"), ["cpu", "gpu"])
    c.write_config()
    try:
        c.start()
        yield c
    finally:
        c.stop()


def matrix_config(model: Path) -> dict:
    config = tiny_config(model)
    del config["models"]["tiny"]["requantize"]  # one model, 2 CPU devices x (none, f32)
    return config


def test_the_workflow_runs_unchanged_on_slurm(
    cluster: Cluster, tmp_path: Path, tiny_gguf: Path
) -> None:
    local, remote = Workspace(tmp_path / "local"), Workspace(tmp_path / "slurm")
    for ws in (local, remote):
        ws.write_config(matrix_config(tiny_gguf))
    started = time.monotonic()
    local.snakemake()
    local_s = time.monotonic() - started

    planned = remote.planned_jobs_with("--profile", PROFILE, env=cluster.env)
    on_cluster = [j for j in planned if j.rule != "fetch_model"]  # downloads stay local
    started = time.monotonic()
    remote.snakemake("--profile", PROFILE, *FAST, env=cluster.env)
    slurm_s = time.monotonic() - started
    print(
        f"\n[slurm] {len(on_cluster)} jobs through SLURM in {slurm_s:.0f} s; "
        f"the same matrix locally {local_s:.0f} s"
    )

    # SLURM's own record: every cluster job was submitted by sbatch and completed
    jobs = cluster.completed_jobs()
    assert len(jobs) == len(on_cluster), [j.get("Name") for j in jobs]
    assert {j["JobState"] for j in jobs} == {"COMPLETED"}
    assert {j["Partition"] for j in jobs} == {"cpu"}  # no GPU job: never the gpu partition
    assert all(j["WorkDir"] == str(remote.root) for j in jobs)
    assert Counter(j.rule for j in on_cluster)["run_combination"] == 4

    # the same bits as a local run
    for combo in ("cpu/none", "cpu/f32", "cpu-fa/none", "cpu-fa/f32"):
        for rel in (f"runs/tiny/{combo}/logits.npy",):
            a = np.load(local.root / "results" / rel, allow_pickle=False)
            b = np.load(remote.root / "results" / rel, allow_pickle=False)
            assert a.tobytes() == b.tobytes(), rel
        for rel in (f"forced/tiny/{combo}/forced.npz", f"capture/tiny/{combo}/capture.npz"):
            with (
                np.load(local.root / "results" / rel) as a,
                np.load(remote.root / "results" / rel) as b,
            ):
                assert sorted(a.files) == sorted(b.files)
                assert all(a[k].tobytes() == b[k].tobytes() for k in a.files), rel
        tokens = [
            json.loads((ws.root / f"results/runs/tiny/{combo}/record.json").read_text())["prompts"]
            for ws in (local, remote)
        ]
        assert [p["tokens"] for p in tokens[0]] == [p["tokens"] for p in tokens[1]]
    for a, b in zip(local.pairs("tiny"), remote.pairs("tiny"), strict=True):
        assert a["summary"] == b["summary"] and a["forced"]["max_abs"] == b["forced"]["max_abs"]
    # nothing from the submitting machine's paths leaks into the outputs
    summary = (remote.root / "results/summary.md").read_text()
    assert str(remote.root) not in summary

    # a second submission plans nothing and submits nothing
    assert remote.planned_jobs_with("--profile", PROFILE, env=cluster.env) == []
    remote.snakemake("--profile", PROFILE, *FAST, env=cluster.env)
    assert len(cluster.completed_jobs()) == len(jobs)
