"""A loopback OTLP/HTTP receiver for the tracing tests (``receiver`` is a fixture, registered
suite-wide by tests/conftest.py): it keeps every body POSTed to ``/v1/traces`` and answers
``status`` (other paths: 404)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


class OtlpReceiver(BaseHTTPRequestHandler):
    bodies: list[bytes]
    status = 200

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        data = self.rfile.read(int(self.headers["content-length"]))
        type(self).bodies.append(data) if self.path == "/v1/traces" else None
        self.send_response(self.status if self.path == "/v1/traces" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, type[OtlpReceiver]]]:
    """(base URL, handler class) of a receiver running on a thread for the test's length."""
    handler = type("Receiver", (OtlpReceiver,), {"bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
