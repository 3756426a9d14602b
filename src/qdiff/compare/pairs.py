"""Compare the runs of one model, every pair of them (qdiff.core.records.PairResult).

``compare_model`` does a model's pairs in bulk: it reads each run's files once (the logits
memory-mapped), compares each prompt's logits of all runs in one sweep
(qdiff.compare.metrics.compare_rows), and takes from ``PairCache`` every pair whose input files are
byte-identical to those of a pair it compared before. So a model's comparison is one job, yet
a changed device recomputes only the pairs it is in.

First steps compare over the full vocabulary when both runs kept their logits, and otherwise
(``first_step_logits: top_k``) on their forced passes' position 0, over the teacher's top-k
tokens (qdiff.compare.forced.first_step_metrics); each pair says which in ``first_step_top_k``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qdiff.compare.forced import compare_forced, first_step_metrics, with_probabilities
from qdiff.compare.metrics import (
    PAIR_METRICS,
    check_comparable,
    compare_rows,
    fork_step,
    median,
    summarise,
)
from qdiff.core.hashcache import HashCache
from qdiff.core.io import load_arrays, read_json, write_json
from qdiff.core.labels import Combination, Pair
from qdiff.core.records import ErrorInfo, PairResult, Record
from qdiff.core.settings import relation


def label(record: Mapping[str, Any]) -> str:
    return Combination.from_record(record).label


def what_differs(a: Record, b: Record) -> list[str]:
    """The settings that differ between two runs, as "key a→b" (backend first)."""
    changes = []
    if a["dequant"] != b["dequant"]:
        changes.append(f"dequant {a['dequant']}→{b['dequant']}")
    sa, sb = a["settings"], b["settings"]
    for key in sorted(set(sa) | set(sb), key=lambda k: (k != "backend", k)):
        if sa.get(key) != sb.get(key):
            changes.append(f"{key} {_short(sa.get(key))}→{_short(sb.get(key))}")
    return changes


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "{}"
    return str(value)


def _head(rec_a: Record, rec_b: Record) -> PairResult:
    return {
        "model": rec_a["model"],
        "a": label(rec_a),
        "b": label(rec_b),
        "differs": what_differs(rec_a, rec_b),
        "relation": relation(rec_a["settings"], rec_b["settings"]),
    }


def _python(value: Any) -> Any:
    return bool(value) if isinstance(value, np.bool_) else float(value)


def shared_prompts(rec_a: Record, rec_b: Record) -> list[tuple[int, int]]:
    """(row in a, row in b) of every prompt both runs ran, in a's order."""
    ids_b = {p["id"]: i for i, p in enumerate(rec_b["prompts"])}
    return [(i, ids_b[p["id"]]) for i, p in enumerate(rec_a["prompts"]) if p["id"] in ids_b]


def not_comparable(rec_a: Record, rec_b: Record) -> PairResult | None:
    """The pair's "n/a" result when their first steps cannot be compared, else None."""
    not_ok = [f"{label(r)} {r['status']}" for r in (rec_a, rec_b) if r["status"] != "ok"]
    reason = "; ".join(not_ok) if not_ok else None
    if reason is None and not shared_prompts(rec_a, rec_b):
        reason = "no prompt in common"
    if reason is None:
        return None
    return {**_head(rec_a, rec_b), "status": "n/a", "reason": reason, "prompts": []}


def pair_result(
    rec_a: Record, rec_b: Record, rows: list[dict[str, Any]], top_k: int | None = None
) -> PairResult:
    """A comparable pair's result from its per-prompt metrics, in ``shared_prompts`` order;
    ``top_k``: the tokens they are over (None: the full vocabulary)."""
    values = {m.key: np.array([row[m.key] for row in rows]) for m in PAIR_METRICS}
    prompts = []
    for row, (i, j) in zip(rows, shared_prompts(rec_a, rec_b), strict=True):
        pa, pb = rec_a["prompts"][i], rec_b["prompts"][j]
        prompts.append(
            {
                "prompt": pa["id"],
                **{m.key: _python(row[m.key]) for m in PAIR_METRICS},
                "fork_step": fork_step(pa["tokens"], pb["tokens"]),
                "same_prompt_tokens": pa["n_prompt_tokens"] == pb["n_prompt_tokens"],
                "text_a": pa["text"],
                "text_b": pb["text"],
            }
        )
    forks = [p["fork_step"] for p in prompts if p["fork_step"] is not None]
    summary = {
        "n_prompts": len(prompts),
        **summarise(values),
        "forked": len(forks),
        "first_fork_step": min(forks) if forks else None,
        "median_fork_step": median(forks) if forks else None,
    }
    return {
        **_head(rec_a, rec_b),
        "status": "ok",
        "first_step_top_k": top_k,
        "summary": summary,
        "prompts": prompts,
    }


