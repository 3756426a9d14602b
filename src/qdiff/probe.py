"""Which backends this llama-cpp-python build can use here, asked before any job runs.

``python -m qdiff.probe`` prints the ggml backend devices as JSON. The Snakefile runs it in
a child process (it must never load native code itself) when ``strict_devices`` is on, so
that a missing backend stops the workflow before the first job, with the reason on the
console.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from qdiff.config import ConfigError, Experiment


def probe_devices() -> list[dict[str, Any]]:
    """The ggml backend devices of the installed build (in a child process)."""
    proc = subprocess.run(
        [sys.executable, "-m", "qdiff.probe"], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise ConfigError(
            [
                "strict_devices: could not ask llama-cpp-python for its backends "
                f"(exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:] or ''}"
            ]
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_strict_devices(
    experiment: Experiment, devices: list[dict[str, Any]] | None = None
) -> None:
    """Raise ConfigError naming every device whose backend this build cannot use here."""
    from qdiff.backends import BACKENDS

    devices = probe_devices() if devices is None else devices
    found = ", ".join(f"{d['name']} ({d['registry']})" for d in devices) or "none"
    problems = []
    for name, settings in experiment.devices.items():
        backend = BACKENDS[settings.backend]
        if not any(
            d["registry"] in backend.registries and d["kind"] in backend.device_kinds
            for d in devices
        ):
            problems.append(
                f"config.devices.{name}: strict_devices is on and this llama-cpp-python build "
                f"cannot use the {settings.backend} backend on this machine (backend devices "
                f"found: {found}). Build it with QDIFF_BACKEND={settings.backend} ./setup, "
                "remove the device, or set strict_devices: false to leave it out"
            )
    if problems:
        raise ConfigError(problems)


def main() -> int:
    from qdiff import engine
    from qdiff.engine.devices import backend_devices

    engine.init_backend()
    print(json.dumps([d.as_record() for d in backend_devices()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
