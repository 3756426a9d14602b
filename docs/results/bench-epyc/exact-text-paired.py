"""The exact engine along the default experiment's text, as its exact_text job computes it
(qdiff.exact.reference.reference over the teacher's windows, keeping the teacher's slice),
in this process, for one model: the forward pass's seconds and the peak resident memory.
Run from the repository's root after the default experiment (results/ and resources/),
with the code to time on PYTHONPATH, alternating two checkouts so that both see the same
machine:
    PYTHONPATH=<checkout>/src .venv/bin/python docs/results/bench-epyc/exact-text-paired.py MODEL LAYER_BY_LAYER
"""

import resource
import sys
import time
from pathlib import Path

from qdiff.core.io import load_arrays, read_json
from qdiff.core.text import LEADING_KEPT, as_run
from qdiff.exact.reference import reference

model, layer_by_layer = sys.argv[1], sys.argv[2] == "1"
text = Path(f"results/text/{model}/cpu/f32")
record = read_json(text / "record.json")
arrays = load_arrays(text / "text.npz")
run = as_run(arrays["window_tokens"].tolist(), record["generation"]["n_ctx"])
start = time.perf_counter()
out, _ = reference(
    Path(f"resources/models/{model}.gguf"),
    run,
    arrays["slice_ids"],
    0,
    layer_by_layer,
    LEADING_KEPT,
    keep_first=False,
)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(
    f"{model} layer_by_layer={layer_by_layer}: forward {out['timings']['forward_s']:.2f} s, "
    f"total {time.perf_counter() - start:.2f} s, peak {peak:.0f} MiB"
)