def compare_runs(
    rec_a: Record, logits_a: np.ndarray, rec_b: Record, logits_b: np.ndarray
) -> PairResult:
    """Everything the report and the pairs table need about one pair."""
    skipped = not_comparable(rec_a, rec_b)
    if skipped is not None:
        return skipped
    rows = []
    for i, j in shared_prompts(rec_a, rec_b):
        check_comparable(logits_a[i], logits_b[j])
        rows += compare_rows([logits_a[i], logits_b[j]], [(0, 1)])
    return pair_result(rec_a, rec_b, rows)


def compare_forced_runs(
    rec_a: Record,
    data_a: dict[str, np.ndarray],
    rec_b: Record,
    data_b: dict[str, np.ndarray],
) -> dict[str, Any]:
    """The teacher-forced part of a pair (qdiff.compare.forced), or why there is none."""
    not_ok = [f"{label(r)} {r['status']}" for r in (rec_a, rec_b) if r["status"] != "ok"]
    if not_ok:
        return {"status": "n/a", "reason": "teacher-forced " + "; ".join(not_ok)}
    if rec_a["prompt_ids"] != rec_b["prompt_ids"]:  # type: ignore[typeddict-item]
        return {"status": "n/a", "reason": "the forced passes ran different prompts"}
    result = compare_forced(data_a, data_b, rec_a["prompt_ids"])  # type: ignore[typeddict-item]
    return {"teacher": rec_a["teacher"], **result}  # type: ignore[typeddict-item]


def failed_pair(pair: Pair, error: ErrorInfo) -> PairResult:
    """A comparison that could not be computed: the report shows why, never "equal"."""
    return {
        "model": pair.model,
        "a": pair.a.label,
        "b": pair.b.label,
        "differs": [],
        "status": "failed",
        "reason": f"comparison failed: {error['message']}",
        "prompts": [],
    }


def headline(result: Mapping[str, Any]) -> float:
    """The number pairs are ranked by: the largest first-step max |Δ| over prompts."""
    return float(result["summary"]["max_abs_max"])


# ---- every pair of a model, in bulk ----


@dataclass(frozen=True)
class RunFiles:
    """What a comparison reads of one combination: its run and its teacher-forced pass."""

    record: Path
    logits: Path | None  # None: the run kept no first-step logits (first_step_logits: top_k)
    forced_record: Path | None = None
    forced: Path | None = None

    def paths(self) -> list[Path]:
        return [p for p in (self.record, self.logits, self.forced_record, self.forced) if p]


class _Run:
    """One combination's files, each read at most once. A failure to read one is kept and
    raised again for every pair that needs it, so only those pairs fail."""

    def __init__(self, files: RunFiles) -> None:
        self.files = files
        self._loaded: dict[str, Any] = {}

    def _get(self, name: str, load: Callable[[], Any]) -> Any:
        if name not in self._loaded:
            try:
                self._loaded[name] = load()
            except Exception as exc:  # kept, raised for each pair that needs it
                self._loaded[name] = exc
        value = self._loaded[name]
        if isinstance(value, Exception):
            raise value
        return value

    @property
    def record(self) -> Record:
        record: Record = self._get("record", lambda: read_json(self.files.record))
        return record

    @property
    def logits(self) -> np.ndarray:
        """(prompts, vocab), memory-mapped: a prompt's row is read when it is compared."""
        path = self.files.logits
        assert path is not None
        logits: np.ndarray = self._get(
            "logits", lambda: np.load(path, mmap_mode="r", allow_pickle=False)
        )
        return logits

    def forced_row(self, prompt: str) -> int:
        """The row of ``prompt`` in the forced pass's arrays."""
        return list(self.forced_record["prompt_ids"]).index(prompt)  # type: ignore[typeddict-item]

    @property
    def forced_record(self) -> Record:
        path = self.files.forced_record
        assert path is not None
        record: Record = self._get("forced_record", lambda: read_json(path))
        return record

    @property
    def forced_data(self) -> dict[str, np.ndarray]:
        """The forced pass's arrays with their slice probabilities, computed once for all the
        pairs this run is in."""
        path = self.files.forced
        assert path is not None
        data: dict[str, np.ndarray] = self._get(
            "forced", lambda: with_probabilities(load_arrays(path))
        )
        return data


class Progress:
    """A line every ``interval`` seconds while a model's pairs are compared."""

    def __init__(self, total: int, say: Callable[[str], None], interval: float = 10.0) -> None:
        self.total, self.say, self.interval = total, say, interval
        self.done = 0
        self.start = self.last = time.monotonic()

    def step(self, done: int) -> None:
        self.done += done
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self.say(f"compared {self.done}/{self.total} prompt-pairs ({self.rate():.0f}/s)")

    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.start, 1e-9)


