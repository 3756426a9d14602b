"""The serving cases: how a server may decode one prompt (the *needle*) other than alone.

Each case decodes the needle greedily under one serving condition and is compared, step by
step, with the *reference*: the needle alone in a fresh context with the combination's own
settings (qdiff.engine.serving runs both). The conditions follow what llama-server does by
default and what its users meet: other requests in the same batch, a unified or a split KV
cache, requests arriving one after another, the prompt computed in smaller ubatches, a
prompt-cache hit on a prefix, another thread count. This module only names the cases; it
loads nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# what each kind of case does, for the report's legend and the docs
KINDS = {
    "repeat": "the reference again, in a new context of the same process",
    "process": "the run stage's own process: the first step's logits (by digest; the run "
    "keeps no later step's) and the greedy tokens",
    "batch": "the needle as one sequence among k others of varied lengths, prefilled in one "
    "batch and decoded together step by step, with a unified KV cache (llama-server's "
    "default, kv_unified) or one split by sequence",
    "staggered": "the k others prefilled first (the cache already holds them), then the "
    "needle, then all decoded together (unified KV cache)",
    "ubatch": "the prompt computed in ubatches of n tokens (n_ubatch), then decoded alone",
    "prefix": "a prompt-cache hit: the first half of the prompt prefilled for another "
    "sequence, copied to the needle's (llama_memory_seq_cp), then the rest prefilled",
    "threads": "one user turn of other prompts' texts and then the needle's, of at least "
    "long_prompt_tokens tokens, with 1 thread against the device's count (its own reference: "
    "the same long prompt with the device's threads)",
}
DEFAULT_KINDS = ("repeat", "process", "batch", "staggered", "ubatch", "prefix", "threads")


@dataclass(frozen=True)
class Case:
    id: str  # e.g. "batch-3", "batch-3-split", "ubatch-1"
    kind: str  # a key of KINDS
    others: int = 0  # batch, staggered: how many other sequences
    kv_unified: bool = True  # batch, staggered, prefix
    n_ubatch: int = 0  # ubatch
    threads: int = 0  # threads

    @property
    def label(self) -> str:
        """How the report names it."""
        return {
            "repeat": "again, new context",
            "process": "again, new process",
            "batch": f"batch of 1 + {self.others}, "
            + ("unified KV" if self.kv_unified else "split KV"),
            "staggered": f"after {self.others} others, unified KV",
            "ubatch": f"n_ubatch {self.n_ubatch}",
            "prefix": "prefix from the prompt cache",
            "threads": f"{self.threads} thread, long prompt",
        }[self.kind]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label}


def cases(serving: dict[str, Any]) -> list[Case]:
    """The cases a ``serving:`` config asks for, in the order the report shows them."""
    made: list[Case] = []
    for kind in serving["cases"]:
        if kind in ("repeat", "process", "prefix"):
            made.append(Case(kind, kind))
        elif kind == "batch":
            for k in serving["others"]:
                made.append(Case(f"batch-{k}", kind, others=k))
                made.append(Case(f"batch-{k}-split", kind, others=k, kv_unified=False))
        elif kind == "staggered":
            made += [Case(f"staggered-{k}", kind, others=k) for k in serving["others"]]
        elif kind == "ubatch":
            made += [Case(f"ubatch-{n}", kind, n_ubatch=n) for n in serving["n_ubatch"]]
        elif kind == "threads":
            made.append(Case("threads-1", kind, threads=1))
    return made
