"""What Snakemake's ``benchmark:`` sampler costs the llama.cpp inference it watches.

    .venv/bin/python docs/results/bench-epyc/sampler_ab.py DIR MODEL DEVICE DEQUANT [TIMES]

DIR is a workflow directory whose model files are made (``bench.py --workdir W`` leaves
``W/runs-only``). One process loads the combination's model once and decodes its first 4
prompts ``TIMES`` times (default 40). Every other time, a second process samples this one
twice a second as Snakemake's ``BenchmarkTimer`` does (``cpu_percent``,
``memory_full_info``, ``io_counters`` of the process and its children). It prints the
median time unsampled and sampled, and the median of the pairs' ratios.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

SAMPLE_FLAG = Path("/tmp/qdiff-sampler-on")
SAMPLER = """
import os, sys, time, psutil
watched = psutil.Process(int(sys.argv[1]))
while watched.is_running():
    if os.path.exists(sys.argv[2]):
        for proc in [watched, *watched.children(recursive=True)]:
            with proc.oneshot():
                proc.cpu_percent(); proc.memory_full_info(); proc.io_counters()
    time.sleep(0.5)
"""


def main(workdir: Path, model: str, device: str, dequant: str, times: int) -> None:
    os.chdir(workdir)  # the config's model paths are relative to it
    from qdiff.config import model_file, validate
    from qdiff.settings import DeviceSettings
    from qdiff.stages import RUN

    from qdiff import engine
    from qdiff.engine.model import LoadedModel

    experiment, _ = validate(yaml.safe_load(Path("config/config.yaml").read_text()), Path.cwd())
    (combo,) = [
        c
        for c in experiment.all_combinations()
        if (c.model, c.device, c.dequant) == (model, device, dequant)
    ]
    spec = experiment.spec(RUN, combo)
    generation = spec["generation"]
    log = engine.init_backend(workdir / "sampler-ab-errors.txt")  # kept: llama.cpp calls it
    SAMPLE_FLAG.unlink(missing_ok=True)
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, str(os.getpid()), str(SAMPLE_FLAG)])
    seconds: dict[bool, list[float]] = {False: [], True: []}
    settings = DeviceSettings.from_config(spec["settings"])
    try:
        with LoadedModel(Path(model_file(model, dequant)), settings, generation["n_ctx"]) as m:
            prompts = [
                m.prompt_tokens(p["text"], generation["chat_template"]) for p in spec["prompts"]
            ][:4]
            for i in range(times):
                sampled = i % 2 == 1
                if sampled:
                    SAMPLE_FLAG.touch()
                else:
                    SAMPLE_FLAG.unlink(missing_ok=True)
                time.sleep(0.05)
                start = time.perf_counter()
                for tokens in prompts:
                    m.generate(tokens, generation["n_tokens"])
                seconds[sampled].append(time.perf_counter() - start)
    finally:
        SAMPLE_FLAG.unlink(missing_ok=True)
        sampler.kill()
    del log
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    pairs = statistics.median(b / a for a, b in zip(seconds[False], seconds[True], strict=False))
    print(
        f"{model} {device} {dequant}: unsampled {off:.3f} s, sampled {on:.3f} s "
        f"(median over median {on / off:.4f}; median of the pairs {pairs:.4f})"
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (4, 5):
        sys.exit(__doc__)
    main(Path(args[0]).resolve(), *args[1:4], int(args[4]) if len(args) == 5 else 40)
