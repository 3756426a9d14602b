"""The harness every workflow script runs in (``qdiff.jobs.run``).

It gives each job the same guarantees, whatever the stage:

- **its own log**: stderr, native code's included, goes to the rule's log file;
- **one failure path**: an exception in the job's body is logged with its traceback and
  turned into the stage's failure outputs (a record that says what failed and what to do),
  so the job succeeds and everything downstream, the report included, still runs and names
  the failure;
- **no stray writers**: the job dies with the Snakemake process that started it (Linux's
  parent-death signal, or a watchdog where a shell stands in between), and so do the
  processes it starts (``child_preexec``), so a killed workflow leaves nothing running;
- **no half results, no late overwrites**: outputs are written under staging names and
  renamed into place together at the end, under a claim that the newest job of an output
  holds; a job that has been superseded (a rerun started after it) discards its outputs;
- **no work done twice** (``reuse``): a job whose rule, params and input files' content are
  those its existing outputs were made from keeps them (``inputs_key``). Snakemake plans
  every job downstream of one that runs before it can know that job's result will be the
  same, e.g. a model file made again, byte for byte, after ``rm -rf resources/``; such jobs
  then cost a process start, not their inference. Their rules mark the outputs
  ``update()``, so that Snakemake leaves them in place for the job to keep.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import sys
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qdiff.core import secrets

if TYPE_CHECKING:
    pass

from qdiff.jobs.limits import disk_full
from qdiff.jobs.processes import console, die_with_workflow, log_to, skip_exit_collection

CLAIMS_DIR = Path(".snakemake/qdiff/claims")
_STAGING = ".staging"


class Claim:
    """Who may write an output: the newest job that started for it.

    A job takes the claim when it starts and renames its staged files into place only while
    it still holds it, under a lock, so a job that outlived its workflow can never overwrite
    what a later run wrote."""

    def __init__(self, output: Path, token: str) -> None:
        name = hashlib.sha1(str(output).encode()).hexdigest()
        self.path = CLAIMS_DIR / f"{name}.claim"
        self.token = token

    @contextmanager
    def _locked(self) -> Iterator[Any]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as f:
            fcntl.lockf(f, fcntl.LOCK_EX)
            try:
                yield f
            finally:
                fcntl.lockf(f, fcntl.LOCK_UN)

    def take(self) -> None:
        with self._locked() as f:
            f.seek(0)
            f.truncate()
            f.write(self.token)
            f.flush()

    @contextmanager
    def held(self) -> Iterator[bool]:
        """While the lock is held: whether this job still holds the claim."""
        with self._locked() as f:
            f.seek(0)
            yield f.read() == self.token


def staging_path(output: Path, token: str) -> Path:
    return output.with_name(f".{output.name}.{token[:12]}{_STAGING}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            _remove(child)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)


class Job:
    """One running job: its outputs, staged until ``commit``."""

    def __init__(self, outputs: list[str], log: str | None, token: str | None = None) -> None:
        self.token = token or uuid.uuid4().hex
        self.outputs = [Path(p) for p in outputs]
        self.log_path = Path(log) if log else None
        self.claim = Claim(self.outputs[0], self.token)
        self.claim.take()
        for output in self.outputs:  # staging left behind by killed jobs of this output
            for stale in output.parent.glob(f".{output.name}.*{_STAGING}"):
                _remove(stale)
            output.parent.mkdir(parents=True, exist_ok=True)

    def out(self, output: str | Path) -> Path:
        """Where to write ``output`` (one of the job's outputs) until the job commits."""
        return staging_path(Path(output), self.token)

    def discard(self) -> None:
        for output in self.outputs:
            _remove(self.out(output))

    def commit(self, placeholder: Callable[[Path, Path], None]) -> bool:
        """Rename every staged output into place if this job still holds the claim (an
        output the job did not write gets ``placeholder(output, staged)``); otherwise
        discard them."""
        for output in self.outputs:
            staged = self.out(output)
            if not staged.exists() and not staged.is_symlink():
                placeholder(output, staged)
        with self.claim.held() as mine:
            if not mine:
                self.discard()
                print(
                    "[qdiff] a newer job for these outputs started after this one: "
                    "its outputs are kept and this job's are discarded",
                    file=sys.stderr,
                )
                return False
            for output in self.outputs:
                if output.is_dir() and not output.is_symlink():
                    _remove(output)  # os.replace cannot replace a non-empty directory
                os.replace(self.out(output), output)
        return True


class StageError(RuntimeError):
    """A failure whose message already says what went wrong and what to do: shown as is."""


class StopWorkflow(Exception):
    """A failure that must stop the workflow (e.g. strict_devices): the job fails."""


def empty_placeholder(output: Path, staged: Path) -> None:
    """An empty ``output`` (written at ``staged``) for a job that failed before writing it:
    its record (or sidecar) says why. Arrays are empty arrays, anything else an empty file."""
    if output.suffix in (".npy", ".npz"):
        import numpy as np  # only here: most jobs never need it

        with open(staged, "wb") as f:
            if output.suffix == ".npy":
                np.save(f, np.zeros((0, 0), dtype=np.float32), allow_pickle=False)
            else:
                np.savez(f)
    else:
        staged.write_bytes(b"")


def error_info(
    exc: BaseException, stage: str, folder: Path = Path(), log: str | None = None
) -> dict[str, Any]:
    """What a failure record says about an exception: what failed and where, without a
    hidden value or a URL's query (qdiff.core.secrets.scrub_message); a full disk in plain
    words (``folder``: where the job writes); an unexpected error with where its traceback
    is (``log``, the job's log)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        message = disk_full(folder)
    elif isinstance(exc, StageError):
        message = str(exc)
    else:
        message = f"{type(exc).__name__}: {exc}" + (f" (its traceback: {log})" if log else "")
    error = {"kind": "error", "stage": stage, "message": secrets.scrub_message(message)}
    return error | ({"log": log} if log else {})


INPUTS_KEY = "inputs_key"  # in an ok record: what its job's outputs were made of


def inputs_key(smk: Any) -> str:
    """What a job's outputs are made of, as one digest: its rule and outputs, its params but
    the retry token, and its input files' content. A JSON file counts by its fields but its
    run token; a GGUF model by its sidecar, also an input, whose sha256 planning checks
    against the file's bytes (qdiff.sources.made_file_problem); any other file by its bytes
    (qdiff.core.hashcache: hashed again only when its identity on disk changed)."""
    from qdiff.core.hashcache import HashCache

    hashes = HashCache()
    digest = hashlib.sha256(f"{smk.rule}\n{list(smk.output)}".encode())
    for name, value in smk.params.items():
        if name != "retry_token":
            digest.update(f"\n{name}={value!r}".encode())
    for name in smk.input:
        path = Path(name)
        if path.suffix == ".gguf":
            content = "its sidecar"
        elif path.suffix == ".json":
            fields = json.loads(path.read_text())
            if isinstance(fields, dict):
                fields.pop("run_token", None)
            content = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        else:
            content = hashes.sha256(path)
        digest.update(f"\n{path}\t{content}".encode())
    hashes.save()
    return digest.hexdigest()


def _kept(job: Job, key: str) -> bool:
    """Whether the job's existing outputs were made of ``key`` by a job that ended ok."""
    try:
        record = json.loads(job.outputs[0].read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("status") == "ok"
        and record.get(INPUTS_KEY) == key
        and all(o.exists() for o in job.outputs)
    )


def _with_key(staged: Path, key: str) -> None:
    """Write ``key`` into a staged ok record (a failure is never kept: it is retried)."""
    from qdiff.core.io import read_json, write_json

    record = read_json(staged)
    if record.get("status") == "ok":
        write_json(staged, {**record, INPUTS_KEY: key})


def run(
    smk: Any,
    body: Callable[[Job], None],
    on_failure: Callable[[Job, dict[str, Any]], None],
    directories: tuple[str, ...] = (),
    reuse: bool = False,
    committed: Callable[[], None] | None = None,
) -> None:
    """Run a workflow script's ``body`` in the harness (see the module's docstring).

    ``smk`` is the script's ``snakemake`` object; ``on_failure(job, error)`` writes the
    stage's failure outputs with ``job.out``; outputs it leaves unwritten get empty
    placeholders (``directories`` names the outputs that are directories). With ``reuse``
    the first output is the job's JSON record, and outputs made of the same inputs are kept;
    ``committed()`` runs once the outputs are in place."""
    skip_exit_collection()
    log_to(smk.log[0])
    die_with_workflow()
    job = Job(list(smk.output), smk.log[0] if smk.log else None)
    key = inputs_key(smk) if reuse else None
    if key is not None and _kept(job, key):
        for output in job.outputs:
            os.utime(output)  # newer than the inputs that were made again
        console(
            f"[qdiff] {smk.rule} {dict(smk.wildcards.items())}: kept its outputs, made of "
            "these very inputs and params"
        )
        return
    try:
        body(job)
    except StopWorkflow:
        job.discard()
        raise
    except Exception as exc:  # the one failure path: record it, never lose the report
        print(secrets.scrub_message(traceback.format_exc()), file=sys.stderr)
        job.discard()
        log = str(job.log_path) if job.log_path else None
        error = error_info(exc, smk.rule, job.outputs[0].parent, log)
        on_failure(job, error)
    if key is not None and job.out(job.outputs[0]).exists():
        _with_key(job.out(job.outputs[0]), key)

    def placeholder(output: Path, staged: Path) -> None:
        if str(output) in directories:
            staged.mkdir()
        else:
            empty_placeholder(output, staged)

    if job.commit(placeholder) and committed is not None:
        committed()
