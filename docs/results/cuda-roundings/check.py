"""Holds the float64 engine's CUDA matmuls (qdiff.exact.cuda) against the tensors that
capture.py captured on the H200: each matmul of layer 0, from llama.cpp's own captured
input, computed four ways, against llama.cpp's captured output:
  plain  x @ Wᵀ in float64 (no rounding at all)
  cpu    the CPU's activation rounding (qdiff.exact.roundings)
  mmvq   CUDA's MMVQ (1-8 tokens on an H200)
  mmq    CUDA's MMQ (9 tokens or more)
  tf32t  f32 and f16 weights: both operands cut to TF32's 10 mantissa bits (truncated)
  tf32r  the same, rounded to nearest (ties to even)
  tf32a  the same, ties away from zero (as cvt.rna.tf32.f32)
  x16    the activations rounded to f16 (f16 weights' MMF and cuBLAS paths)
  run16  f16 weights: the activations in f16, runs of 16 products added to an f16
         accumulator (cuBLAS's f16 compute, cuda.cublas_f16_weighted_sum)
and prints the largest difference relative to the output's largest value, per weight type
and prompt length. An emulation that follows the kernel is at float32's level (about 1e-7);
one that does not, at the rounding's own (1e-4 or more). Then the whole tiny models' first
steps against the engine (whole_models). Run here, from the repository's root, on the
captures' folder:
    .venv/bin/python docs/results/cuda-roundings/check.py docs/results/cuda-roundings/h200
and, with ``attention`` after it, only the f16 file's one-token matmuls (``f16_one_token``),
layer 0's attention in one-token ubatches (``attention_ub1``, on h200-ub1 beside it) and
its softmax·V of 40 tokens in one ubatch (``attention_cublas``).
The tiny models are made again from the same seed and checked against files.tsv."""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "docs/results/cuda-roundings"), str(ROOT / "tests")]

from capture import FIRST_STEPS, LENGTHS, STARTS, TARGETS, UB1_LAYER0, UB1_STEPS, make  # noqa: E402

from qdiff.core.backends import CPU_VEC_DOT_TYPE  # noqa: E402
from qdiff.exact import cuda  # noqa: E402
from qdiff.exact.model import ExactModel  # noqa: E402
from qdiff.exact.roundings import q8_1_sum_error, round_activations  # noqa: E402

# matmuls of layer 0: (its input, its output, the weight)
MATMULS = [
    ("attn_norm-0", "Qcur-0", "blk.0.attn_q.weight"),
    ("attn_norm-0", "Kcur-0", "blk.0.attn_k.weight"),
    ("attn_norm-0", "Vcur-0", "blk.0.attn_v.weight"),
    ("kqv_out-0", "attn_out-0", "blk.0.attn_output.weight"),
    ("ffn_norm-0", "ffn_gate-0", "blk.0.ffn_gate.weight"),
    ("ffn_norm-0", "ffn_up-0", "blk.0.ffn_up.weight"),
    ("ffn_swiglu-0", "ffn_out-0", "blk.0.ffn_down.weight"),
]