class NotComparable(Exception):
    """A pair whose first steps cannot be compared, and why: its result is "n/a"."""


def slice_top_k(pair: Pair, runs: Mapping[Combination, _Run]) -> int | None:
    """How many tokens a pair's first steps compare over: None for the full vocabulary
    (both runs kept their logits), else the forced passes' top-k (NotComparable if those
    did not run)."""
    a, b = runs[pair.a], runs[pair.b]
    if a.files.logits is not None and b.files.logits is not None:
        return None
    if a.files.forced is None or b.files.forced is None:
        raise NotComparable("no first-step logits and no teacher-forced passes to compare")
    if a.forced_record["status"] != "ok" or b.forced_record["status"] != "ok":
        not_ok = [f"{c.label} {r.forced_record['status']}" for c, r in ((pair.a, a), (pair.b, b))]
        raise NotComparable(
            "first steps are kept only in the teacher-forced passes (first_step_logits: "
            f"top_k), and they did not both run: {'; '.join(not_ok)}"
        )
    return int(a.forced_record["top_k"])  # type: ignore[typeddict-item]


def _first_steps(
    pairs: list[Pair], runs: dict[Combination, _Run], say: Callable[[str], None]
) -> tuple[dict[Pair, Any], Progress]:
    """Each comparable pair's per-prompt metrics (a list in ``shared_prompts`` order), or the
    exception that stopped it, and how many prompt-pairs it compared how fast. Prompt by
    prompt, so each run's row is prepared once for all its pairs, and only one prompt's rows
    are in memory."""
    plan: dict[str, list[tuple[Pair, int, int]]] = {}
    rows: dict[Pair, Any] = {}
    sliced: set[Pair] = set()  # compared on the forced passes' position 0
    for pair in pairs:
        try:
            rec_a, rec_b = runs[pair.a].record, runs[pair.b].record
            if not_comparable(rec_a, rec_b) is None:
                if slice_top_k(pair, runs) is not None:  # or NotComparable, before any work
                    sliced.add(pair)
                rows[pair] = {}
                for i, j in shared_prompts(rec_a, rec_b):
                    plan.setdefault(rec_a["prompts"][i]["id"], []).append((pair, i, j))
        except Exception as exc:  # this pair fails (or is n/a), the others go on
            rows[pair] = exc
    progress = Progress(sum(len(work) for work in plan.values()), say)
    for prompt, work in plan.items():
        _compare_prompt(prompt, work, runs, rows, sliced)
        progress.step(len(work))
    first = {
        pair: value if isinstance(value, Exception) else [value[i] for i in sorted(value)]
        for pair, value in rows.items()
    }
    return first, progress


def _compare_prompt(
    prompt: str,
    work: list[tuple[Pair, int, int]],
    runs: dict[Combination, _Run],
    rows: dict[Pair, Any],
    sliced: set[Pair],
) -> None:
    """One prompt's pairs: each run's row read once, and all pairs of rows of one shape in
    one sweep (qdiff.compare.metrics.compare_rows); a pair in ``sliced``: its forced passes' position
    0 instead. A pair that cannot be compared fails alone."""
    logits: dict[tuple[Combination, int], Any] = {}  # a row, or why it could not be read

    def row(combo: Combination, index: int) -> np.ndarray:
        if (combo, index) not in logits:
            try:
                logits[combo, index] = np.asarray(runs[combo].logits[index])
            except Exception as exc:  # kept: every pair with this run fails
                logits[combo, index] = exc
        value = logits[combo, index]
        if isinstance(value, Exception):
            raise value
        return value

    by_shape: dict[tuple[int, ...], list[tuple[Pair, int, np.ndarray, np.ndarray]]] = {}
    for pair, i, j in work:
        if isinstance(rows[pair], Exception):
            continue
        try:
            if pair in sliced:
                a_run, b_run = runs[pair.a], runs[pair.b]
                rows[pair][i] = first_step_metrics(
                    a_run.forced_data,
                    b_run.forced_data,
                    a_run.forced_row(prompt),
                    b_run.forced_row(prompt),
                )
                continue
            a, b = row(pair.a, i), row(pair.b, j)
            check_comparable(a, b)
            by_shape.setdefault(a.shape, []).append((pair, i, a, b))
        except Exception as exc:  # this pair fails, the others go on
            rows[pair] = exc
    for group in by_shape.values():
        _sweep(group, rows)


