"""A real HTTP server on 127.0.0.1 that serves a model file, for tests: resumable ranges,
redirects (one to a plain-http host elsewhere, with a signed query), 404s (and paths that
answer 404 until they are fixed), transient 503s, dropped connections, a trickle that stalls,
a body that never ends and a body held back until the test lets it go."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REDIRECT_QUERY = "X-Amz-Signature=redirect-secret-5150"


class ModelServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, payload: bytes) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.payload = payload
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.drops_left = 0  # requests to cut off halfway
        self.failures_left = 0  # requests to answer with 503
        self.trickle: tuple[int, float] | None = None  # (bytes, seconds) per write: a slow server
        self.gone: set[str] = set()  # paths that answer 404, until removed from here
        self.hold: threading.Event | None = None  # if set here, bodies wait for it to be set

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: ModelServer

    def log_message(self, *args: object) -> None:
        pass

    def _body(self) -> bytes | None:
        path = self.path.split("?")[0]
        if path.endswith("/missing.gguf") or path in self.server.gone:
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
            return self._redirect()
        if self.path.startswith("/forever"):
            return self._forever()
        if server.failures_left:
            server.failures_left -= 1
            self.send_error(503)
            return None
        body = self._body()
        if body is None:
            self.send_error(404)
            return None
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
        return self._send(body[start:])

    def _redirect(self) -> None:
        """To the model here, or (``/redirect-away``) to plain http elsewhere, signed."""
        away = self.path.startswith("/redirect-away")
        self.send_response(302)
        location = f"http://example.invalid/m.gguf?{REDIRECT_QUERY}" if away else "/model.gguf"
        self.send_header("Location", location)
        self.end_headers()

    def _forever(self) -> None:
        """A GGUF header, then zeros, with no length, until the client hangs up."""
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"GGUF")
        try:
            while True:
                self.wfile.write(bytes(1 << 16))
                time.sleep(0.005)
        except OSError:
            return

    def _send(self, chunk: bytes) -> None:
        """The body: whole, as a trickle, or cut halfway (a dropped connection)."""
        server = self.server
        if server.hold:  # a download that stays in its job for as long as the test needs
            server.hold.wait()
        if server.trickle:
            size, pause = server.trickle
            for i in range(0, len(chunk), size):
                try:
                    self.wfile.write(chunk[i : i + size])
                    self.wfile.flush()
                except OSError:  # the client gave up
                    return
                time.sleep(pause)
            return
        if server.drops_left:
            server.drops_left -= 1
            self.wfile.write(chunk[: len(chunk) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)  # drop the connection mid-body
            return
        self.wfile.write(chunk)


@contextmanager
def serving(payload: bytes) -> Iterator[ModelServer]:
    srv = ModelServer(payload)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        if srv.hold:
            srv.hold.set()
        srv.shutdown()
        srv.server_close()
