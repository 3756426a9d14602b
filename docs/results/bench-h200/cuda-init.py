"""How long a worker of a CUDA build takes to import llama-cpp-python and list the backend
devices (``qdiff.engine.init_backend`` and ``qdiff.engine.devices.backend_devices``, as every
worker does before loading its model), with the GPUs visible and with them hidden through
``CUDA_VISIBLE_DEVICES=``. Each measurement is a fresh process; the two alternate.

    python3 docs/results/bench-h200/cuda-init.py [ALTERNATIONS]   # default 5
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from statistics import median

CHILD = """
import json, time
start = time.perf_counter()
from qdiff import engine
from qdiff.engine.devices import backend_devices
imported = time.perf_counter()
log = engine.init_backend()  # kept alive: llama.cpp calls back into it
devices = [d.name for d in backend_devices()]
listed = time.perf_counter()
print(json.dumps({"imports": imported - start, "init_and_list": listed - imported,
                  "devices": devices}))
"""


def sample(hidden: bool) -> dict:
    env = dict(os.environ)
    if hidden:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.splitlines()[-1])
    result["process"] = time.perf_counter() - start
    return result


def main() -> None:
    alternations = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    results: dict[str, list[dict]] = {"visible": [], "hidden": []}
    for _ in range(alternations):
        for name, runs in results.items():
            r = sample(name == "hidden")
            runs.append(r)
            print(
                f"{name:8s} process {r['process']:.3f} s, imports {r['imports']:.3f} s, "
                f"init + list {r['init_and_list']:.3f} s, devices {r['devices']}",
                flush=True,
            )
    for name, runs in results.items():
        print(
            f"{name}: medians process {median(r['process'] for r in runs):.3f} s, "
            f"init + list {median(r['init_and_list'] for r in runs):.3f} s"
        )


if __name__ == "__main__":
    main()
