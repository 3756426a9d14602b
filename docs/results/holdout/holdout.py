"""Do the default experiment's tolerances hold on prompts they were not derived from?

python docs/results/holdout/holdout.py <results of the default experiment> <results of the
same experiment over all 32 prompts of config/prompts.yaml>

For each model and each tolerance the report recommends from its 12 prompts (qdiff.judge.
tolerance), each of the other 20 prompts' largest difference (its first step over the full
vocabulary and its forced positions over the kept top-k, the largest over the tolerance's
pairs) against that atol: how many exceed it, and by how much; then the report's
own estimate of the same (an atol from a random half of the prompts, on the other half),
from the 12 prompts and from all 32."""

import json
import sys
from pathlib import Path

from qdiff.compare.stats import wilson
from qdiff.judge.tolerance import held_out, tolerances, worst_by_prompt


def pairs(results: Path, model: str) -> list[dict]:
    return json.loads((results / f"compare/{model}.json").read_text())["pairs"]


def groups(model_pairs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    by_pair = {(p["a"], p["b"]): p for p in model_pairs}
    return {
        (t.scope, t.dequant): [by_pair[tuple(name.split(" vs "))] for name in t.pairs]
        for t in tolerances(model_pairs)
    }


quick, full = Path(sys.argv[1]), Path(sys.argv[2])
for path in sorted(quick.glob("compare/*.json")):
    model = path.stem
    derived = {(t.scope, t.dequant): t for t in tolerances(pairs(quick, model))}
    for key, group in groups(pairs(full, model)).items():
        t = derived[key]
        worst = worst_by_prompt(group)
        quick_ids = {q["prompt"] for q in pairs(quick, model)[0]["prompts"]}
        new = {k: v for k, v in worst.items() if k not in quick_ids}
        over = {k: v for k, v in new.items() if v > t.atol}
        low, high = wilson(len(new) - len(over), len(new))
        split_quick, split_full = t.held_out, held_out(group)
        print(
            f"{model} | {key[0]} | {key[1]} | atol {t.atol:g} (from {len(quick_ids)} prompts, "
            f"largest {t.largest:.3g}) | new prompts within: {len(new) - len(over)}/"
            f"{len(new)} ({low:.0%}-{high:.0%}); over: "
            + (", ".join(f"{k} {v:.3g}" for k, v in sorted(over.items())) or "none")
            + f"; largest new {max(new.values()):.3g} | halves: {split_quick.prompt_within:.0%} "
            f"on the 12, {split_full.prompt_within:.0%} on all 32; set by "
            f"{split_quick.set_by}, {split_quick.atol_without_it:g} without it"
        )
