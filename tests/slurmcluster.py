"""A real single-node SLURM cluster on this machine, for tests: Debian's slurmctld, slurmd and
munge, with every file (config, key, sockets, state, logs) under one temporary directory, and
Snakemake's SLURM executor in this Python environment (qdiff's `slurm` extra, which ./setup
adds only where `sbatch` is found).

Needs root (the daemons and apt-get); CI runs as root.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
TOOLS = ["slurmctld", "slurmd", "munged", "sbatch", "squeue", "srun", "scontrol"]


REPO = Path(__file__).resolve().parents[1]


def ensure_plugin() -> None:
    """Install qdiff's `slurm` extra (pyproject.toml) into this environment; pip does nothing
    where it is there already."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["optional-dependencies"]["slurm"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *requirements], check=True)


def ensure_installed() -> None:
    """Install SLURM and munge from Debian's packages, and Snakemake's SLURM executor, unless
    they are there already."""
    ensure_plugin()
    if all(shutil.which(t) for t in TOOLS):
        return
    if os.geteuid() != 0:
        raise RuntimeError("installing SLURM needs root: apt-get install " + " ".join(PACKAGES))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", *PACKAGES], check=True, env=env, capture_output=True
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SYSTEM_CONF = Path("/etc/slurm/slurm.conf")


@dataclass
class Cluster:
    """The config goes to /etc/slurm/slurm.conf, where every SLURM command looks, jobs'
    own srun calls included (SLURM_CONF does not reach them); a file already there is
    put back by stop()."""

    root: Path
    partitions: list[str]
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return SYSTEM_CONF

    @property
    def saved_conf(self) -> Path:
        return self.root / "slurm.conf.saved"

    @property
    def jobcomp(self) -> Path:
        """SLURM's own record of every finished job (jobcomp/filetxt)."""
        return self.root / "jobcomp.log"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        r = self.root
        for d in ("state", "spool"):
            (r / d).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=qdifftest",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={r / 'munge.socket'}",
            "CredType=cred/munge",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "ReturnToService=2",
            # no accounting database: finished jobs stay visible to squeue this long, and
            # the job-completion log is SLURM's own record of every job
            "MinJobAge=600",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp}",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
        ]
        for i, name in enumerate(self.partitions):
            default = "YES" if i == 0 else "NO"
            lines.append(
                f"PartitionName={name} Nodes=ALL Default={default} MaxTime=INFINITE State=UP"
            )
        if SYSTEM_CONF.exists() and not self.saved_conf.exists():
            shutil.copy2(SYSTEM_CONF, self.saved_conf)
        SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SYSTEM_CONF.write_text("\n".join(lines) + "\n")
        shutil.copy2(SYSTEM_CONF, self.root / "slurm.conf")  # kept with the logs

    def start(self) -> None:
        r = self.root
        key = r / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={r / 'munge.socket'}",
                f"--pid-file={r / 'munged.pid'}",
                f"--log-file={r / 'munged.log'}",
                f"--seed-file={r / 'munged.seed'}",
            ]
        )
        self._wait_for((r / "munge.socket").exists, "munged")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait_for(lambda: self._ok(["scontrol", "ping"], "UP"), "slurmctld")
        self._spawn(["slurmd", "-D", "-f", str(self.conf)])
        self._wait_for(lambda: self._ok(["sinfo", "-h", "-o", "%T"], "idle"), "slurmd")

    def _spawn(self, cmd: list[str]) -> None:
        log = (self.root / f"{Path(cmd[0]).name}.out").open("w")
        self.processes.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        )

    def _ok(self, cmd: list[str], expected: str) -> bool:
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        return expected in out.stdout

    def _wait_for(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p for p in self.processes if p.poll() is not None]
            if dead:
                break
            time.sleep(0.5)
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log"))
        )
        raise RuntimeError(f"{what} did not come up:\n{logs}")

    def completed_jobs(self) -> list[dict[str, str]]:
        """The job-completion log: one dict of SLURM's fields per finished job."""
        if not self.jobcomp.exists():
            return []
        jobs = []
        for line in self.jobcomp.read_text().splitlines():
            fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            jobs.append(fields)
        return jobs

    def stop(self) -> None:
        for p in reversed(self.processes):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self.saved_conf.exists():
            shutil.copy2(self.saved_conf, SYSTEM_CONF)
        else:
            SYSTEM_CONF.unlink(missing_ok=True)
