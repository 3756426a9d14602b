"""The per-model overview plots: the pairwise heatmap and the largest pair's |Δ| histogram."""

from __future__ import annotations

import numpy as np

from qdiff.compare.pairs import headline
from qdiff.core.io import load_array
from qdiff.core.labels import Combination, Pair
from qdiff.report import figures
from qdiff.report.view import ModelView


def overview_plots(view: ModelView) -> str:
    if view.plot_dir is None:
        return "_not rendered_"
    labels = [Combination.from_record(r).label for r in view.ok]
    if len(labels) < 2 or not view.ok_pairs:
        return "_Not enough runs to plot._"
    index = {lab: i for i, lab in enumerate(labels)}
    values = np.zeros((len(labels), len(labels)))
    for p in view.ok_pairs:
        i, j = index[p["a"]], index[p["b"]]
        values[i, j] = values[j, i] = headline(p)
    heat = view.plot("heatmap")
    assert heat is not None
    title = f"{view.model}: pairwise max |Δ|\nfirst step, over {view.first_step_scope}"
    figures.heatmap(labels, values, heat, title)
    worst = max(view.ok_pairs, key=headline)
    pair = Pair.from_result(worst)
    k = max(range(len(worst["prompts"])), key=lambda i: worst["prompts"][i]["max_abs"])
    prompt = worst["prompts"][k]["prompt"]
    head = (
        f"{view.link(heat, 'pairwise max |Δ|')}\n\n"
        f"Per-token |Δ| over the vocabulary for the largest pair, `{pair.a.label}` vs "
        f"`{pair.b.label}`, on prompt `{prompt}`:"
    )
    if view.first_step_top_k is not None:
        return f"{head} _not drawn: the runs keep no full first-step logits (`first_step_logits: top_k`)._"
    if pair.a not in view.logits or pair.b not in view.logits:  # a report re-rendered from records
        return f"{head} _not drawn: the runs' logits (`logits.npy`) are not available here._"
    hist = view.plot("largest-pair")
    assert hist is not None
    a, b = load_array(view.logits[pair.a])[k], load_array(view.logits[pair.b])[k]
    figures.delta_histogram(a, b, hist, f"{pair.a.label} vs {pair.b.label}, prompt {prompt}")
    return f"{head}\n\n{view.link(hist, 'per-token |Δ|')}"
