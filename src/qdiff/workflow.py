"""What the Snakefile runs in Snakemake's own process, beside the rules."""

from __future__ import annotations

import ast
import fcntl
import functools
import hashlib
import inspect
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

import snakemake.common

F = TypeVar("F", bound=Callable[..., object])
WORKFLOW_LOCK = Path(".snakemake/qdiff/workflow.lock")
_held: IO[str] | None = None  # open for as long as this process runs the workflow


class WorkflowRunningError(RuntimeError):
    """Another Snakemake runs this workflow in this directory."""


def hold_workflow_lock(path: Path = WORKFLOW_LOCK) -> None:
    """Run jobs in this directory only while holding its lock: an exclusive ``flock`` held
    until this process ends (the kernel releases it however the process ends, a kill
    included). Snakemake's own lock checks, then writes, so two workflows started at the
    same instant can both pass it and run every job twice. Called by the workflow's onstart
    handler, which runs only when jobs are about to run (not for a dry run, --report,
    --unlock, ...), in Snakemake's main process."""
    global _held  # noqa: PLW0603 - one lock per process, held until it exits
    if _held is not None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - held open until the process exits
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise WorkflowRunningError(
            f"another snakemake is running this workflow in {Path.cwd()} ({holder}): "
            "wait for it to end, or stop it; two at once would run every job twice"
        ) from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _held = handle


def end_scheduler_timers() -> None:
    """Cancel the timers Snakemake's scheduler has left (its job rate limit,
    ``--max-jobs-per-timespan``, re-arms a 1 s ``threading.Timer`` on every pass). Python
    waits for them at exit, so without this every run that ran jobs ended about a second
    after its last job. Called by the workflow's onsuccess and onerror handlers."""
    for thread in threading.enumerate():
        if isinstance(thread, threading.Timer) and getattr(
            thread.function, "__module__", ""
        ).startswith("snakemake."):
            thread.cancel()


def signature_once(func: F) -> F:
    """``func``, a rule's per-job function, with its signature worked out now, once.

    Snakemake asks for a job function's parameters (``inspect.signature``) two or three
    times every time it calls it: about 11,000 times for qdiff's functions in planning a
    matrix of 10 models x 10 devices x 3 dequant modes x 30 prompts. Asking once saved 4%
    of that planning's time on a 2-core AMD EPYC (Python 3.11) and nothing measurable on
    the H200 host (Python 3.12; docs/performance.md). Its own wrappers hand it their
    signature once through ``snakemake.common.overwrite_function_params``; so does this. A
    Snakemake without that hook asks as before."""
    overwrite = getattr(snakemake.common, "overwrite_function_params", None)
    if overwrite is not None:
        overwrite(func, inspect.signature(func).parameters)
    return func


CODE_CACHE = Path(".snakemake/qdiff/code.json")


def code_digests(scripts: list[Path], cache_file: Path = CODE_CACHE) -> dict[str, str]:
    """``code_digest`` of each script, by its name without suffix. Worked out again only
    when a file of qdiff or a script changed (their sizes and mtimes are the cache's key):
    parsing every module costs about 0.3 s, a tenth of a second on every invocation."""
    files = sorted([*_ROOT.rglob("*.py"), *scripts])
    identity = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    try:
        cached = json.loads(cache_file.read_text())
        if cached["identity"] == identity:
            return dict(cached["digests"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digests = {s.stem: code_digest(s) for s in scripts}
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"identity": identity, "digests": digests}))
    os.replace(tmp, cache_file)
    return digests


def code_digest(script: str | Path) -> str:
    """A digest of the qdiff code ``script`` runs: the qdiff modules it imports, and theirs,
    and every module of each package among them (a package may load its own modules by
    name: the report's stage sections), each as its syntax tree without docstrings, so that
    a comment, a docstring or a reformat reruns nothing and any change to what the code
    does reruns the rule's jobs. A rule takes it as its ``code`` param: Snakemake reruns a
    ``script:`` rule's jobs when the script changes, not when a module it imports does."""
    digest = hashlib.sha256()
    for module in sorted(_imported_closure(_qdiff_imports(Path(script)))):
        digest.update(f"{module}\n{_module_tree(module)[0]}\n".encode())
    return digest.hexdigest()[:16]


_ROOT = Path(__file__).resolve().parent  # src/qdiff


def _module_file(module: str) -> Path | None:
    """The source file of a qdiff module (``qdiff.a.b``), or None if it is not one."""
    parts = module.split(".")[1:]
    for candidate in (
        _ROOT.joinpath(*parts).with_suffix(".py"),
        _ROOT.joinpath(*parts, "__init__.py"),
    ):
        if candidate.is_file():
            return candidate
    return None


def _qdiff_imports(path: Path) -> set[str]:
    """The qdiff modules a file imports, anywhere in it (a function's lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "qdiff"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "qdiff":
            found.add(str(node.module))
            # `from qdiff.x import y`: y may be a module of its own
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if _module_file(m) is not None}


@functools.cache
def _module_tree(module: str) -> tuple[str, frozenset[str]]:
    """A module's syntax tree without docstrings, as text, and the qdiff modules it imports."""
    path = _module_file(module)
    assert path is not None, module
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body[0] = ast.Pass()
    imports = _qdiff_imports(path)
    # a package's __init__ runs first when any module of it is imported
    imports |= {".".join(module.split(".")[:i]) for i in range(2, module.count(".") + 1)}
    if path.name == "__init__.py" and module != "qdiff":  # a package: every module of it
        imports |= {f"{module}.{p.stem}" for p in path.parent.glob("*.py") if p.name != path.name}
        imports |= {f"{module}.{p.parent.name}" for p in path.parent.glob("*/__init__.py")}
    return ast.dump(tree), frozenset(m for m in imports if _module_file(m) is not None)


def _imported_closure(modules: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_module_tree(module)[1])
    return seen
