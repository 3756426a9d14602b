"""An exploration, kept with its log: CUDA flash attention (MMA_F16) over several tiles of KV cells, against the H200's
layer-0 FLASH_ATTN_EXT output at the last token (h200-fa/<target>-fa-<n>.npz).

Run from the repository's root, with ./setup's .venv (about a second on 2 cores):
    .venv/bin/python docs/results/cuda-roundings/explore-fa-tiles.py > docs/results/cuda-roundings/explore-fa-tiles.log
Inputs (q, k, v of layer 0, built as tests/test_cuda_kernels.py::_flash_shares builds them)
are cached in /tmp/fa_inputs.

Kernel path (vendored llama.cpp, see the report): head size 64, 4 heads, 4 KV heads (GQA 1),
n_kv = 256 (n <= 256) or 512 (n = 300); ncols2 = 1; ncols1 = 8 (n <= 8), 16 (<= 16), 32 (<= 32),
64 (more); nbatch_fa = 128 (ncols 8) or 64; stream-k on sm_90: at 300 tokens 160 blocks of
one 64-cell KV tile each, combined by flash_attn_stream_k_fixup_uniform in float32.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "docs/results/cuda-roundings")]

from qdiff.exact import cuda  # noqa: E402

H200_FA = ROOT / "docs/results/cuda-roundings/h200-fa"
CACHE = Path("/tmp/fa_inputs")
TARGETS = ["f32", "q8_0", "q4_k_m"]
LENGTHS = [2, 5, 12, 40, 300]
OFFSET32 = np.float32(np.float32(3.0) * np.float32(0.6931))
FLT_MAX_HALF = np.float32(-np.finfo(np.float32).max / 2)
FTZ = -20.0


def inputs(target: str, n: int) -> dict[str, np.ndarray]:
    path = CACHE / f"{target}-{n}.npz"
    if path.exists():
        return dict(np.load(path))
    raise FileNotFoundError(path)


def build_inputs() -> None:
    from capture import make

    from qdiff.exact.model import ExactModel, rms_norm
    from test_cuda_kernels import _attention_inputs_of_layer0

    CACHE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        for target in TARGETS:
            if all((CACHE / f"{target}-{n}.npz").exists() for n in LENGTHS):
                continue
            model = ExactModel(make(Path(folder), target))
            for n in LENGTHS:
                t = np.load(H200_FA / f"{target}-fa-{n}.npz")
                q, k, v = _attention_inputs_of_layer0(model, t["tokens"])
                # the same before RoPE (as _attention_inputs_of_layer0 computes them)
                w, hp = model.weights, model.hp
                x = rms_norm(
                    w["token_embd.weight"][t["tokens"]], w["blk.0.attn_norm.weight"], hp.eps
                )
                q0, k0, _ = model._qkv(x, 0)
                r = model._rope_of(0)
                assert r.factors is None and r.attn_factor == 1.0
                heads = np.arange(hp.n_head) // (hp.n_head // hp.n_head_kv)
                np.savez(
                    CACHE / f"{target}-{n}.npz",
                    q=q,
                    k=cuda.f16(k),
                    v=cuda.f16(v),
                    k_raw=k,
                    v_raw=v,
                    q_pre=q0[-1],
                    k_pre=k0[:, heads].transpose(1, 0, 2),
                    rope=np.array([r.n_rot, r.base, r.scale, float(r.neox)]),
                    theirs=t["FLASH_ATTN_EXT (unnamed)"].astype(np.float64),
                    scale=np.float64(model.hp.attn_scale),
                    heads=np.int64(model.hp.n_head),
                )


def share(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.mean(np.abs(ours - theirs) <= 1e-6 * np.abs(theirs).max()))


# ---------------------------------------------------------------- pieces


def scores(d: dict, s32: bool) -> np.ndarray:
    """(heads, n) K·Q of the last token: Q in f16 times the f16 scale, f16 K; float32 if s32."""
    qh = cuda.mma_flash_query(d["q"], float(d["scale"]), 0.0)
    s = np.einsum("hd,hnd->hn", qh, d["k"])
    return s.astype(np.float32).astype(np.float64) if s32 else s


def exp32(x: np.ndarray, fast: bool) -> np.ndarray:
    """expf in float32: exactly rounded, or as -use_fast_math's ex2.approx(x*log2e)
    (the multiply rounded to float32; ex2.approx taken as exact here)."""
    x32 = np.asarray(x, dtype=np.float32)
    if fast:
        y = (x32 * np.float32(1.4426950408889634)).astype(np.float32)
        return np.exp2(y.astype(np.float64)).astype(np.float32).astype(np.float64)
    return np.exp(x32.astype(np.float64)).astype(np.float32).astype(np.float64)


def f16_runs(
    p: np.ndarray, v: np.ndarray, acc: np.ndarray, run: int = 16, acc_kind: str = "f16"
) -> np.ndarray:
    """acc (h, d) plus the weights p (h, c) times v (h, c, d) in runs of ``run`` cells, each
    run's products summed exactly then added to the accumulator, rounded (f16/f32/none)."""
    rnd = {
        "f16": cuda.f16,
        "f32": lambda x: x.astype(np.float32).astype(np.float64),
        "none": lambda x: x,
    }[acc_kind]
    pw = cuda.f16(p)
    for s in range(0, p.shape[1], run):
        acc = rnd(acc + np.einsum("hc,hcd->hd", pw[:, s : s + run], v[:, s : s + run]))
    return acc


