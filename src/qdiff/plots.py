"""PNG figures for the report (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render to files only
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


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
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="black" if bright else "white")
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
    ax.hist(np.log10(delta[delta > 0]), bins=80, color="#3b6ea8")
    ax.set_xlabel("log10 |Δ logit| per vocabulary token")
    ax.set_ylabel("tokens")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
