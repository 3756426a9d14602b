"""What qdiff may show of the values a user configures, and how the rest travels.

Snakemake prints a rule's parameters when they change, stores them in ``.snakemake/``, and
pickles the whole config into every job's script. So a value that may be secret must never
reach Snakemake in clear. qdiff decides by name, the safe way round:

- environment variables that qdiff knows as numerics settings (``GGML_*``, ``CUDA_*``,
  ``NVIDIA_TF32_OVERRIDE``, ``VK_*``, ``OMP_*``, ... and no secret-looking word in the name)
  are shown in clear everywhere;
- every other value of a device's ``env:``, and the query string and any credentials of a
  model URL, is replaced, before Snakemake sees the config, by a placeholder
  ``<hidden:digest>``. The digest is an HMAC of the value under a random key kept in the
  working directory, so it changes when the value does (its jobs rerun) and reveals nothing.

The real values stay in the memory of the Snakemake process that parsed the config. It
serves them (``serve``) on a Unix socket in a private folder; the socket's path, which is no
secret, is all that its jobs inherit (``QDIFF_VAULT``). Only the process that needs a value
asks for it (``reveal``): the download, and the supervisor that starts a llama.cpp worker with
its device's environment. A value a process has revealed is taken out again (``scrub``) of
whatever it writes: records, logs, the console. Error text is scrubbed further
(``scrub_message``): any URL in it loses its query, fragment and credentials, which may be
secrets qdiff was never told about (a redirect's signed URL).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import re
import secrets as random
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

_SETTING_PREFIXES = (
    "GGML_",
    "LLAMA_",
    "CUDA_",
    "CUBLAS_",
    "NVIDIA_TF32_OVERRIDE",
    "VK_",
    "MESA_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "HIP_",
    "ROCR_",
    "HSA_",
    "MTL_",
    "METAL_",
    "SYCL_",
    "ONEAPI_",
    "ZES_",
    "__GL_",
)
_SECRET_WORD = re.compile(
    r"TOKEN|SECRET|PASS|PWD|KEY|CRED|AUTH|COOKIE|SESSION|SIGN|PRIVATE|CERT|API|BEARER", re.I
)
PLACEHOLDER = re.compile(r"<hidden:([0-9a-f]{16})>")
VAULT_ENV = "QDIFF_VAULT"  # the path of the socket that serves hidden values (no secret)
KEY_FILE = "resources/.qdiff-digest-key"
# an environment variable's name as POSIX writes them: a token pasted into token_env has
# lower-case letters or other characters, so it is never taken for a name (and is hidden)
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# any URL in a message: its query, fragment and credentials are cut (scrub_message). A quoted
# one runs to its closing quote (Python's repr of a URL with a space in it), others to a space
_URL = re.compile(
    r"(?<=')[A-Za-z][A-Za-z0-9+.-]*://[^']+(?=')"
    r'|(?<=")[A-Za-z][A-Za-z0-9+.-]*://[^"]+(?=")'
    r"|[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]*[^\s'\"<>.,:;!?)\]]"
)


class HiddenValueMissingError(RuntimeError):
    """A job met a placeholder whose value did not reach it."""


def is_setting(name: str) -> bool:
    """An environment variable qdiff knows as a numerics setting: shown in clear."""
    return name.startswith(_SETTING_PREFIXES) and not _SECRET_WORD.search(name)


class Hider:
    """Replaces values by placeholders and remembers them (placeholder -> value)."""

    def __init__(self, key_file: Path) -> None:
        self.key_file = key_file
        self.table: dict[str, str] = {}
        self._key: bytes | None = None

    def _digest_key(self) -> bytes:
        if self._key is None:  # created only when something is hidden
            if not self.key_file.exists():
                self.key_file.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(random.token_hex(32))
            self._key = self.key_file.read_text().strip().encode()
        return self._key

    def hide(self, value: str) -> str:
        if PLACEHOLDER.fullmatch(value):
            return value  # hidden already (the config is scrubbed once per process)
        digest = hmac.new(self._digest_key(), value.encode(), hashlib.sha256).hexdigest()[:16]
        placeholder = f"<hidden:{digest}>"
        self.table[placeholder] = value
        return placeholder

    def hide_url(self, url: str) -> str:
        """The URL with its query string, fragment and credentials hidden."""
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, host = netloc.rpartition("@")
            netloc = f"{self.hide(userinfo)}@{host}"
        hidden = ""
        if parts.query or parts.fragment:
            original = parts.query + (f"#{parts.fragment}" if parts.fragment else "")
            hidden = self.hide(original)
        return urlunsplit((parts.scheme, netloc, parts.path, hidden, ""))


def scrub_config(config: dict[str, Any], key_file: Path | str = KEY_FILE) -> dict[str, str]:
    """Hide, in place, every value of ``config`` that qdiff may not show; return the table
    placeholder -> value. Call it on Snakemake's config before anything else reads it."""
    hider = Hider(Path(key_file))
    for device in (config.get("devices") or {}).values():
        env = device.get("env") if isinstance(device, dict) else None
        if isinstance(env, dict):
            for name, value in env.items():
                if not is_setting(str(name)):
                    env[name] = hider.hide(str(value))
    for model in (config.get("models") or {}).values():
        if isinstance(model, dict) and isinstance(model.get("url"), str):
            model["url"] = hider.hide_url(model["url"])
        # a token pasted where its variable's name belongs: hidden, and refused by validation
        token_env = model.get("token_env") if isinstance(model, dict) else None
        if isinstance(token_env, str) and not ENV_NAME.fullmatch(token_env):
            model["token_env"] = hider.hide(token_env)
    return hider.table


