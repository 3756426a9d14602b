"""What qdiff may show of configured values (pure logic; test_failures checks the workflow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import in_child
from qdiff.core import secrets


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("GGML_CUDA_DISABLE_FUSION", True),
        ("NVIDIA_TF32_OVERRIDE", True),
        ("CUDA_VISIBLE_DEVICES", True),
        ("GGML_VK_VISIBLE_DEVICES", True),
        ("OMP_NUM_THREADS", True),
        # plausible secret names that a name-based redaction misses, and settings-like
        # names with a secret word in them
        ("MY_SERVICE_PAT", False),
        ("HF_ACCESS", False),
        ("DATABASE_DSN", False),
        ("OPENAI_ORG", False),
        ("CUDA_API_KEY", False),
        ("GGML_TOKEN", False),
        ("HF_TOKEN", False),
    ],
)
def test_only_known_settings_are_shown(name: str, shown: bool) -> None:
    assert secrets.is_setting(name) is shown


def test_scrub_hides_values_and_urls_in_place_and_reveal_restores_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {
        "devices": {"cpu": {"backend": "cpu", "env": {"GGML_X": "1", "MY_PAT": "s3cret-value"}}},
        "models": {
            "m": {"url": "https://host/m.gguf?sig=abc123&exp=9", "sha256": "0" * 64},
            "n": {"url": "https://user:pw@host/n.gguf"},
        },
    }
    table = secrets.scrub_config(config, tmp_path / "key")
    env = config["devices"]["cpu"]["env"]
    assert env["GGML_X"] == "1" and secrets.PLACEHOLDER.fullmatch(env["MY_PAT"])
    url = config["models"]["m"]["url"]
    assert url.startswith("https://host/m.gguf?<hidden:") and "abc123" not in url
    assert "pw" not in config["models"]["n"]["url"] and secrets.has_credentials(
        config["models"]["n"]["url"]
    )
    assert "s3cret-value" not in repr(config)
    assert (tmp_path / "key").stat().st_mode & 0o777 == 0o600
    # the same value gives the same placeholder (params stay stable); another value another
    again = {"devices": {"cpu": {"env": {"MY_PAT": "s3cret-value"}}}}
    secrets.scrub_config(again, tmp_path / "key")
    assert again["devices"]["cpu"]["env"]["MY_PAT"] == env["MY_PAT"]
    changed = {"devices": {"cpu": {"env": {"MY_PAT": "s3cret-value2"}}}}
    secrets.scrub_config(changed, tmp_path / "key")
    assert changed["devices"]["cpu"]["env"]["MY_PAT"] != env["MY_PAT"]
    monkeypatch.delenv(secrets.VAULT_ENV, raising=False)
    with pytest.raises(secrets.HiddenValueMissingError, match="run it through snakemake"):
        secrets.reveal(url)
    message = "GET https://host/m.gguf?sig=abc123&exp=9 failed; token s3cret-value"
    # in a child process: serving starts a thread, and a process that reveals keeps a record
    held, revealed, env_revealed, scrubbed = in_child(served, table, url, env, message)
    assert not held  # the environment holds the socket's path, no value
    assert revealed == "https://host/m.gguf?sig=abc123&exp=9"
    assert env_revealed == {"GGML_X": "1", "MY_PAT": "s3cret-value"}
    # what a process revealed never leaves it again: records, logs, messages
    assert scrubbed == f"GET https://host/m.gguf?{url.split('?')[1]} failed; token {env['MY_PAT']}"


def served(
    table: dict[str, str], url: str, env: dict[str, str], message: str
) -> tuple[bool, str, dict[str, str], str]:
    """Serve ``table`` from this process and reveal through it, as a job does."""
    secrets.serve(table)  # a socket in a private folder; the environment holds its path only
    held = any(v in value for value in os.environ.values() for v in table.values())
    revealed, env_revealed = secrets.reveal(url), secrets.reveal_env(env)
    assert secrets.scrub({"a": [message]}) == {"a": [secrets.scrub(message)]}
    return held, revealed, env_revealed, secrets.scrub(message)


def test_messages_lose_every_urls_query_and_credentials() -> None:
    """A redirect's signed URL, or a URL the HTTP client quotes, is never a known value."""
    message = (
        "refusing redirect to 'http://other.example/x.gguf?X-Amz-Signature=abc#frag': "
        "InvalidURL: URL can't contain control characters. 'https://u:p@h/a b?sig=1'"
    )
    said = secrets.scrub_message(message)
    for hidden in ("X-Amz-Signature", "abc", "frag", "u:p@", "sig=1"):
        assert hidden not in said, hidden
    assert "http://other.example/x.gguf?…" in said and "https://h/a" in said


def test_nothing_to_hide_creates_no_key(tmp_path: Path) -> None:
    config = {
        "devices": {"cpu": {"backend": "cpu", "env": {"GGML_X": "1"}}},
        "models": {"m": {"path": "a.gguf"}},
    }
    assert secrets.scrub_config(config, tmp_path / "key") == {}
    assert not (tmp_path / "key").exists()


def test_only_values_of_six_characters_or_more_are_taken_out_of_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short value (a flag such as "1") stays hidden from Snakemake but is not searched
    for in text, which would lose every "1" of a record; a longer one is."""
    monkeypatch.setattr(secrets, "_REVEALED", {})
    secrets.remember("<hidden:aaaa>", "x" * (secrets.SCRUB_MIN_CHARS - 1))
    secrets.remember("<hidden:bbbb>", "y" * secrets.SCRUB_MIN_CHARS)
    text = f"{'x' * 5} and {'y' * 6}"
    assert secrets.scrub(text) == f"{'x' * 5} and <hidden:bbbb>"
    assert secrets.scrub({"a": [text]}) == {"a": [f"{'x' * 5} and <hidden:bbbb>"]}
