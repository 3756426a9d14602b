"""Which backends this llama-cpp-python build can use here, asked before any job runs.

``python -m qdiff.engine.probe`` prints the ggml backend devices as JSON. The Snakefile runs it in
a child process (it must never load native code itself) when ``strict_devices`` is on, so
that a missing backend stops the workflow before the first job, with the reason on the
console.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from qdiff.core import secrets
from qdiff.core.config import ConfigError, Experiment


def probe_devices(env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The ggml backend devices of the installed build (in a child process), as a job with
    these settings in its environment sees them (e.g. ``GGML_VK_VISIBLE_DEVICES``, without
    which llama.cpp skips a CPU-type Vulkan device)."""
    proc = subprocess.run(
        [sys.executable, "-m", "qdiff.engine.probe"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
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
    experiment: Experiment,
    probe: Callable[[Mapping[str, str]], list[dict[str, Any]]] = probe_devices,
) -> None:
    """Raise ConfigError naming every device whose backend this build cannot use here,
    probed once per distinct set of the numerics settings the devices put in their env
    (hidden values are never passed: they cannot change which devices exist)."""
    from qdiff.core.backends import BACKENDS

    probed: dict[tuple[tuple[str, str], ...], list[dict[str, Any]]] = {}
    problems = []
    for name, settings in experiment.devices.items():
        shown = tuple((k, v) for k, v in settings.env.items() if secrets.is_setting(k))
        if shown not in probed:
            probed[shown] = probe(dict(shown))
        devices = probed[shown]
        found = ", ".join(f"{d['name']} ({d['registry']})" for d in devices) or "none"
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
    from qdiff.engine.devices import backend_devices
    from qdiff.engine.log import init_backend

    init_backend()
    print(json.dumps([d.as_record() for d in backend_devices()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
