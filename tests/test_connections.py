"""server/connections.py: Hypercorn's trio server with leaner connections (issue 21).

The ASGI message queue on its own (no sockets), then the server on a real loopback socket
(port 0, no autojump) with a small ASGI app. The whole HTTP surface also runs through it in
tests/test_server.py, test_shutdown*.py, test_hostile.py, test_send_path.py and the others.
"""

from __future__ import annotations

import gc
import logging
import types
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig

from genrm_trio.server import connections
from genrm_trio.server.connections import APP_QUEUE_BODY_BYTES, AppQueue, LeanTCPServer
from tests.server_helpers import read_answer


def message(i: int) -> Any:
    return {"type": "http.request", "body": b"%d" % i, "more_body": True}


async def test_queue_keeps_order_and_blocks_the_sender_once_full() -> None:
    queue = AppQueue(3)
    put: list[int] = []

    async def sender() -> None:
        for i in range(5):
            await queue.put(message(i))
            put.append(i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert put == [0, 1, 2]  # the fourth waits for room
        assert (await queue.get())["body"] == b"0"
        await trio.testing.wait_all_tasks_blocked()
        assert put == [0, 1, 2, 3]
        got = [(await queue.get())["body"] for _ in range(4)]
    assert got == [b"1", b"2", b"3", b"4"] and put == [0, 1, 2, 3, 4]


async def test_queue_blocks_the_sender_once_a_reads_worth_of_body_is_unread() -> None:
    """Hypercorn's bound is ten messages; ours also stops at 64 KiB of unread body, so a body
    the app does not read yet holds one read's worth here, not ten (issue 26, slow readers).
    A message larger than the bound goes in whenever less than it is unread."""
    queue = AppQueue(10)
    put: list[int] = []
    chunk = 40_000

    async def sender() -> None:
        for i in range(4):
            await queue.put({"type": "http.request", "body": bytes(chunk), "more_body": True})
            put.append(i)
        await queue.put({"type": "http.request", "body": bytes(3 * APP_QUEUE_BODY_BYTES),
                         "more_body": False})
        put.append(4)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert put == [0, 1]  # 80,000 bytes unread: the third waits
        await queue.get()
        await trio.testing.wait_all_tasks_blocked()
        assert put == [0, 1, 2]
        await queue.get()
        await trio.testing.wait_all_tasks_blocked()
        assert put == [0, 1, 2, 3]  # 80,000 unread again
        await queue.get()
        await trio.testing.wait_all_tasks_blocked()
        assert put == [0, 1, 2, 3, 4]  # 40,000 unread: room, whatever the next one's size
        await queue.get()
        assert len((await queue.get())["body"]) == 3 * APP_QUEUE_BODY_BYTES


async def test_a_waiting_receiver_is_woken_by_the_next_message() -> None:
    queue = AppQueue(10)
    got: list[Any] = []

    async def receiver() -> None:
        got.append(await queue.get())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        await queue.put(message(7))
    assert got == [message(7)]


async def test_a_cancelled_receive_loses_nothing_and_frees_the_receiver_slot() -> None:
    queue = AppQueue(10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.get)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    await queue.put(message(1))
    assert await queue.get() == message(1)  # nobody else took it; a new receiver may wait
    with trio.move_on_after(0) as scope:
        await queue.get()
    assert scope.cancelled_caught


async def test_a_second_concurrent_receiver_is_refused() -> None:
    queue = AppQueue(10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.get)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await queue.get()
        await queue.put(message(2))  # the first receiver gets it and ends


# ------------------------------------------------------------------ the server


class WaitingApp:
    """Reads each request's body, then waits for the client to go away (a waiting member),
    or answers at once on ``/now``. Records the messages that arrive after the body."""

    def __init__(self) -> None:
        self.after_body: list[str] = []
        self.disconnected = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                await send({"type": event["type"] + ".complete"})
                if event["type"] == "lifespan.shutdown":
                    return
        while (await receive()).get("more_body", False):
            pass
        if scope["path"] == "/slow":  # busy longer than any keep-alive timeout here
            await trio.sleep(100)
        if scope["path"] == "/big":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(BIG_ANSWER)).encode())]})
            await send({"type": "http.response.body", "body": BIG_ANSWER})
            return
        if scope["path"] in ("/now", "/slow"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        self.after_body.append((await receive())["type"])
        self.disconnected.set()


BIG_ANSWER = b"x" * (3 * connections.COMBINED_WRITE_BYTES)


def hypercorn_config(**kw: Any) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    for key, value in kw.items():
        setattr(config, key, value)
    return config


@asynccontextmanager
async def serving(app: Any, config: HypercornConfig) -> AsyncIterator[tuple[str, int]]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(connections.serve, app, config,
                                            shutdown_trigger=stop.wait))
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        try:
            yield host, int(port)
        finally:
            stop.set()


