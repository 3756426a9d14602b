"""The exact engine against llama.cpp on the tiny model of every architecture of its table
(tests/tinymodel.VARIANTS), as tests/test_exact.py measures it, printed: the largest
|exact - llama.cpp| over 6 forced positions relative to the logits' scale, and each wrong
variant's. From the repository's root, in a checkout set up with ./setup:

    .venv/bin/python docs/results/architectures/gaps.py
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import test_exact as t
from qdiff.core.roundings import Roundings
from tinymodel import VARIANTS, write_variant

folder = Path(tempfile.mkdtemp())
print("| tiny model | architecture | exact vs llama.cpp | without the fp16 GELU table |")
print("|---|---|---|---|")
for name, variant in VARIANTS.items():
    path = write_variant(folder / f"{name}.gguf", name)
    plain = ""
    if t.exact_model(path).hp.arch.activation == "gelu":
        plain = f"{t.gap(path, lambda p: t.exact_model(p, Roundings())):.1e}"
    print(f"| {name} | {variant.arch} | {t.gap(path):.1e} | {plain} |")
print("\n| tiny model | wrong variant | exact vs llama.cpp |\n|---|---|---|")
(marks,) = [m for m in t.test_a_wrong_engine_fails.pytestmark if m.name == "parametrize"]
for param in marks.args[1]:
    name, make = param.values
    print(f"| {name} | {param.id} | {t.gap(folder / f'{name}.gguf', make):.2g} |")