def tile_partial(
    s: np.ndarray,
    v: np.ndarray,
    valid: np.ndarray,
    *,
    s32=True,
    fast=False,
    acc_kind="f16",
    m_in=None,
    vkq_in=None,
    rs_in=None,
    scale_h=True,
):
    """One flash_attn_ext_f16_iter over a tile: s (h, c) scores, valid (c,) mask.
    Returns the new (max, rowsum, VKQ). m_in etc.: running state (None: fresh block)."""
    h = s.shape[0]
    if m_in is None:
        m_in = np.full(h, float(FLT_MAX_HALF))
        rs_in = np.zeros(h)
        vkq_in = np.zeros((h, v.shape[-1]))
    sm = np.where(valid[None], s, -np.inf)
    cand = (sm.astype(np.float32) + OFFSET32).astype(np.float64) if s32 else sm + float(OFFSET32)
    m_new = np.maximum(m_in, cand.max(axis=1))
    diff = m_in - m_new
    if s32:
        diff = diff.astype(np.float32).astype(np.float64)
    p = np.where(
        valid[None], exp32(sm - m_new[:, None], fast) if s32 else np.exp(sm - m_new[:, None]), 0.0
    )
    rs_add = p.sum(axis=1)
    msc = exp32(diff, fast) if s32 else np.exp(diff)
    msc = np.where(diff >= FTZ, msc, 0.0)
    rs = msc * rs_in + rs_add
    # VKQ (half2) *= make_half2(scale): scale rounded to f16, product rounded to f16
    vkq = cuda.f16(vkq_in * cuda.f16(msc)[:, None]) if scale_h else vkq_in * msc[:, None]
    vkq = f16_runs(p, v, vkq, acc_kind=acc_kind)
    return m_new, rs, vkq


def combine_uniform(parts, f32: bool):
    """flash_attn_stream_k_fixup_uniform: start from the last block's part, fold in the
    earlier ones going backwards; float32 (each op rounded) or float64."""
    r = (lambda x: np.asarray(x, dtype=np.float32).astype(np.float64)) if f32 else (lambda x: x)
    m, rs, val = parts[-1]
    val = r(val)
    for m2, rs2, val2 in reversed(parts[:-1]):
        mn = np.maximum(m, m2)
        dv, da = r(m - mn), r(m2 - mn)
        sv = np.where(dv >= FTZ, r(np.exp(dv)), 0.0)
        sa = np.where(da >= FTZ, r(np.exp(da)), 0.0)
        val = r(r(sv[:, None] * val) + r(sa[:, None] * r(val2)))
        rs = r(r(sv * rs) + r(sa * rs2))
        m = mn
    return r(val / rs[:, None])