async def send_request(host: str, port: int, path: str,
                       body: bytes = b"{}") -> tuple[trio.SocketStream, h11.Connection]:
    stream = await trio.open_tcp_stream(host, port)
    conn = h11.Connection(h11.CLIENT)
    headers = [("Host", host), ("Content-Length", str(len(body)))]
    await stream.send_all(conn.send(h11.Request(method="POST", target=path, headers=headers))
                          + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    return stream, conn


def suspended_frames(predicate: Callable[[Any], bool]) -> list[Any]:
    """The frames, outermost first, of every task of this process whose chain of awaited
    coroutines has a frame matching ``predicate``."""
    found = []
    tasks = [trio.lowlevel.current_root_task()]
    while tasks:
        task = tasks.pop()
        tasks.extend(t for n in task.child_nurseries for t in n.child_tasks)
        frames = []
        awaited: Any = task.coro
        while awaited is not None:
            if type(awaited).__name__ == "coroutine_wrapper":  # `await obj`, obj.__await__
                awaited = next(c for c in gc.get_referents(awaited)
                               if isinstance(c, types.CoroutineType))
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                frames.append(frame)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        if any(predicate(f) for f in frames):
            found.append(frames)
    return found


async def test_a_waiting_connection_holds_no_received_bytes_and_a_lean_queue() -> None:
    """While the app waits, the connection's read loop waits for more data holding nothing it
    read (stock Hypercorn keeps the whole request referenced), and the app's ``receive`` is
    an :class:`AppQueue` (not a memory channel); the ASGI app runs directly under the
    connection's task."""
    app = WaitingApp()
    body = b'{"answer": "' + b"x" * 4000 + b'"}'
    async with serving(app, hypercorn_config()) as (host, port):
        stream, _ = await send_request(host, port, "/wait", body)
        async with stream:
            await trio.testing.wait_all_tasks_blocked()
            readers = suspended_frames(lambda f: f.f_code.co_name == "_read_data")
            assert len(readers) == 1
            read_data = next(f for f in readers[0] if f.f_code.co_name == "_read_data")
            assert isinstance(read_data.f_locals["self"], LeanTCPServer)
            held = [v for frame in readers[0] for v in frame.f_locals.values()
                    if isinstance(v, (bytes, bytearray)) and len(v) >= len(body)]
            assert held == []
            apps = suspended_frames(lambda f: f.f_locals.get("self") is app
                                    and f.f_locals["scope"]["type"] == "http")
            assert len(apps) == 1
            names = [f.f_code.co_name for f in apps[0]]
            assert names[:2] == ["_run_app", "__call__"]  # no wrapper frame between
            assert [n for n in names if n == "get"] == ["get"]
            get = next(f for f in apps[0] if f.f_code.co_name == "get")
            assert isinstance(get.f_locals["self"], AppQueue)
        with trio.fail_after(10):
            await app.disconnected.wait()  # closing the client reached the app
    assert app.after_body == ["http.disconnect"]


async def test_keep_alive_answers_on_one_connection() -> None:
    app = WaitingApp()
    async with serving(app, hypercorn_config()) as (host, port):
        stream, conn = await send_request(host, port, "/now")
        async with stream:
            for i in range(3):
                answer = await read_answer(stream, conn)
                assert answer is not None and answer[0] == 200 and answer[2] == b"ok"
                if i < 2:
                    conn.start_next_cycle()
                    await stream.send_all(
                        conn.send(h11.Request(method="POST", target="/now",
                                              headers=[("Host", host), ("Content-Length", "0")]))
                        + conn.send(h11.EndOfMessage()))


async def next_request(stream: trio.SocketStream, conn: h11.Connection, host: str,
                       path: str) -> None:
    conn.start_next_cycle()
    await stream.send_all(conn.send(h11.Request(
        method="POST", target=path, headers=[("Host", host), ("Content-Length", "0")]))
        + conn.send(h11.EndOfMessage()))


async def test_an_idle_connection_closes_after_the_keep_alive_timeout(
        autojump_clock: trio.abc.Clock) -> None:
    """The keep-alive timer (the read loop's deadline while idle, no task of its own): an
    idle connection is closed ``keep_alive_timeout`` after its last answer, not sooner, and
    not while a request is in progress, however long it takes."""
    app = WaitingApp()
    with trio.fail_after(1000):  # the mock clock's: a connection never closed fails here
        await keep_alive_then_close(app)


async def keep_alive_then_close(app: WaitingApp) -> None:
    async with serving(app, hypercorn_config(keep_alive_timeout=30)) as (host, port):
        stream, conn = await send_request(host, port, "/now")
        async with stream:
            assert (await read_answer(stream, conn) or (0,))[0] == 200
            await trio.sleep(29)  # idle, nearly the whole timeout: still open
            await next_request(stream, conn, host, "/slow")
            started = trio.current_time()
            assert (await read_answer(stream, conn) or (0,))[0] == 200
            assert trio.current_time() - started >= 100  # busy for 100 s: never cut
            idle_from = trio.current_time()
            conn.start_next_cycle()
            assert await read_answer(stream, conn) is None  # then closed by the server
            assert 30 <= trio.current_time() - idle_from < 31


async def test_shutdown_closes_idle_connections_at_once(
        autojump_clock: trio.abc.Clock) -> None:
    """Once the server stops accepting, an idle keep-alive connection is closed at once and a
    busy one as soon as its answer is sent (Hypercorn's timer does the same)."""
    app = WaitingApp()
    stop = trio.Event()
    with trio.fail_after(1000):  # the mock clock's
        await shut_down_with(app, stop)


async def shut_down_with(app: WaitingApp, stop: trio.Event) -> None:
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(connections.serve, app,
                                            hypercorn_config(keep_alive_timeout=300,
                                                             graceful_timeout=300),
                                            shutdown_trigger=stop.wait))
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        idle, idle_conn = await send_request(host, int(port), "/now")
        assert (await read_answer(idle, idle_conn) or (0,))[0] == 200
        busy, busy_conn = await send_request(host, int(port), "/slow")
        await trio.sleep(1)
        stop.set()
        stopped = trio.current_time()
        idle_conn.start_next_cycle()
        assert await read_answer(idle, idle_conn) is None
        assert trio.current_time() - stopped < 1
        assert (await read_answer(busy, busy_conn) or (0,))[0] == 200  # answered, then closed
        busy_conn.start_next_cycle()
        assert await read_answer(busy, busy_conn) is None
        assert trio.current_time() - stopped < 100
        await idle.aclose()
        await busy.aclose()


