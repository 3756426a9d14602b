"""qdiff's text statistics beside llama-perplexity's (validate.sh): the same statistic from
each tool, and what llama-perplexity stored of its base (uint16 log-probabilities) against
qdiff's float32 base pass at the same positions.

    compare.py LLAMA_PERPLEXITY_KLD_LOG BASE_KLD_FILE QDIFF_WORKDIR MODEL > comparison.md

MODEL is the config's model (its file Q against its f32 copy, the base).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.compare.forced import kl_with_tail, with_probabilities
from qdiff.core.forced import log_sum_exp_rows
from qdiff.core.io import load_arrays
from qdiff.core.text import first_scored

KEPT = (64, 256, 1024, 4096)  # tokens kept, for the bound's share of the full KL
# llama-perplexity's line label -> (qdiff's statistic, index or percentile key, scale)
LINES = {
    "Mean PPL(Q)": ("ppl", 0, 1),
    "Mean PPL(base)": ("ppl_base", 0, 1),
    "Cor(ln(PPL(Q)), ln(PPL(base)))": ("cor_ln_ppl", None, 100),
    "Mean ln(PPL(Q)/PPL(base))": ("ln_ppl_ratio", 0, 1),
    "Mean PPL(Q)/PPL(base)": ("ppl_ratio", 0, 1),
    "Mean PPL(Q)-PPL(base)": ("ppl_diff", 0, 1),
    "Mean    KLD": ("kld", 0, 1),
    "Maximum KLD": ("kld_percentiles", "100", 1),
    "99.9%   KLD": ("kld_percentiles", "99.9", 1),
    "99.0%   KLD": ("kld_percentiles", "99", 1),
    "Median  KLD": ("kld_percentiles", "50", 1),
    "Minimum KLD": ("kld_percentiles", "0", 1),
    "Mean    Δp": ("p_diff", 0, 100),
    "Maximum Δp": ("p_diff_percentiles", "100", 100),
    "Median  Δp": ("p_diff_percentiles", "50", 100),
    "Minimum Δp": ("p_diff_percentiles", "0", 100),
    "RMS Δp    ": ("p_diff_rms", 0, 100),
    "Same top p": ("same_top", 0, 100),
}


def llama_perplexity_stats(log: str) -> dict[str, tuple[float, float | None]]:
    """Each statistic llama-perplexity printed, with its uncertainty where it prints one
    (``value ± error``)."""
    found: dict[str, tuple[float, float | None]] = {}
    for label in LINES:
        m = re.search(re.escape(label) + r"\s*:\s*(-?[0-9.]+)(?:\s*±\s*([0-9.]+))?", log)
        if m:
            found[label] = (float(m.group(1)), float(m.group(2)) if m.group(2) else None)
    return found


def _pm(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def read_base(path: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """llama-perplexity's --kl-divergence-base file: its tokens, and per scored position the
    uint16 log-probabilities decoded (scale * q + min), as its kl_divergence decodes them."""
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    offset = 20
    tokens = np.frombuffer(raw, np.int32, n_ctx * n_chunk, offset).reshape(n_chunk, n_ctx)
    offset += 4 * n_ctx * n_chunk
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = n_ctx - 1 - n_ctx // 2
    rows = np.frombuffer(raw, np.uint16, n_chunk * n_scored * nv, offset).reshape(
        n_chunk, n_scored, nv
    )
    head = rows[..., :4].copy().view(np.float32)  # scale, min log-prob
    logp = head[..., :1] * rows[..., 4 : 4 + n_vocab] + head[..., 1:2]
    return tokens, logp, int(n_ctx)


def full_vocabulary(
    work: Path, model: str, windows: np.ndarray, base: dict, other: dict
) -> dict[str, Any]:
    """Both files scored again along the same windows with qdiff's own llama.cpp calls (the
    text stage's ``LoadedModel.score``, the `cpu` device's settings), every logit kept: the
    KL divergence over the whole vocabulary in float64, which neither tool stores, and
    whether these logits are bit for bit the text stage's (its digests); and the model's
    BOS, where it adds one."""
    from qdiff.core.forced import DIGEST_ALGORITHM, digest, same_digest_algorithm
    from qdiff.core.settings import DeviceSettings
    from qdiff.core.text import split
    from qdiff.engine.log import init_backend
    from qdiff.engine.model import LoadedModel

    for stored in (base, other):  # digests of an older qdiff cannot be set against these
        same_digest_algorithm(stored, {"digest_algorithm": DIGEST_ALGORITHM})
    log = init_backend(work / "full-vocabulary-errors.txt")
    device = DeviceSettings.from_config({"backend": "cpu", "threads": 2})
    rows, bos = {}, None
    for name in ("dequant-f32.gguf", "gguf"):
        path = work / "resources/models" / f"{model}.{name}"
        with LoadedModel(path, device, int(windows.shape[1])) as loaded:
            rows[name] = [
                loaded.score(list(w), len(split(list(w))[0]) - 1)[:-1].copy() for w in windows
            ]
            bos = loaded.bos_added()
    kld, same_bits = [], True
    bounds: dict[int, list[float]] = {k: [] for k in KEPT}
    for w, (lb, lq) in enumerate(zip(rows["dequant-f32.gguf"], rows["gguf"], strict=True)):
        same_bits &= all(digest(r) == d for r, d in zip(lb, base["digest"][w], strict=True))
        same_bits &= all(digest(r) == d for r, d in zip(lq, other["digest"][w], strict=True))
        lse_b, lse_q = log_sum_exp_rows(lb), log_sum_exp_rows(lq)
        pb = lb.astype(np.float64) - lse_b[:, None]  # log p = logit - lse, as qdiff keeps it
        pq = lq.astype(np.float64) - lse_q[:, None]
        kld.extend((np.exp(pb) * (pb - pq)).sum(1))
        order = np.argsort(-pb, axis=1)
        for k, bound in bounds.items():
            bound.extend(_bounded((lb, lse_b), (lq, lse_q), order[:, :k]))
    del log
    values = np.array(kld)
    return {
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "max": float(values.max()),
        "bit_identical": bool(same_bits),
        "bound_share": {k: float(np.mean(v) / values.mean()) for k, v in bounds.items()},
        "bos": bos,
    }


def _bounded(
    base: tuple[np.ndarray, np.ndarray], other: tuple[np.ndarray, np.ndarray], ids: np.ndarray
) -> np.ndarray:
    """KL over the tokens ``ids`` (the base's top k) and one bucket for the rest, per
    position, as the text stage bounds it: each side is its logits and their log-sum-exp."""
    a, b = (
        with_probabilities({"slice_logits": np.take_along_axis(logits, ids, 1), "lse": lse})
        for logits, lse in (base, other)
    )
    return kl_with_tail(a, b)


def _same_tokens(ours: np.ndarray, theirs: np.ndarray, bos: int | None) -> tuple[bool, str]:
    """Whether the two tools decoded the same windows, and what they did with the BOS.
    llama-perplexity's file keeps each window's own first token, which it replaces with the
    BOS while decoding where the model adds one (kl_divergence); qdiff keeps the BOS."""
    decoded = theirs[: len(ours)].copy()
    if bos is None:
        return np.array_equal(ours, decoded), (
            "this model adds no BOS, so neither replaced a window's first token"
        )
    decoded[:, 0] = bos
    return np.array_equal(ours, decoded), (
        f"this model adds a BOS (id {bos}): both decode it in place of each window's first token"
    )


def _print_table(theirs: dict, ours: dict) -> None:
    """One row per llama-perplexity statistic: its value and ± beside qdiff's."""
    print(
        "| statistic | llama-perplexity | ± | qdiff | ± | qdiff − llama-perplexity "
        "| ± ratio (qdiff / llama-perplexity) |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, (value, error) in theirs.items():
        key, index, scale = LINES[label]
        mine = ours[key] if index is None else ours[key][index]
        # qdiff keeps [mean, uncertainty] for the means; percentiles have none
        my_error = ours[key][1] * scale if index == 0 else None
        mine = mine * scale
        ratio = f"{my_error / error:.3f}" if error and my_error is not None else "–"
        print(
            f"| {label.strip()} | {value:.6g} | {_pm(error)} | {mine:.6g} | {_pm(my_error)} "
            f"| {mine - value:+.3g} | {ratio} |"
        )


def main(log_path: str, base_path: str, workdir: str, model: str) -> None:
    work = Path(workdir)
    theirs = llama_perplexity_stats(Path(log_path).read_text())
    text = json.loads((work / f"results/compare/{model}.text.json").read_text())
    ours = text["pairs"]["cpu.f32 vs cpu.none"]  # the f32 copy, the teacher, as the base
    print("# qdiff's text statistics against llama-perplexity's\n")
    print(
        f"`{model}.gguf` (Q) against its f32 copy (base), {text['n_windows']} windows "
        f"of {text['n_ctx']} tokens of Macbeth ({ours['n']:,} positions scored), on one CPU "
        "device (2 threads, no flash attention, no repacked weights). llama-perplexity built "
        "from the llama.cpp source llama-cpp-python 0.3.36 vendors (`validate.sh`). qdiff's KLD "
        f"is over the teacher's top {text['top_k']} tokens and one bucket for the rest.\n"
    )
    _print_table(theirs, ours)
    tokens, logp, n_ctx = read_base(Path(base_path))
    base = load_arrays(work / "results/text" / model / "cpu/f32/text.npz")
    ours_tokens = base["window_tokens"]
    first = first_scored(n_ctx)
    targets = tokens[:, first + 1 :]
    stored = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    gap = np.abs(stored - base["forced_logprob"])
    # a token more than 16 nats below the most likely one is stored at that floor
    floor = (logp.min(axis=-1) - base["forced_logprob"]) > 1e-3
    other = load_arrays(work / "results/text" / model / "cpu/none/text.npz")
    full = full_vocabulary(work, model, ours_tokens, base, other)
    same_tokens, bos_said = _same_tokens(ours_tokens, tokens, full["bos"])
    print(
        f"\nOver the whole vocabulary, in float64 (both files scored again with the text "
        f"stage's own calls, every logit kept; bit for bit the text stage's logits: "
        f"**{full['bit_identical']}**): mean KLD {full['mean']:.6f}, median "
        f"{full['median']:.6f}, maximum {full['max']:.6f}. qdiff's bound over "
        f"{text['top_k']} tokens and a bucket is {ours['kld'][0] / full['mean']:.4f} of the "
        f"mean; llama-perplexity's {theirs['Mean    KLD'][0] / full['mean']:.4f}. The same bound "
        "with other numbers of tokens kept (the base's own top k, from these logits): "
        + ", ".join(f"{k}: {share:.4f}" for k, share in full["bound_share"].items())
        + "."
    )
    print(
        f"\nThe two tools read the same tokens: **{same_tokens}** ({bos_said}). "
        "llama-perplexity's stored base "
        f"log-probability of each scored token against qdiff's float32 base pass: largest "
        f"difference {gap.max():.2e} nat, median {np.median(gap):.2e} (its uint16 step is "
        f"{float(np.median(np.ptp(logp, axis=-1))) / 65535:.2e} nat at the median position). "
        f"At {int(floor.sum())} of {floor.size:,} positions the text's token is more than 16 "
        "nats below the base's most likely token, where llama-perplexity stores it at that "
        f"floor: its NLL there is understated by up to {gap[floor].max(initial=0):.3f} nat. "
        "qdiff's PPL(base) with the same understatement: "
        f"{ours['ppl_base'][0] * np.exp(-(stored - base['forced_logprob'])[floor].sum() / floor.size):.4f} "
        f"(llama-perplexity's: {theirs['Mean PPL(base)'][0]:.4f})."
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
