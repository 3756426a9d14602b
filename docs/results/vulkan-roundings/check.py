"""Holds the float64 engine's Vulkan switches (qdiff.exact.vulkan) against the tensors that
../cuda-roundings/capture.py captured on Mesa's lavapipe (``lavapipe/``, README.md here):
per weight format and prompt length, layer 0's matmuls from llama.cpp's own inputs (the
largest difference relative to the output's largest value, and the share of values equal
bit for bit), plain (float64) and as ``vulkan.linear`` computes them; then the whole tiny
models' first steps against the engine with no switch, with Vulkan's switches, and the
budget's floor (the larger of two jittered emulations), medians over 4 prompts; then the
same with flash attention (``lavapipe-fa/``: its output at the last token, the share of
values at float32's level, and whole first steps in one ubatch and in one-token ubatches).
Run from the repository's root:
    .venv/bin/python docs/results/vulkan-roundings/check.py > docs/results/vulkan-roundings/check.log
The tiny models are made again from the same seed and checked against files.tsv."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests")]

from conftest import captured_models  # noqa: E402
from qdiff.core.roundings import Roundings  # noqa: E402
from qdiff.exact import vulkan  # noqa: E402
from qdiff.exact.model import ExactModel  # noqa: E402
from test_vulkan_kernels import (  # noqa: E402
    FLASH_LENGTHS,
    LAVAPIPE,
    LAVAPIPE_FA,
    LENGTHS,
    MATMULS,
    STARTS,
    TARGETS,
    first_step_figures,
    flash_shares,
)


def matmuls(files: dict[str, Path]) -> None:
    print("layer 0's matmuls: largest |Δ| / largest |output|, share equal bit for bit")
    print(f"{'file':8s} {'n':>3s} {'plain':>9s} {'vulkan':>9s} {'equal':>6s}")
    for target in TARGETS:
        model = ExactModel(files[target])
        for n in LENGTHS:
            tensors = np.load(LAVAPIPE / f"{target}-{n}.npz")
            plain, ours, equal = 0.0, 0.0, []
            for source, output, weight in MATMULS:
                x = tensors[source].reshape(1, -1).astype(np.float64)
                y = tensors[output].reshape(1, -1).astype(np.float64)
                w, kind = model.weights[weight], model.weights.type_of(weight).lower()
                v = vulkan.linear(x, w, n, kind)
                scale = np.abs(y).max()
                plain = max(plain, float(np.abs(x @ w.T - y).max() / scale))
                ours = max(ours, float(np.abs(v - y).max() / scale))
                equal.append(float((v == y).mean()))
            print(f"{target:8s} {n:3d} {plain:9.1e} {ours:9.1e} {min(equal):6.2f}")


def first_steps(files: dict[str, Path]) -> None:
    print("\nwhole first steps: median over 4 prompts of max |Δ| over the vocabulary")
    print(f"{'file':8s} {'n':>3s} {'run-exact':>10s} {'run-emul.':>10s} {'floor':>10s}")
    for target in TARGETS:
        runs = np.load(LAVAPIPE / f"{target}-logits.npz")
        model = ExactModel(files[target], n_ctx=256)
        model.first_step_only = True
        for n in (3, 5, 12, 40):
            prompts = [runs[f"{n}-{s}-tokens"].tolist() for s in STARTS]
            run = np.stack([runs[f"{n}-{s}"] for s in STARTS]).astype(np.float64)
            exact, residual, floor = first_step_figures(model, prompts, run)
            print(f"{target:8s} {n:3d} {exact:10.2e} {residual:10.2e} {floor:10.2e}")


def flash(files: dict[str, Path]) -> None:
    print("\nflash attention at the last token (lavapipe-fa): share of values at float32's level")
    print(f"{'file':8s} {'n':>3s} {'tile':>5s} {'split':>6s} {'vulkan':>7s} {'plain':>6s}")
    for target in TARGETS:
        model = ExactModel(files[target])
        for n in FLASH_LENGTHS:
            ours, plain, (tile, split) = flash_shares(model, target, n)
            print(f"{target:8s} {n:3d} {tile:5d} {split:6d} {ours:7.3f} {plain:6.3f}")
    print("\nwhole first steps with flash attention: median over 4 prompts of max |Δ|")
    print(
        f"{'file':8s} {'ubatch':>6s} {'n':>3s} {'run-exact':>10s} {'run-emul.':>10s} {'floor':>10s}"
    )
    for target in TARGETS:
        model = ExactModel(files[target], n_ctx=256)
        model.first_step_only = True
        for name, n_ubatch in (("fa", 512), ("fa-ub1", 1)):
            runs = np.load(LAVAPIPE_FA / f"{target}-logits-{name}.npz")
            switches = Roundings(
                vulkan_matmul=True, kv_f16=True, vulkan_flash=True, n_ubatch=n_ubatch
            )
            for n in (3, 5, 12, 40):
                prompts = [runs[f"{n}-{s}-tokens"].tolist() for s in STARTS]
                run = np.stack([runs[f"{n}-{s}"] for s in STARTS]).astype(np.float64)
                exact, residual, floor = first_step_figures(model, prompts, run, switches)
                print(
                    f"{target:8s} {n_ubatch:6d} {n:3d} {exact:10.2e} {residual:10.2e} {floor:10.2e}"
                )


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        files = captured_models(Path(folder), LAVAPIPE / "files.tsv")
        matmuls(files)
        first_steps(files)
        flash(files)


if __name__ == "__main__":
    main()
