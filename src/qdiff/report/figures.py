"""PNG figures for the report (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render to files only
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator


def _log_scale_if_positive(ax: plt.Axes) -> None:
    """Log y axis, unless every plotted value is zero (bit-identical: nothing to log-scale)."""
    values = [v for line in ax.get_lines() for v in np.asarray(line.get_ydata(), dtype=float)]
    if any(np.isfinite(v) and v > 0 for v in values):
        ax.set_yscale("log")


def _finish_lines(fig: plt.Figure, ax: plt.Axes, title: str, path: Path) -> None:
    """Log-scale (when there is anything above zero), title, legend, save, close."""
    _log_scale_if_positive(ax)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heatmap(labels: list[str], values: np.ndarray, path: Path, title: str) -> None:
    """Pairwise max |Δ| matrix, log-scaled; 0 means bit-identical."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shown = np.where(values > 0, np.log10(np.where(values > 0, values, 1.0)), np.nan)
    size = max(4.0, 0.7 * len(labels) + 2)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(shown, cmap="viridis")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    low, high = np.nanmin(shown), np.nanmax(shown)
    for i in range(len(labels)):
        for j in range(len(labels)):
            if i != j:
                text = "0" if values[i, j] == 0 else f"{values[i, j]:.2g}"
                bright = values[i, j] > 0 and shown[i, j] > (low + high) / 2
                ax.text(
                    j,
                    i,
                    text,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if bright else "white",
                )
    fig.colorbar(image, ax=ax, label="log10 max |Δ| of first-step logits")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def delta_histogram(a: np.ndarray, b: np.ndarray, path: Path, title: str) -> None:
    """Distribution of per-token |Δ| over the vocabulary for one prompt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    delta = np.abs(a.astype(np.float64) - b.astype(np.float64))
    fig, ax = plt.subplots(figsize=(7, 4))
    # one filled outline, not ax.hist's 80 bar patches: a third of the figure's time
    counts, edges = np.histogram(np.log10(delta[delta > 0]), bins=80)
    ax.stairs(counts, edges, fill=True, color="#3b6ea8")
    ax.set_xlabel("log10 |Δ logit| per vocabulary token")
    ax.set_ylabel("tokens")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def forced_curves(curves: dict[str, tuple[list[int], list[float]]], path: Path, title: str) -> None:
    """Median per-position max |Δ| along the teacher's text, one line per pair."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (positions, values) in curves.items():
        shown = [v if v > 0 else np.nan for v in values]  # log scale: 0 is bit-identical
        ax.plot(positions, shown, marker="o", markersize=3, label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions are whole tokens
    ax.set_xlabel("generated position (teacher-forced)")
    ax.set_ylabel("median over prompts of max |Δ logit|")
    _finish_lines(fig, ax, title, path)


def depth_profile(
    rows: list[dict], floor_label: str | None, marked: int | None, path: Path, title: str
) -> None:
    """NMSE of each captured tensor in graph order, with the floor pair's and the first
    divergence marked; x ticks at the layer outputs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    x = [r["index"] for r in rows]
    ax.plot(x, [r["nmse"] or np.nan for r in rows], lw=1, label="pair")
    if floor_label:
        ax.plot(
            x,
            [r.get("floor_nmse") or np.nan for r in rows],
            lw=1,
            color="grey",
            label=f"floor: {floor_label}",
        )
    if marked is not None:
        ax.axvline(marked, color="red", ls="--", lw=1, label="first divergence")
    ticks = [(r["index"], r["name"]) for r in rows if r["name"].startswith("l_out-")]
    step = max(1, len(ticks) // 12)
    ax.set_xticks(
        [t[0] for t in ticks[::step]],
        [t[1] for t in ticks[::step]],
        rotation=45,
        ha="right",
        fontsize=7,
    )
    ax.set_ylabel("NMSE vs a (last position)")
    ax.set_xlabel("captured tensor, graph order")
    _finish_lines(fig, ax, title, path)


def budget_bars(rows: dict[str, list[tuple[str, float]]], path: Path, title: str) -> None:
    """Per combination (a panel row each), the error budget's medians as horizontal bars
    on a log scale: the run from exact, each source alone, all together, what the run is
    from that (the residual) and the floor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    height = sum(len(bars) for bars in rows.values()) * 0.22 + 0.6 * len(rows) + 0.8
    fig, axes = plt.subplots(len(rows), 1, figsize=(7.5, height), sharex=True, squeeze=False)
    colours = {"from exact": "#3b6ea8", "all together": "#5b9e4d", "residual": "#c0504d"}
    for ax, (combination, bars) in zip(axes[:, 0], rows.items(), strict=True):
        names = [name for name, _ in bars][::-1]
        values = [max(value, 1e-12) for _, value in bars][::-1]
        colour = [colours.get(n, "#999999" if n == "floor" else "#e0a030") for n in names]
        ax.barh(names, values, color=colour)
        ax.set_xscale("log")
        ax.set_title(combination, fontsize=9, loc="left")
        ax.tick_params(axis="y", labelsize=7)
    axes[-1, 0].set_xlabel("median over prompts of first-step max |Δ logit|")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def divergence_strips(
    rows: dict[str, tuple[list[int], int]], cap: int | None, path: Path, title: str
) -> None:
    """Per pair (a row each, the first on top): the divergence index of every prompt whose
    texts part (marker area ∝ prompts at that index) and, in a panel beside it, how many of
    its prompts did not part within the generated length; ``rows``: pair -> (divergence
    indices, prompts compared)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, kept) = plt.subplots(
        1,
        2,
        figsize=(8.5, 0.32 * len(rows) + 1.5),
        sharey=True,
        gridspec_kw={"width_ratios": [5, 1]},
    )
    for y, (indices, _) in enumerate(rows.values()):
        at, prompts = np.unique(np.asarray(indices, dtype=int), return_counts=True)
        ax.scatter(at, np.full(at.size, y), s=20 * prompts, color="#3b6ea8", alpha=0.8)
    never = [n - len(indices) for indices, n in rows.values()]
    kept.barh(range(len(rows)), never, color="#999999")
    for y, ((_, n), k) in enumerate(zip(rows.values(), never, strict=True)):
        kept.text(k, y, f" {k}/{n}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), list(rows), fontsize=7)
    ax.invert_yaxis()  # shared: the first pair on top in both panels
    if cap:
        ax.set_xlim(-1, cap)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("divergence index: first token that differs (marker area ∝ prompts)")
    kept.set_xlim(0, max(max(never, default=0), 1) * 1.6)  # room for the labels
    kept.set_xticks([])  # each bar is labelled
    kept.set_xlabel("did not part")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def delta_p_percentiles(
    lines: dict[str, list[float]], levels: list[float], path: Path, title: str
) -> None:
    """Percentiles of Δp (in percentage points), one line per combination over ``levels``
    (ascending); symmetric-log y from the decade of the smallest outermost percentile, so
    that small and large spreads both show."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    x = list(range(len(levels)))
    for name, values in lines.items():
        ax.plot(x, [100 * v for v in values], marker="o", markersize=3, label=name)
    ax.axhline(0, color="grey", lw=0.6)
    ends = (values[i] for values in lines.values() for i in (0, -1))
    tails = [abs(100 * v) for v in ends if v and np.isfinite(v)]
    if tails:
        ax.set_yscale("symlog", linthresh=float(10 ** np.floor(np.log10(min(tails)))))
    ax.set_xticks(x, [f"{q:g}" for q in levels])
    ax.set_xlabel("percentile over the scored positions")
    ax.set_ylabel("Δp, percentage points")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