def tf32_away(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32, ties away from zero."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64) + 0x1000
    return (bits & 0xFFFFE000).astype(np.uint32).view(np.float32).astype(np.float64)


def ways(model: ExactModel, x: np.ndarray, weight: str) -> dict[str, np.ndarray]:
    w = model.weights
    kind = w.type_of(weight).lower()
    out = {"plain": x @ w[weight].T}
    if kind in CPU_VEC_DOT_TYPE:
        cpu = round_activations(x, kind) @ w[weight].T
        if CPU_VEC_DOT_TYPE[kind] == "q8_1":
            cpu += q8_1_sum_error(x) @ w.block_minimums(weight).T
        out["cpu"] = cpu
    if kind in ("f32", "f16"):
        for name, nearest in (("tf32t", False), ("tf32r", True)):
            out[name] = cuda.tf32(x, nearest) @ cuda.tf32(w[weight], nearest).T
        out["tf32a"] = tf32_away(x) @ tf32_away(w[weight]).T
        out["x16"] = x.astype(np.float16).astype(np.float64) @ w[weight].T
        # cuBLAS's f16 compute: runs of 16 products added to an f16 accumulator
        out["run16"] = cuda.cublas_f16_weighted_sum(x[None], w[weight].T[None])[0]
    if kind in cuda.EMULATED:
        for kernel in ("mmvq", "mmq"):
            out[kernel] = cuda.linear(x, w, weight, kernel)
    return out


def whole_models(captures: Path, folder: Path, n_ubatch: int = 512) -> None:
    """Each file's first steps on CUDA (capture.py's FIRST_STEPS prompts; with ``n_ubatch``
    1, its UB1_STEPS in one-token ubatches) against the engine: exact; with CUDA's matmul
    roundings and the f16 K/V alone (``matmuls``); with every CUDA source the pipeline
    plans for such a device (``all``: attention's kernels too, qdiff.core.roundings), and
    that with its inputs jittered twice (the floor, qdiff.compare.budget). Prints per prompt
    length the median over prompts of run - exact, of the residuals run - matmuls and
    run - all, and of the floor (first-step max |Δ|), the largest residual of ``all``, and
    the prompts whose ``all`` residual is within the floor (or within 1e-5, float32's
    level for these logits)."""
    from qdiff.core.roundings import JITTER_SEEDS, Roundings, sources_of, together
    from qdiff.core.settings import DeviceSettings

    suffix = "-ub1" if n_ubatch == 1 else ""
    lengths = UB1_STEPS if n_ubatch == 1 else FIRST_STEPS
    every = together(
        sources_of(DeviceSettings(backend="cuda", n_ubatch=n_ubatch).as_dict(), "none")
    )
    matmuls = Roundings(cuda_activations=True, cuda_tf32=True, kv_f16=True, n_ubatch=n_ubatch)
    print(
        f"\nn_ubatch {n_ubatch}\n{'file':8} {'n':>3} {'from exact':>10} {'matmuls':>10} "
        f"{'all':>10} {'floor':>10} {'all/floor':>9} {'max resid':>10} within"
    )
    for target in TARGETS:
        if target == "f16" or not (captures / f"{target}-logits{suffix}.npz").exists():
            continue  # f16 weights: CUDA's kernels for them are not followed
        runs = np.load(captures / f"{target}-logits{suffix}.npz")
        model = ExactModel(make(folder, target))
        model.first_step_only = True
        for n in lengths:
            keys = [f"{n}-{start}" for start in STARTS]
            prompts = [list(runs[k + "-tokens"]) for k in keys]
            run = np.array([runs[k] for k in keys], dtype=np.float64)
            jittered = [(f"j{s}", dataclasses.replace(every, jitter=s)) for s in JITTER_SEEDS]
            made = {}
            for name, r in [
                ("exact", Roundings()),
                ("matmuls", matmuls),
                ("all", every),
                *jittered,
            ]:
                model.roundings = r
                made[name] = model.first_steps(prompts)
            dist = {k: np.abs(run - made[k]).max(axis=1) for k in ("exact", "matmuls", "all")}
            floor = np.max(
                [np.abs(made[f"j{s}"] - made["all"]).max(axis=1) for s in JITTER_SEEDS], axis=0
            )
            residual = dist["all"]
            print(
                f"{target:8} {n:3d} {np.median(dist['exact']):10.3g} "
                f"{np.median(dist['matmuls']):10.3g} {np.median(residual):10.3g} "
                f"{np.median(floor):10.3g} {np.median(residual / np.maximum(floor, 1e-30)):9.3g} "
                f"{residual.max():10.3g} {(residual <= np.maximum(floor, 1e-5)).sum()}/{len(keys)}"
            )


def attention_models(folder: Path) -> Iterator[tuple[str, ExactModel, np.ndarray]]:
    """Each tiny model but the f16 file (CUDA's kernels for f16 weights are not followed),
    with the KV head each query head reads."""
    for target in TARGETS:
        if target == "f16":
            continue
        model = ExactModel(make(folder, target))
        hp = model.hp
        yield target, model, np.arange(hp.n_head) // (hp.n_head // hp.n_head_kv)


def layer0_qkv(model: ExactModel, tokens: np.ndarray, n_ubatch: int) -> tuple[np.ndarray, ...]:
    """Layer 0's Q, K and V of ``tokens`` as CUDA's kernels compute them in ubatches of
    ``n_ubatch`` tokens (before RoPE)."""
    from qdiff.core.roundings import Roundings
    from qdiff.exact.model import _ubatch_sizes, rms_norm

    model.roundings = Roundings(cuda_activations=True, cuda_tf32=True, n_ubatch=n_ubatch)
    model.row_tokens = _ubatch_sizes(len(tokens), n_ubatch)
    w = model.weights
    x = rms_norm(w["token_embd.weight"][tokens], w["blk.0.attn_norm.weight"], model.hp.eps)
    return model._qkv(x, 0)


def attention_ub1(captures: Path, folder: Path) -> None:
    """Layer 0's attention at the last of UB1_LAYER0 tokens, each token in its own ubatch,
    from the engine's Q, K and V (computed as the run's one-token kernels do, RoPE in
    float64, K and V stored in f16) and the run's own softmax weights, against the run's
    K·Q and softmax·V:
    K·Q with Q as it is (MMVF) or in f16 (MMF), the median and largest difference relative
    to the largest value; softmax·V as MMVF computes it (cuda.mmvf_weighted_sum), with
    f16 weights and float32 sums (MMF, the CPU), and with every product rounded once and
    summed in float32, the largest difference, and how many of the 256 outputs the
    emulation leaves more than 1e-6 away."""
    from qdiff.exact.model import rope

    f16 = cuda.f16
    print(
        f"{'file':7} {'n':>3} {'cells':>5} K·Q: float32 Q (median, max), f16 Q | softmax·V: mmvf (outputs off), f16 weights, products once"
    )
    for target, model, heads in attention_models(folder):
        hp = model.hp
        for n in UB1_LAYER0:
            t = np.load(captures / f"{target}-ub1-{n}.npz")
            q, k, v = layer0_qkv(model, t["tokens"], 1)
            turn = model._rope_of(0)
            q, k = (rope(a, np.arange(n, dtype=np.float64), turn) for a in (q, k))
            keys, values = (f16(a)[:, heads].transpose(1, 0, 2) for a in (k, v))
            cells = len(t["kq-0"]) // hp.n_head
            kq = t["kq-0"].reshape(hp.n_head, cells)[:, :n].astype(np.float64)
            p = t["kq_soft_max-0"].reshape(hp.n_head, cells)[:, :n].astype(np.float64)
            kqv = t["kqv-0"].reshape(hp.n_head, -1).astype(np.float64)
            kq_err = [
                np.abs(np.einsum("hd,hnd->hn", qq, keys) - kq) / np.abs(kq).max()
                for qq in (q[-1], f16(q[-1]))
            ]
            scale = np.abs(kqv).max()
            mmvf = np.abs(cuda.mmvf_weighted_sum(p[:, None], values, cells)[:, 0] - kqv) / scale
            weights16 = np.abs(np.einsum("hn,hnd->hd", f16(p), values) - kqv).max() / scale
            once = np.abs(f16(f16(p)[..., None] * values).sum(axis=1) - kqv).max() / scale
            print(
                f"{target:7} {n:3d} {cells:5d} {np.median(kq_err[0]):.1e} {kq_err[0].max():.1e}, "
                f"{np.median(kq_err[1]):.1e} {kq_err[1].max():.1e} | {mmvf.max():.1e} "
                f"({(mmvf > 1e-6).sum()}), {weights16:.1e}, {once:.1e}"
            )


def attention_cublas(captures: Path, folder: Path) -> None:
    """softmax·V of layer 0 at the last of 40 tokens in one ubatch (cuBLAS, f16 compute),
    from the engine's V (MMQ or TF32, stored in f16) and the run's own softmax weights:
    runs of 8, 16 and 32 cells added to an f16 accumulator (cuda.cublas_f16_weighted_sum
    takes 16), float32 sums of the f16 products, and those rounded to f16 once; the largest
    difference relative to the largest value, and how many of the 256 outputs differ."""

    print(
        f"{'file':7} softmax·V of 40 tokens: runs of 8, 16, 32 cells in f16; float32 sums; those in f16"
    )
    for target, model, heads in attention_models(folder):
        hp = model.hp
        t = np.load(captures / f"{target}-40.npz")
        n = len(t["tokens"])
        values = cuda.f16(layer0_qkv(model, t["tokens"], 512)[2])[:, heads].transpose(1, 0, 2)
        cells = len(t["kq_soft_max-0"]) // hp.n_head
        p = t["kq_soft_max-0"].reshape(hp.n_head, cells)[:, :n].astype(np.float64)
        kqv = t["kqv-0"].reshape(hp.n_head, -1).astype(np.float64)
        float32 = np.einsum("hn,hnd->hd", cuda.f16(p), values)
        ways_ = [cuda.cublas_f16_weighted_sum(p[:, None], values, r)[:, 0] for r in (8, 16, 32)]
        ways_ += [float32, cuda.f16(float32)]
        errs = [np.abs(way - kqv) / np.abs(kqv).max() for way in ways_]
        print(f"{target:7} " + " ".join(f"{e.max():.1e} ({(e > 0).sum()})" for e in errs))


def f16_one_token(captures: Path, folder: Path) -> None:
    """The f16 file's matmuls of layer 0 at one token (MMVF with f16 accumulators, the
    kernel softmax·V of one token takes): float32 products, the activations in f16, and
    the activations and every product in f16 summed in float32 (cuda.mmvf_weighted_sum),
    the largest difference relative to the output's largest value."""
    model, tensors = ExactModel(make(folder, "f16")), np.load(captures / "f16-1.npz")
    print("f16 weights, one token: float32, f16 activations, f16 activations and products")
    for given, made, weight in MATMULS:
        x, theirs = tensors[given].astype(np.float64), tensors[made].astype(np.float64)
        w, scale = model.weights[weight], np.abs(theirs).max()
        ways = (
            w @ x,
            w @ x.astype(np.float16),
            cuda.mmvf_weighted_sum(x[None, None], w.T[None], len(x))[0, 0],
        )
        print(f"{made:12} " + " ".join(f"{np.abs(y - theirs).max() / scale:.2e}" for y in ways))
    print()


def main() -> None:
    captures = Path(sys.argv[1])
    if sys.argv[2:] == ["attention"]:
        with tempfile.TemporaryDirectory() as folder:
            f16_one_token(captures, Path(folder))
            attention_ub1(captures.parent / "h200-ub1", Path(folder))
            attention_cublas(captures, Path(folder))
        return
    digests = dict(
        line.split("\t") for line in (captures / "files.tsv").read_text().split("\n") if line
    )
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for target in TARGETS:
            path = make(Path(folder), target)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != digests[target]:
                raise SystemExit(f"{target}: the model made here is not the one captured")
            model = ExactModel(path)
            for flash in ("", "-fa"):
                for n in LENGTHS:
                    if not (captures / f"{target}{flash}-{n}.npz").exists():
                        continue  # flash attention's matmuls are the same: not kept
                    tensors = np.load(captures / f"{target}{flash}-{n}.npz")
                    for given, made, weight in MATMULS:
                        if given not in tensors or made not in tensors:
                            continue
                        x = tensors[given].astype(np.float64)[None]
                        theirs = tensors[made].astype(np.float64)
                        scale = np.abs(theirs).max()
                        errs = {
                            k: np.abs(v[0] - theirs).max() / scale
                            for k, v in ways(model, x, weight).items()
                        }
                        kind = model.weights.type_of(weight)
                        rows.append((target + flash, n, made, kind, errs))
    names = ["plain", "cpu", "mmvq", "mmq", "tf32t", "tf32r", "tf32a", "x16", "run16"]
    print(f"{'file':10} {'n':>3} {'output':12} {'type':5} " + " ".join(f"{k:>9}" for k in names))
    for target, n, made, kind, errs in rows:
        cells = " ".join(f"{errs[k]:9.2e}" if k in errs else f"{'':>9}" for k in names)
        print(f"{target:10} {n:3d} {made:12} {kind:5} {cells}")
    with tempfile.TemporaryDirectory() as folder:
        whole_models(captures, Path(folder))
        ub1 = captures.parent / "h200-ub1"  # capture.py's one-token ubatches
        if ub1.exists():
            whole_models(ub1, Path(folder), n_ubatch=1)


if __name__ == "__main__":
    main()
