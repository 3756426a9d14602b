"""CUDA flash attention (MMA_F16) beyond one tile of KV cells, tried on the operands the
kernel read (capture-fa-inputs.py's ``<target>-fa-inputs-<n>.npz``: Q after RoPE, the f16
cache's K and V, the f16 mask, the output at every position), so that RoPE no longer stands
between the emulation and the capture (explore-fa-tiles.py).

Kernel path (vendored llama.cpp, fattn-mma-f16.cuh and fattn-common.cuh): a head of 64 or
128 and more than 32 query rows take ncols1 = 64, one warp a column group (np = 1),
nbatch_fa = 64 cells a KV tile (ggml_cuda_fattn_mma_get_config_ampere); the captures'
lengths (40-600 tokens, the last ubatch of 600 holding 88 rows) all take this path.
Stream-k (NVIDIA from Ada): the ``iter_k`` KV tiles of every output tile
(64 rows of one head) laid end to end and cut into ``blocks`` equal spans; each block runs
its span's tiles with a running maximum (the f16 accumulator rescaled by an f16 factor,
the float32 row sum by a float32 one), and where a span does not cover a whole output tile,
flash_attn_stream_k_fixup_* folds the spans' unnormalised partials in float32 from the
last to the first, each scaled by expf of its maximum less the larger (0 below
SOFTMAX_FTZ_THRESHOLD, -20). ``blocks`` is min(max_blocks, tiles) where max_blocks is
132 SMs times the kernel's occupancy (unknown here: the candidates are tried).

Run from the repository's root, with ./setup's .venv:
    .venv/bin/python docs/results/cuda-roundings/check-fa-tiles.py FOLDER
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src")]

from qdiff.exact import cuda  # noqa: E402
from qdiff.exact.roundings import f16  # noqa: E402

NBATCH_FA = 64
NCOLS1 = 64
SMS = 132  # H100 SXM and H200; their occupancy (blocks an SM), 1-4, is tried
FTZ = -20.0  # SOFTMAX_FTZ_THRESHOLD
MAX_INIT = -np.finfo(np.float32).max / 2  # KQ_max's start: -FLT_MAX/2
OFFSET = cuda.FATTN_KQ_MAX_OFFSET


def scores_of(t: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """K·Q as the kernel forms it (heads, rows, cells), the mask added, and V (heads, cells, d)."""
    q = cuda.mma_flash_query(t["q"][0].astype(np.float64), float(t["scale"]), 0.0)
    ratio = t["q"].shape[1] // t["k"].shape[1]  # query heads a KV head serves (GQA)
    k = np.repeat(t["k"][0].astype(np.float64), ratio, axis=0)
    v = np.repeat(t["v"][0].astype(np.float64), ratio, axis=0)
    s = np.float32(q @ k.transpose(0, 2, 1)).astype(np.float64)
    return s + t["mask"][0, 0].astype(np.float64)[None], v


def span_partial(
    s: np.ndarray, v: np.ndarray, tiles: range
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One block's span of KV tiles, for every row: the unnormalised f16 accumulator, its
    maximum (with the offset) and its float32 row sum."""
    heads, rows, _ = s.shape
    acc = np.zeros((heads, rows, v.shape[-1]))
    top = np.full((heads, rows), MAX_INIT)
    rowsum = np.zeros((heads, rows))
    for kb in tiles:
        cells = slice(kb * NBATCH_FA, (kb + 1) * NBATCH_FA)
        st = s[:, :, cells]
        new = np.maximum(top, st.max(axis=-1) + OFFSET)
        p = np.float32(np.exp(st - new[..., None])).astype(np.float64)
        diff = top - new
        factor = np.where(diff >= FTZ, np.float32(np.exp(diff)), 0.0)
        rowsum = np.float32(factor * rowsum + np.float32(p.sum(axis=-1))).astype(np.float64)
        acc = f16(acc * f16(factor)[..., None]) + 0.0
        # P·V onto the f16 accumulator, 16 cells a step (mma m16n8k16), each step rounded
        acc = cuda.cublas_f16_weighted_sum(p, v[:, cells], acc=acc)
        top = new
    return acc, top, rowsum


def stream_k(s: np.ndarray, v: np.ndarray, blocks: int) -> np.ndarray:
    """The kernel's output with ``blocks`` CUDA blocks sharing the work (module docstring)."""
    heads, rows, cells = s.shape
    iter_k = -(-cells // NBATCH_FA)
    iter_j = -(-rows // NCOLS1)
    total = iter_k * iter_j * heads
    cuts = sorted({b * total // blocks for b in range(blocks + 1)})
    out = np.empty((heads, rows, v.shape[-1]))
    for h in range(heads):
        for jt in range(iter_j):
            first = (h * iter_j + jt) * iter_k
            edges = sorted(
                {first, first + iter_k, *(c for c in cuts if first < c < first + iter_k)}
            )
            spans = [range(a - first, b - first) for a, b in itertools.pairwise(edges)]
            r = slice(jt * NCOLS1, min(rows, (jt + 1) * NCOLS1))
            parts = [span_partial(s[h : h + 1, r], v[h : h + 1], span) for span in spans]
            val, top, rowsum = (np.float32(x[0]).astype(np.float64) for x in parts[-1])
            for acc, m, rs in reversed(parts[:-1]):
                new = np.maximum(top, m[0])
                sv = np.where(top - new >= FTZ, np.float32(np.exp(top - new)), 0.0)
                sa = np.where(m[0] - new >= FTZ, np.float32(np.exp(m[0] - new)), 0.0)
                val = np.float32(sv[..., None] * val + sa[..., None] * np.float32(acc[0]))
                rowsum = np.float32(sv * rowsum + sa * rs[0])
                top = new
            out[h, r] = np.float32(val / rowsum[..., None])
    return out


def stream_k_blocks(n_dst: int, n_tiles: int, max_blocks: int) -> int:
    """launch_fattn's block count: at most one a KV tile, rounded down to a multiple of
    the output tiles where that loses at most 5% (fattn-common.cuh:1165-1178)."""
    raw = min(max_blocks, n_tiles)
    rounded = raw // n_dst * n_dst
    return rounded if rounded and 100 * (raw - rounded) // raw <= 5 else raw


def compare(emulated: np.ndarray, captured: np.ndarray) -> str:
    e = np.float32(emulated)
    return f"equal {np.mean(e == captured):6.1%}, max |diff| {np.abs(e - captured).max():.2e}"


def main() -> None:
    folder = Path(sys.argv[1])
    for path in sorted(
        folder.glob("*-fa-inputs-*.npz"),
        key=lambda p: (p.name.split("-fa")[0], int(p.stem.rsplit("-", 1)[1])),
    ):
        t = dict(np.load(path))
        s, v = scores_of(t)
        captured = t["out"][0].transpose(1, 0, 2)  # (heads, rows, d)
        n_tiles = -(-s.shape[1] // NCOLS1) * s.shape[0] * -(-s.shape[2] // NBATCH_FA)
        print(f"{path.stem}: {s.shape[1]} rows, {s.shape[2]} cells, {n_tiles} KV tiles in all")
        print(f"  one maximum (the engine)       {compare(cuda.mma_flash_sum(s, v), captured)}")
        n_dst = n_tiles // -(-s.shape[2] // NBATCH_FA)
        for blocks in sorted({stream_k_blocks(n_dst, n_tiles, occ * SMS) for occ in (1, 2, 3, 4)}):
            print(
                f"  stream-k, {blocks:3d} blocks          {compare(stream_k(s, v, blocks), captured)}"
            )


if __name__ == "__main__":
    main()
