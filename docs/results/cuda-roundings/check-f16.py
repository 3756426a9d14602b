"""Whole first steps of the f16 tiny model on the H200 (``h200/f16-logits.npz``, prompts in
one ubatch; ``h200-ub1/f16-logits-ub1.npz``, one token per ubatch), held against the float64
engine with the sources the pipeline plans for such a CUDA device, now that it follows f16
weights (``cuda_f16``). Run here, from the repository's root, with ./setup's .venv:
    .venv/bin/python docs/results/cuda-roundings/check-f16.py > docs/results/cuda-roundings/check-f16.log
Per prompt length: the run against that emulation (residual), the floor (the emulation
against itself with its rounding inputs jittered, two draws, the larger), how many prompts
lie within it, and the run against the exact answer; medians over the prompts."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from capture import make  # noqa: E402  (beside this file)

from qdiff.core.roundings import JITTER_SEEDS, Roundings, sources_of, together  # noqa: E402
from qdiff.core.settings import DeviceSettings  # noqa: E402
from qdiff.exact.model import ExactModel  # noqa: E402

HERE = Path(__file__).parent
CASES = [("h200/f16-logits.npz", 512), ("h200-ub1/f16-logits-ub1.npz", 1)]


def first_steps(model: ExactModel, r: Roundings, prompts: list[list[int]]) -> np.ndarray:
    model.roundings = r
    return model.first_steps(prompts)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        model = ExactModel(make(Path(folder), "f16"))
    model.first_step_only = True
    for name, n_ubatch in CASES:
        runs = np.load(HERE / name)
        settings = DeviceSettings(backend="cuda", n_ubatch=n_ubatch).as_dict()
        planned = together(sources_of(settings, "none"))
        for n in (3, 5, 12, 40):
            keys = [k for k in runs if k.startswith(f"{n}-") and not k.endswith("-tokens")]
            prompts = [list(runs[k + "-tokens"]) for k in keys]
            run = np.array([runs[k] for k in keys], dtype=np.float64)
            made = first_steps(model, planned, prompts)
            residual = np.abs(run - made).max(axis=1)
            jittered = [
                first_steps(model, dataclasses.replace(planned, jitter=seed), prompts)
                for seed in JITTER_SEEDS
            ]
            floor = np.max([np.abs(j - made).max(axis=1) for j in jittered], axis=0)
            exact = first_steps(model, Roundings(), prompts)
            print(
                f"{name} n_ubatch {n_ubatch}, {n} tokens: residual {np.median(residual):.2g}, "
                f"floor {np.median(floor):.2g}, within it {int((residual <= floor).sum())} of "
                f"{len(keys)}; from exact {np.median(np.abs(run - exact).max(axis=1)):.2g}"
            )


if __name__ == "__main__":
    main()
