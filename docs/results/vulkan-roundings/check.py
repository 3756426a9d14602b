"""Holds the float64 engine's Vulkan switches (qdiff.exact.vulkan) against the tensors that
../cuda-roundings/capture.py captured on Mesa's lavapipe (``lavapipe/``, README.md here):
per weight format and prompt length, layer 0's matmuls from llama.cpp's own inputs (the
largest difference relative to the output's largest value, and the share of values equal
bit for bit), plain (float64) and as ``vulkan.linear`` computes them; then the whole tiny
models' first steps against the engine with no switch, with Vulkan's switches, and the
budget's floor (the larger of two jittered emulations), medians over 4 prompts; then the
same with flash attention (``lavapipe-fa/``: its output at the last token, the share of
values at float32's level, and whole first steps in one ubatch and in one-token ubatches);
then, on lavapipe reporting its integer dot products (``lavapipe-int/``), the quantized
matmuls by shader and the whole first steps with the switches of such a device; then,
with an f32 KV cache (``lavapipe-kv32/``), layer 0's attention and whole first steps.
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
    KV32_TARGETS,
    LAVAPIPE,
    LAVAPIPE_FA,
    LAVAPIPE_INT,
    LAVAPIPE_KV32,
    LENGTHS,
    MATMULS,
    QUANTIZED,
    TARGETS,
    VULKAN,
    VULKAN_INT_DOT,
    VULKAN_KV32,
    attention_at_last_token,
    captured_first_steps,
    first_step_figures,
    flash_shares,
    int_dot_figures,
    run_distance,
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
            prompts, run = captured_first_steps(runs, n)
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
                prompts, run = captured_first_steps(runs, n)
                exact, residual, floor = first_step_figures(model, prompts, run, switches)
                print(
                    f"{target:8s} {n_ubatch:6d} {n:3d} {exact:10.2e} {residual:10.2e} {floor:10.2e}"
                )


def int_dot(files: dict[str, Path]) -> None:
    print("\nwith integer dot products (lavapipe-int): layer 0's quantized matmuls by shader,")
    print("largest |Δ| / largest |output| of vulkan.int_dot_linear and of the plain product")
    print(f"{'file':8s} {'n':>3s} {'weights, shader':16s} {'int dot':>9s} {'plain':>9s}")
    for target in QUANTIZED:
        model = ExactModel(files[target])
        for n in LENGTHS:
            for key, (ours, plain) in int_dot_figures(model, target, n).items():
                print(f"{target:8s} {n:3d} {key:16s} {ours:9.1e} {plain:9.1e}")
    print("\nwhole first steps with integer dot products: median over 4 prompts of max |Δ|;")
    print("run-scalar: from the engine with the switches of a device without them")
    print(
        f"{'file':8s} {'n':>3s} {'run-exact':>10s} {'run-emul.':>10s} {'floor':>10s} "
        f"{'run-scalar':>10s}"
    )
    for target in QUANTIZED:
        runs = np.load(LAVAPIPE_INT / f"{target}-logits.npz")
        model = ExactModel(files[target], n_ctx=256)
        model.first_step_only = True
        for n in (3, 5, 12, 40):
            prompts, run = captured_first_steps(runs, n)
            exact, residual, floor = first_step_figures(model, prompts, run, VULKAN_INT_DOT)
            scalar = run_distance(model, prompts, run, VULKAN)
            print(f"{target:8s} {n:3d} {exact:10.2e} {residual:10.2e} {floor:10.2e} {scalar:10.2e}")


def kv32(files: dict[str, Path]) -> None:
    print("\nan f32 KV cache (lavapipe-kv32): layer 0's attention at the last token; K·Q: share")
    print("of scores at float32's level with Q and K in f16, and with K in f32; softmax·V from")
    print("the run's softmax weights, f16 operands: share equal and largest |Δ| / largest |output|")
    print("with float32 sums and with f16 sums (1 token: the plain product, from f32 V and from")
    print("f16 V; K·Q from K in f16 and in f32)")
    print(
        f"{'file':8s} {'context':>7s} {'n':>3s} {'kq f16':>6s} {'kq f32':>6s} "
        f"{'equal':>6s} {'f32 sums':>9s} {'f16 sums':>9s}"
    )
    cases = [(t, "kv32", 256, n) for t in KV32_TARGETS for n in (1, 3, 5, 12, 40)]
    cases += [("f32", "kv32-wide", 1024, 12), ("f32", "kv32-wide", 1024, 300)]
    cases += [("q8_0", "kv32-wide", 1024, 12), ("q8_0", "kv32-wide", 1024, 300)]
    for target, name, context, n in cases:
        model = ExactModel(files[target])
        tensors = np.load(LAVAPIPE_KV32 / f"{target}-{name}-{n}.npz")
        q, k, v, theirs_kq, p, theirs = attention_at_last_token(model, tensors, n)
        k16 = vulkan.f16(k)
        if n == 1:
            shares = [_share(np.einsum("hd,nhd->hn", q[-1], key), theirs_kq) for key in (k16, k)]
            sums = [np.einsum("hn,nhd->hd", p, value) for value in (v, vulkan.f16(v))]
        else:
            q16 = vulkan.f16(q[-1])
            shares = [_share(np.einsum("hd,nhd->hn", q16, k16), theirs_kq)]
            shares.append(_share(np.einsum("hd,nhd->hn", q[-1], k), theirs_kq))
            p16, cells = vulkan.f16(p)[:, None], vulkan.f16(v).transpose(1, 0, 2)
            sums = [vulkan.weighted_sum(p16, cells, f16_sums=f)[:, 0] for f in (False, True)]
        scale = np.abs(theirs).max()
        equal = float(np.mean(sums[0] == theirs))
        errors = [float(np.abs(x - theirs).max() / scale) for x in sums]
        print(
            f"{target:8s} {context:7d} {n:3d} {shares[0]:6.2f} {shares[1]:6.2f} "
            f"{equal:6.3f} {errors[0]:9.1e} {errors[1]:9.1e}"
        )
    print("\nwhole first steps with an f32 KV cache (a context of 256): median over 4 prompts;")
    print("run-f16kv: from the engine with the switches of an f16 cache")
    print(
        f"{'file':8s} {'n':>3s} {'run-exact':>10s} {'run-emul.':>10s} {'floor':>10s} "
        f"{'run-f16kv':>10s}"
    )
    for target in KV32_TARGETS:
        runs = np.load(LAVAPIPE_KV32 / f"{target}-logits-kv32.npz")
        model = ExactModel(files[target], n_ctx=256)
        model.first_step_only = True
        for n in (3, 5, 12, 40):
            prompts, run = captured_first_steps(runs, n)
            exact, residual, floor = first_step_figures(model, prompts, run, VULKAN_KV32)
            f16_cache = run_distance(model, prompts, run, VULKAN)
            print(
                f"{target:8s} {n:3d} {exact:10.2e} {residual:10.2e} {floor:10.2e} {f16_cache:10.2e}"
            )


def _share(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.mean(np.abs(ours - theirs) <= 1e-6 * np.abs(theirs).max()))


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        files = captured_models(Path(folder), LAVAPIPE / "files.tsv")
        matmuls(files)
        first_steps(files)
        flash(files)
        int_dot(files)
        kv32(files)


if __name__ == "__main__":
    main()
