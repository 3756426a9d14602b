"""Flash attention on the H200 (``h200-fa/``, capture.py's ``fa``), held against the float64
engine: run here, from the repository's root, with ./setup's .venv:
    .venv/bin/python docs/results/cuda-roundings/check-fa.py > docs/results/cuda-roundings/check-fa.log
For each tiny model and prompt of 1-300 tokens (one ubatch): the share of flash attention's
output at the last token (layer 0) equal to the run's to float32's level, as plain
attention over the f16 K and V (the VEC kernel's float32) and as the MMA_F16 kernel's
arithmetic; then whole first steps (median over 4 prompts of max |Δ| between the H200's
logits and the planned emulation, with and without ``cuda_flash``), in one ubatch and in
one-token ubatches."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from capture import FA_LAYER0, FIRST_STEPS, make  # noqa: E402  (beside this file)

from qdiff.core.roundings import sources_of, together  # noqa: E402
from qdiff.core.settings import DeviceSettings  # noqa: E402
from qdiff.exact.model import ExactModel  # noqa: E402
from test_cuda_kernels import (  # noqa: E402
    H200_FA,
    _first_step_residual,
    _flash_kernel_of,
    _flash_shares,
)

TARGETS = ["f32", "q8_0", "q4_k_m"]


def first_steps(model: ExactModel, target: str) -> None:
    model.first_step_only = True
    for name, n_ubatch in (("fa", 512), ("fa-ub1", 1)):
        runs = np.load(H200_FA / f"{target}-logits-{name}.npz")
        settings = DeviceSettings(backend="cuda", flash_attn=True, n_ubatch=n_ubatch)
        planned = together(sources_of(settings.as_dict(), "none"))
        for n in FIRST_STEPS:
            line = [
                f"{_first_step_residual(model, runs, n, dataclasses.replace(planned, cuda_flash=on)):.2g}"
                for on in (True, False)
            ]
            print(
                f"{target:7s} n_ubatch {n_ubatch:3d}, {n:3d} tokens, first steps: with "
                f"cuda_flash {line[0]}, without {line[1]}"
            )


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        for target in TARGETS:
            model = ExactModel(make(Path(folder), target))
            for n in FA_LAYER0:
                plain, mma = _flash_shares(model, target, n)
                kernel = _flash_kernel_of(model, n)
                print(f"{target:7s} {n:3d} tokens ({kernel}): plain {plain:.2f}, MMA_F16 {mma:.2f}")
            first_steps(model, target)


if __name__ == "__main__":
    main()