def _sweep(group: list[tuple[Pair, int, np.ndarray, np.ndarray]], rows: dict[Pair, Any]) -> None:
    """One sweep (qdiff.compare.metrics.compare_rows) for the pairs of rows of one shape,
    each row once; if it fails, its pairs fail and the others go on."""
    arrays: dict[int, np.ndarray] = {}  # id -> row
    for _, _, a, b in group:
        arrays.setdefault(id(a), a)
        arrays.setdefault(id(b), b)
    index = {key: n for n, key in enumerate(arrays)}
    try:
        values = compare_rows(
            list(arrays.values()), [(index[id(a)], index[id(b)]) for _, _, a, b in group]
        )
    except Exception as exc:
        for pair, *_ in group:
            rows[pair] = exc
        return
    for (pair, i, _, _), value in zip(group, values, strict=True):
        rows[pair][i] = value


def _assemble(pair: Pair, runs: dict[Combination, _Run], first: Any) -> PairResult:
    rec_a, rec_b = runs[pair.a].record, runs[pair.b].record
    if isinstance(first, NotComparable):
        return {**_head(rec_a, rec_b), "status": "n/a", "reason": str(first), "prompts": []}
    if isinstance(first, Exception):
        raise first
    result = not_comparable(rec_a, rec_b) or pair_result(
        rec_a, rec_b, first, slice_top_k(pair, runs)
    )
    if runs[pair.a].files.forced is not None:
        a, b = runs[pair.a], runs[pair.b]
        both = a.forced_record["status"] == b.forced_record["status"] == "ok"
        result["forced"] = compare_forced_runs(
            a.forced_record,
            a.forced_data if both else {},
            b.forced_record,
            b.forced_data if both else {},
        )
    return result


def compare_model(
    pairs: list[Pair],
    files: Mapping[Combination, RunFiles],
    cache: PairCache | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> list[PairResult]:
    """Every pair's result, in ``pairs`` order. A pair that cannot be computed is "failed",
    saying why, and the others are still compared."""
    runs = {combo: _Run(f) for combo, f in files.items()}
    results: dict[Pair, PairResult] = {}
    keys = {p: cache.key(files[p.a], files[p.b]) if cache else None for p in pairs}
    for pair in pairs:
        cached = cache.get(keys[pair]) if cache else None
        if cached is not None:
            results[pair] = cached
    pending = [p for p in pairs if p not in results]
    first, progress = _first_steps(pending, runs, say)
    for pair in pending:
        try:
            results[pair] = _assemble(pair, runs, first.get(pair))
        except Exception as exc:  # this pair fails, the others go on
            message = f"{type(exc).__name__}: {exc}"
            results[pair] = failed_pair(pair, {"kind": "error", "message": message})
        if cache:
            cache.put(keys[pair], results[pair])
    say(
        f"compared {len(pending)} pairs ({progress.done} prompt-pairs, {progress.rate():.0f}/s);"
        f" reused {len(pairs) - len(pending)} pairs whose files did not change"
    )
    return [results[p] for p in pairs]


CACHE_DIR = Path(".snakemake/qdiff/compare")


class PairCache:
    """Finished comparisons by the content of what they read: the SHA-256 of each input
    file and the comparison's own code (``code``, the rule's param: qdiff.workflow's digest
    of the modules it runs). An entry is reused only for byte-identical inputs, so a
    reused pair is exactly the pair computed again. One file per model (``CACHE_DIR``)
    holds the pairs of its latest comparison; losing it only costs time."""

    def __init__(self, path: Path, code: str, hashes: HashCache | None = None) -> None:
        self.path = path
        self.hashes = hashes or HashCache()
        self.code = code
        try:
            stored = read_json(path)
            self.entries = stored["pairs"] if stored["code"] == self.code else {}
        except (OSError, ValueError, KeyError, TypeError):
            self.entries = {}
        self.kept: dict[str, PairResult] = {}

    @classmethod
    def of_model(cls, model: str, code: str) -> PairCache:
        return cls(CACHE_DIR / f"{model}.json", code)

    def key(self, a: RunFiles, b: RunFiles) -> str | None:
        try:
            digests = [[self.hashes.sha256(p) for p in side.paths()] for side in (a, b)]
        except OSError:
            return None  # unreadable: computed (and failed) again, never cached
        return hashlib.sha256(json.dumps([self.code, digests]).encode()).hexdigest()

    def get(self, key: str | None) -> PairResult | None:
        if key is None or key not in self.entries:
            return None
        self.kept[key] = self.entries[key]
        return self.kept[key]

    def put(self, key: str | None, result: PairResult) -> None:
        if key is not None and result["status"] != "failed":  # a failure may be transient
            self.kept[key] = result

    def save(self) -> None:
        write_json(self.path, {"code": self.code, "pairs": self.kept})
        self.hashes.save()