async def test_an_answer_is_one_write_and_a_large_body_is_not_copied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A response's head, body and end go out in one write (Hypercorn makes three of them);
    a body larger than ``COMBINED_WRITE_BYTES`` is written after its head, by itself."""
    writes: list[bytes] = []
    send_within = LeanTCPServer._send_within

    async def recording(self: LeanTCPServer, data: bytes) -> str:
        writes.append(data)
        return await send_within(self, data)

    monkeypatch.setattr(LeanTCPServer, "_send_within", recording)
    app = WaitingApp()
    async with serving(app, hypercorn_config()) as (host, port):
        stream, conn = await send_request(host, port, "/now")
        async with stream:
            assert (await read_answer(stream, conn) or (0,))[0] == 200
            assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200")
            assert writes[0].endswith(b"\r\n\r\nok")
            await next_request(stream, conn, host, "/big")
            answer = await read_answer(stream, conn)
            assert answer is not None and answer[2] == BIG_ANSWER
    assert len(writes) == 3 and writes[1].startswith(b"HTTP/1.1 200")
    assert writes[2] is BIG_ANSWER


async def test_a_closed_connection_leaves_no_cycles_for_the_collector() -> None:
    """Hypercorn's connection objects refer to each other (the protocol holds the server's
    send, the task group its idle timeout), so stock Hypercorn leaves about 25 objects per
    closed connection for a full collection, which then lands wherever it lands (10,000
    connections closing at once: a pass of about half a second). The lean connection drops
    its side of those cycles as it ends, and reference counting frees them."""
    app = WaitingApp()
    async with serving(app, hypercorn_config()) as (host, port):
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(20):
                stream, conn = await send_request(host, port, "/now")
                async with stream:
                    assert await read_answer(stream, conn) is not None
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            left = [type(o).__name__ for o in gc.garbage
                    if type(o).__module__.startswith(("hypercorn", "genrm_trio"))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert left == []


async def test_the_read_timeout_still_ends_a_silent_connection() -> None:
    """Hypercorn's ``read_timeout``: a connection that sends nothing more for that long is
    closed, and its waiting app hears ``http.disconnect``, as with stock Hypercorn."""
    app = WaitingApp()
    async with serving(app, hypercorn_config(read_timeout=1)) as (host, port):
        stream, conn = await send_request(host, port, "/wait")
        async with stream:
            with trio.fail_after(20):
                await app.disconnected.wait()
            assert await read_answer(stream, conn) is None  # closed without an answer
    assert app.after_body == ["http.disconnect"]


async def test_an_unsupported_hypercorn_is_served_by_hypercorn_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(connections, "lean_connections_supported", lambda: False)
    app = WaitingApp()
    async with serving(app, hypercorn_config()) as (host, port):
        stream, conn = await send_request(host, port, "/now")
        async with stream:
            answer = await read_answer(stream, conn)
            assert answer is not None and answer[0] == 200
        assert suspended_frames(lambda f: isinstance(f.f_locals.get("self"), LeanTCPServer)) == []


def test_the_installed_hypercorn_is_supported() -> None:
    """The lean connections are what serve.py gets here; a Hypercorn upgrade that this test
    catches needs server/connections.py checked against its internals."""
    assert connections.lean_connections_supported()
