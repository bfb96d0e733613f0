"""What a transport is: one JSON POST to an endpoint, answered whole.

Two implementations, each the only user of its library: :mod:`.h11_pool` (the default, lean
trio + h11 keep-alive pool) and :mod:`.httpx_transport` (httpx2 clients; tests hand it an
``httpx2.MockTransport``). A transport translates its library's errors into
:class:`~.attempt.AttemptFailed` (retryable: connection, read, protocol errors) or
:class:`~.attempt.AttemptFatal` (a URL it cannot use); the caller's trio deadline bounds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from genrm_trio.server.judge.endpoints import Endpoint


class Answer:
    """A judge's HTTP answer, whichever transport fetched it: status, lower-case headers, body."""

    __slots__ = ("status", "headers", "content")

    def __init__(self, status: int, headers: Mapping[str, str], content: bytes) -> None:
        self.status = status
        self.headers = headers
        self.content = content


class Transport(Protocol):
    async def post(self, endpoint: Endpoint, content: bytes,
                   headers: Sequence[tuple[str, str]] = ()) -> Answer:
        """POST ``content`` (JSON) to ``endpoint`` with ``headers`` added to the client's own
        (the trace's ``traceparent``); blocks until the whole answer is read."""
        ...

    def clients(self, endpoint: Endpoint) -> int:
        """How many clients (connections or client objects) this endpoint has, for /status."""
        ...

    async def aclose(self) -> None:
        """Close every connection; blocks while they close, the caller bounds it."""
        ...