class _Vault:
    """Hidden values, served to this process's descendants that ask for one by its digest."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {}  # digest -> value
        self.path: str | None = None

    def serve(self, table: Mapping[str, str]) -> None:
        # only in the Snakemake process that serves: the jobs' imports stay light
        import atexit
        import shutil
        import socket
        import tempfile
        import threading

        for placeholder, value in table.items():
            self.table[PLACEHOLDER.fullmatch(placeholder)[1]] = value  # type: ignore[index]
        if self.path is not None or not self.table:
            return
        folder = tempfile.mkdtemp(prefix="qdiff-vault-")  # mode 0700: this user's only
        atexit.register(shutil.rmtree, folder, True)
        self.path = os.path.join(folder, "socket")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        server.listen(16)
        threading.Thread(
            target=self._answer, args=(server,), name="qdiff-vault", daemon=True
        ).start()
        os.environ[VAULT_ENV] = self.path

    def _answer(self, server: Any) -> None:
        while True:
            connection, _ = server.accept()
            with connection, suppress(OSError):  # a job that hung up costs only its answer
                digest = connection.makefile("rb").readline().strip().decode(errors="replace")
                value = self.table.get(digest)
                connection.sendall(b"-" if value is None else b"+" + value.encode())


_VAULT = _Vault()
_REVEALED: dict[str, str] = {}  # value -> placeholder: what this process may not write


def serve(table: Mapping[str, str]) -> None:
    """Keep ``table`` (placeholder -> value, from ``scrub_config``) in this process and serve
    it to the jobs it starts, which inherit only the socket's path."""
    _VAULT.serve(table)


def _ask(digest: str) -> str | None:
    import socket  # only in the processes that reveal a value

    path = os.environ.get(VAULT_ENV)
    if not path:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(path)
            connection.sendall(digest.encode() + b"\n")
            answer = connection.makefile("rb").read()
    except OSError:
        return None
    return answer[1:].decode() if answer.startswith(b"+") else None


SCRUB_MIN_CHARS = 6  # a shorter value (a flag like "1") would take every "1" with it


def remember(placeholder: str, value: str) -> None:
    """Note that this process holds ``value``: ``scrub`` takes it out of what it writes,
    unless it is shorter than SCRUB_MIN_CHARS (still hidden from Snakemake, like any value,
    but a record's text would lose every occurrence of it)."""
    if len(value) >= SCRUB_MIN_CHARS:
        _REVEALED[value] = placeholder


def reveal(text: str) -> str:
    """``text`` with every placeholder replaced by its value (inside a job only)."""

    def value(match: re.Match[str]) -> str:
        found = _ask(match[1])
        if found is None:
            raise HiddenValueMissingError(
                f"the hidden value {match[0]} did not reach this job: run it through "
                "snakemake, which serves hidden values to its jobs"
            )
        remember(match[0], found)
        return found

    return PLACEHOLDER.sub(value, text)


def reveal_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: reveal(value) for name, value in env.items()}


def scrub(value: Any) -> Any:
    """``value`` (a string, or lists and dicts of them) with every value this process has
    revealed replaced by its placeholder again."""
    if not _REVEALED:
        return value
    if isinstance(value, str):
        for secret in sorted(_REVEALED, key=len, reverse=True):
            value = value.replace(secret, _REVEALED[secret])
        return value
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    return value


def redact_url(url: str) -> str:
    """The URL without query string, fragment or credentials, safe for any message."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")) + (
        "?…" if parts.query or parts.fragment else ""
    )


def scrub_message(message: str) -> str:
    """Error text as a record, a log or the report may hold it: ``scrub``, and every URL in
    it without its query, fragment and credentials."""
    return _URL.sub(lambda m: redact_url(m[0]), scrub(message))


class ScrubbedStream(io.TextIOBase):
    """A text stream (a job's stderr) that ``scrub``s what is written to it."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(scrub(text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


def received(env: Mapping[str, str], key_file: Path | str = KEY_FILE) -> dict[str, bool]:
    """For each hidden value of ``env`` (name -> placeholder): whether this process's
    environment holds the value the placeholder stands for. A self-check that proves
    delivery without showing the value."""
    hidden = {n: m[1] for n, v in env.items() if (m := PLACEHOLDER.fullmatch(v))}
    if not hidden:
        return {}
    key = Path(key_file).read_text().strip().encode()
    got = {}
    for name, digest in hidden.items():
        value = os.environ.get(name, "")
        mine = hmac.new(key, value.encode(), hashlib.sha256).hexdigest()[:16]
        got[name] = hmac.compare_digest(mine, digest)
        if got[name]:
            remember(f"<hidden:{digest}>", value)  # and never written out by this process
    return got


def has_credentials(url: str) -> bool:
    return "@" in urlsplit(url).netloc
