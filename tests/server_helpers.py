"""Real-socket helpers: run the server in process on 127.0.0.1 port 0, talk to it over HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import h11
import msgspec
import trio

from genrm_trio.config import Config
from genrm_trio.server.serve import run_server


@asynccontextmanager
async def running_server(cfg: Config) -> AsyncIterator[str]:
    """Serve ``cfg`` on an ephemeral loopback port (whatever ``cfg.host``/``cfg.port`` say: the
    default 8000 would collide with a parallel run); graceful shutdown on exit."""
    cfg = msgspec.structs.replace(cfg, host="127.0.0.1", port=0)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            lambda task_status: run_server(cfg, shutdown=stop, task_status=task_status)
        )
        try:
            yield url
        finally:
            stop.set()


Answer = tuple[int, dict[str, str], bytes]


async def read_answer(stream: trio.abc.Stream, conn: h11.Connection) -> Answer | None:
    """Read one answer from ``stream`` through the client-side ``conn``: (status, headers,
    body), or None when the server closed the connection (or broke the protocol) before a
    complete answer. A reset reads as a close."""
    status, headers, body = 0, {}, b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return None
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            conn.receive_data(data)
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, headers, body
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def raw_http(
    url: str, requests: list[tuple[str, str, bytes]], timeout_s: float = 10.0,
) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``(method, path, body)`` requests one after another on ONE keep-alive connection
    (raw h11, so nothing is hidden by a client pool) and return each answer. Stops early if the
    server closes the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    out: list[tuple[int, dict[str, str], bytes]] = []
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            for method, path, payload in requests:
                if conn.our_state is not h11.IDLE:
                    break
                headers = [("Host", host), ("Content-Length", str(len(payload))),
                           ("Content-Type", "application/json")]
                await stream.send_all(conn.send(h11.Request(method=method, target=path,
                                                            headers=headers)))
                await stream.send_all(conn.send(h11.Data(data=payload)))
                await stream.send_all(conn.send(h11.EndOfMessage()))
                answer = await read_answer(stream, conn)
                if answer is None:
                    return out
                out.append(answer)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
    return out
