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

The real values travel to jobs in the environment of the Snakemake process
(``QDIFF_HIDDEN_<digest>``), which every job inherits, and only the process that needs one
(the llama.cpp worker, the download) puts it back (``reveal``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets as random
from collections.abc import Mapping
from pathlib import Path
from typing import Any
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
ENV_PREFIX = "QDIFF_HIDDEN_"
KEY_FILE = "resources/.qdiff-digest-key"


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
    return hider.table


def export(table: Mapping[str, str]) -> None:
    """Make hidden values available to this process's jobs through their environment."""
    for placeholder, value in table.items():
        os.environ[ENV_PREFIX + PLACEHOLDER.fullmatch(placeholder)[1]] = value  # type: ignore[index]


def reveal(text: str) -> str:
    """``text`` with every placeholder replaced by its value (inside a job only)."""

    def value(match: re.Match[str]) -> str:
        try:
            return os.environ[ENV_PREFIX + match[1]]
        except KeyError:
            raise HiddenValueMissingError(
                f"the hidden value {match[0]} did not reach this job: run it through "
                "snakemake, which passes hidden values to its jobs"
            ) from None

    return PLACEHOLDER.sub(value, text)


def reveal_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: reveal(value) for name, value in env.items()}


def received(env: Mapping[str, str], key_file: Path | str = KEY_FILE) -> dict[str, bool]:
    """For each hidden value of ``env`` (name -> placeholder): whether this process's
    environment holds the value the placeholder stands for. A self-check that proves
    delivery without showing the value."""
    hidden = {n: m[1] for n, v in env.items() if (m := PLACEHOLDER.fullmatch(v))}
    if not hidden:
        return {}
    key = Path(key_file).read_text().strip().encode()
    return {
        name: hmac.compare_digest(
            hmac.new(key, os.environ.get(name, "").encode(), hashlib.sha256).hexdigest()[:16],
            digest,
        )
        for name, digest in hidden.items()
    }


def has_credentials(url: str) -> bool:
    return "@" in urlsplit(url).netloc