def n_kv_of(n: int) -> int:
    return max(256, -(-n // 256) * 256)


def layout(n: int):
    """(nbatch_fa, np) of the MMA config the launch picks for n query tokens (ncols2 = 1)."""
    ncols = 8 if n <= 8 else 16 if n <= 16 else 32 if n <= 32 else 64
    nbatch_fa = 128 if ncols == 8 else 64
    cols_per_warp = 8 if ncols == 8 else 16
    npar = 4 * cols_per_warp // ncols
    return nbatch_fa, npar


# ---------------------------------------------------------------- hypotheses


def h_global(d, **kw):
    """qdiff's present emulation: one maximum over all cells, one f16 accumulation."""
    s = scores(d, False)
    mma = cuda.mma_flash_sum(s[:, None], d["v"])[:, 0]
    return mma


def h_stream_k_tiles(d, *, s32=True, fast=False, acc_kind="f16", comb32=True):
    """Each KV tile of nbatch_fa cells a block of its own (stream-k, one work unit per
    block), partials folded by the uniform fixup (last tile first)."""
    s = scores(d, s32)
    n = s.shape[1]
    v = d["v"]
    nkv = n_kv_of(n)
    nb, _ = layout(n)
    parts = []
    for t0 in range(0, nkv, nb):
        c = np.arange(t0, t0 + nb)
        valid = c < n
        cc = np.minimum(c, n - 1)
        parts.append(tile_partial(s[:, cc], v[:, cc], valid, s32=s32, fast=fast, acc_kind=acc_kind))
    return combine_uniform(parts, comb32)


def h_running(d, *, s32=True, fast=False, acc_kind="f16", scale_h=True):
    """One block over all tiles: running maximum, VKQ rescaled in half2 at each tile."""
    s = scores(d, s32)
    n = s.shape[1]
    v = d["v"]
    nkv = n_kv_of(n)
    nb, _ = layout(n)
    m = rs = vkq = None
    for t0 in range(0, nkv, nb):
        c = np.arange(t0, t0 + nb)
        valid = c < n
        cc = np.minimum(c, n - 1)
        m, rs, vkq = tile_partial(
            s[:, cc],
            v[:, cc],
            valid,
            s32=s32,
            fast=fast,
            acc_kind=acc_kind,
            m_in=m,
            rs_in=rs,
            vkq_in=vkq,
            scale_h=scale_h,
        )
    return vkq / rs[:, None]


HYPOTHESES = {
    "H0 global max (present)": h_global,
    "H1 stream-k per tile, f32 fixup": h_stream_k_tiles,
    "H1b per tile, f64 fixup": lambda d: h_stream_k_tiles(d, comb32=False),
    "H1c per tile, f64 scores/exp": lambda d: h_stream_k_tiles(d, s32=False),
    "H1d per tile, fast expf": lambda d: h_stream_k_tiles(d, fast=True),
    "H2 running max, half2 rescale": h_running,
    "H2b running max, exact rescale": lambda d: h_running(d, scale_h=False),
    "H3 per tile, f32 accumulator": lambda d: h_stream_k_tiles(d, acc_kind="f32"),
}


def main() -> None:
    build_inputs()
    names = list(HYPOTHESES)
    print(f"{'target':7s} {'n':>4s}  " + "  ".join(f"[{i}]" for i in range(len(names))))
    for target in TARGETS:
        for n in LENGTHS:
            d = inputs(target, n)
            heads = int(d["heads"])
            theirs = d["theirs"].reshape(heads, -1)
            row = [share(HYPOTHESES[name](d), theirs) for name in names]
            print(f"{target:7s} {n:4d}  " + "  ".join(f"{x:.2f}" for x in row), flush=True)
    for i, name in enumerate(names):
        print(f"[{i}] {name}")


# ---------------------------------------------------------------- RoPE as CUDA computes it


def r32(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def rz32(x):
    """float64 -> float32 rounded toward zero."""
    x = np.asarray(x, dtype=np.float64)
    y = x.astype(np.float32)
    over = np.abs(y.astype(np.float64)) > np.abs(x)
    y = np.where(over, np.nextafter(y, np.float32(0)), y)
    return y.astype(np.float64)


def rope_cuda(x: np.ndarray, pos: np.ndarray, params: np.ndarray, variant: str) -> np.ndarray:
    """rope_norm (rope.cu:107-119) of x (..., pos, 64) for the given positions (non-neox).
    variant 'exact': float64 (qdiff's rope); 'f32': every step rounded to float32, the
    functions correctly rounded; 'mufu': 'f32' plus __sinf/__cosf's range reduction
    (FMUL.RZ by f32(1/2pi), then sin/cos of 2pi*r taken exact)."""
    n_rot, base, scale, neox = params
    assert not neox and scale == 1.0
    half = int(n_rot) // 2
    i = np.arange(half, dtype=np.float64)
    if variant == "exact":
        theta = pos[:, None] * base ** (-2.0 * i / n_rot)
        c, s = np.cos(theta), np.sin(theta)
    else:
        ts = r32(np.float32(base) ** np.float32(-2.0 / n_rot))  # host powf
        p = r32(np.exp2(r32(i * r32(np.log2(ts)))))  # __powf: ex2(y*lg2(x))
        theta = r32(pos[:, None] * p[None])
        if variant == "mufu":
            red = rz32(theta * r32(1 / (2 * np.pi)))
            c, s = r32(np.cos(2 * np.pi * red)), r32(np.sin(2 * np.pi * red))
        else:
            c, s = r32(np.cos(theta)), r32(np.sin(theta))
    x = r32(x)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    if variant == "exact":
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
    else:
        out[..., 0::2] = r32(x0 * c - r32(x1 * s))
        out[..., 1::2] = r32(x0 * s + r32(x1 * c))
    return out


def with_rope(d: dict, variant: str) -> dict:
    n = d["k_pre"].shape[1]
    pos = np.arange(n, dtype=np.float64)
    dd = dict(d)
    dd["q"] = rope_cuda(d["q_pre"][:, None], pos[-1:], d["rope"], variant)[:, 0]
    dd["k"] = cuda.f16(rope_cuda(d["k_pre"], pos, d["rope"], variant))
    return dd


def rope_table() -> None:
    print("\nRoPE variants x flash arithmetic (share equal to float32's level)")
    variants = ["exact", "f32", "mufu"]
    print(
        f"{'target':7s} {'n':>4s}  "
        + "  ".join(f"{'H0/' + r:>10s}  {'H1/' + r:>10s}" for r in variants)
    )
    for target in TARGETS:
        for n in LENGTHS:
            d = inputs(target, n)
            th = d["theirs"].reshape(int(d["heads"]), -1)
            row = []
            for r in variants:
                dd = with_rope(d, r)
                row += [share(h_global(dd), th), share(h_stream_k_tiles(dd), th)]
            print(f"{target:7s} {n:4d}  " + "  ".join(f"{x:10.2f}" for x in row), flush=True)


def h_warp_split(d, *, nb=64, npar=2, blocks=None):
    """Alternative layout: each tile of nb cells split among npar warps (warp w takes the
    16-cell runs w, w+npar, ...), each warp with its own maximum and f16 accumulator, all
    partials combined in float32 (what ncols = 32 (np 2) or 16 (np 4) would do)."""
    s = scores(d, True)
    n = s.shape[1]
    v = d["v"]
    parts = []
    for t0 in range(0, n_kv_of(n), nb):
        for w in range(npar):
            c = np.concatenate(
                [np.arange(t0 + r, t0 + r + 16) for r in range(16 * w, nb, 16 * npar)]
            )
            valid = c < n
            cc = np.minimum(c, n - 1)
            parts.append(tile_partial(s[:, cc], v[:, cc], valid))
    return combine_uniform(parts, True)


HYPOTHESES["H4 ncols32 layout (np 2)"] = lambda d: h_warp_split(d, npar=2)
HYPOTHESES["H5 ncols16 layout (np 4)"] = lambda d: h_warp_split(d, npar=4)


if __name__ == "__main__":
    main()
    rope_table()
