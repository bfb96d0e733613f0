"""The probe listener (server/probes.py): its answers, its bounds, and its place in the server
(``probe_port``: bound port in /status, readiness 503 through the shutdown grace, closed with
the server). Real sockets on 127.0.0.1 port 0, no autojump; timing lives in bench/ (flood)."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import h11
import httpx2
import msgspec
import pytest
import trio
import trio.testing

from genrm_trio.config import Config
from genrm_trio.errors import ConfigError
from genrm_trio.server import probes
from genrm_trio.server.probes import bound_url, open_probe_socket, probe_answer, serve_probes
from genrm_trio.server.serve import run_server
from tests.lifecycle_helpers import body
from tests.server_helpers import read_answer

Answer = tuple[int, dict[str, str], bytes]


def test_probe_answers() -> None:
    for path in (b"/", b"/health", b"/healthz", b"/livez", b"/healthz?verbose=1"):
        assert probe_answer(b"GET", path, ready=False)[:2] == (200, b'{"status":"ok"}')
        assert probe_answer(b"HEAD", path, ready=True)[0] == 200
    assert probe_answer(b"GET", b"/readyz", ready=True)[:2] == (200, b'{"status":"ready"}')
    status, payload, _ = probe_answer(b"GET", b"/readyz", ready=False)
    assert (status, json.loads(payload)) == (
        503, {"detail": "the server is shutting down", "failure_kind": "shutdown"})
    for path in (b"/status", b"/metrics", b"/verify", b"/ng-rollout/r1/health", b"/healthzz"):
        status, payload, _ = probe_answer(b"GET", path, ready=True)
        assert status == 404 and json.loads(payload)["failure_kind"] == "bad_request"
    status, _, headers = probe_answer(b"POST", b"/readyz", ready=True)
    assert (status, headers) == (405, [(b"allow", b"GET, HEAD")])


async def get(port: int, raw: bytes, host: str = "127.0.0.1") -> tuple[Answer | None, bool]:
    """Send ``raw`` on a fresh connection; the answer, and whether the server then closed."""
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(raw)
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
            conn.send(h11.EndOfMessage())
            answer = await read_answer(stream, conn)
            closed = await stream.receive_some(1) == b""
    return answer, closed


def request(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode()


@asynccontextmanager
async def probe_server(ready: Callable[[], bool]) -> AsyncIterator[tuple[int, socket.socket]]:
    sock = await open_probe_socket("127.0.0.1", 0)
    port = int(bound_url(sock).rsplit(":", 1)[1])
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_probes, sock, ready)
        yield port, sock
        nursery.cancel_scope.cancel()


async def test_liveness_readiness_and_nothing_else() -> None:
    state = {"ready": True}
    async with probe_server(lambda: state["ready"]) as (port, _):
        for path in ("/", "/health", "/healthz", "/livez"):
            answer, closed = await get(port, request(path))
            assert answer is not None and closed
            assert (answer[0], answer[2]) == (200, b'{"status":"ok"}')
            assert answer[1]["content-type"] == "application/json"
            assert answer[1]["connection"] == "close"
        answer, _ = await get(port, request("/readyz"))
        assert answer is not None and (answer[0], answer[2]) == (200, b'{"status":"ready"}')
        state["ready"] = False
        answer, _ = await get(port, request("/readyz"))
        assert answer is not None and answer[0] == 503
        assert json.loads(answer[2])["failure_kind"] == "shutdown"
        answer, _ = await get(port, request("/livez"))
        assert answer is not None and answer[0] == 200  # alive while shutting down
        answer, _ = await get(port, request("/status"))
        assert answer is not None and answer[0] == 404
        answer, _ = await get(port, request("/readyz", "DELETE"))
        assert answer is not None and answer[0] == 405 and answer[1]["allow"] == "GET, HEAD"
        answer, _ = await get(port, b"NOT HTTP\r\n\r\n")
        assert answer is not None and answer[0] == 400


async def test_head_has_no_body() -> None:
    async with probe_server(lambda: True) as (port, _):
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(request("/healthz", "HEAD"))
                data = b""
                while chunk := await stream.receive_some(4096):
                    data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 15" in head
    assert rest == b""


async def test_a_request_that_arrives_after_the_accept_is_answered_too() -> None:
    async with probe_server(lambda: True) as (port, _):
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await trio.testing.wait_all_tasks_blocked()  # accepted, nothing to read yet
                await stream.send_all(b"GET /livez HTTP/1.1\r\n")
                await trio.testing.wait_all_tasks_blocked()  # half a head: still waiting
                await stream.send_all(b"Host: probe\r\n\r\n")
                conn = h11.Connection(h11.CLIENT)
                conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                conn.send(h11.EndOfMessage())
                answer = await read_answer(stream, conn)
    assert answer is not None and answer[0] == 200


async def test_waiting_connections_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "MAX_WAITING_PROBES", 2)
    async with probe_server(lambda: True) as (port, _):
        with trio.fail_after(10):
            idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
            await trio.testing.wait_all_tasks_blocked()
            late = await trio.open_tcp_stream("127.0.0.1", port)
            await late.send_all(request("/livez"))
            await trio.testing.wait_all_tasks_blocked()
            with (socket.socket(fileno=late.socket.dup().detach()) as peek,
                  pytest.raises(BlockingIOError)):  # not accepted while both slots wait
                peek.recv(1, socket.MSG_DONTWAIT)
            await idle[0].aclose()  # a slot frees: the late probe is accepted and answered
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
            conn.send(h11.EndOfMessage())
            answer = await read_answer(late, conn)
            assert answer is not None and answer[0] == 200
            await late.aclose()
            await idle[1].aclose()


async def test_a_silent_connection_is_dropped_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(probes, "PROBE_CONNECTION_S", 0.05)
    async with probe_server(lambda: True) as (port, _):
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                assert await stream.receive_some(1) == b""  # closed, unanswered


async def test_cancellation_closes_the_listening_socket() -> None:
    async with probe_server(lambda: True) as (port, sock):
        answer, _ = await get(port, request("/livez"))
        assert answer is not None
    assert sock.fileno() == -1
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


# --------------------------------------------------------------------------- in the server


async def status(client: httpx2.AsyncClient) -> dict[str, object]:
    decoded: dict[str, object] = (await client.get("/status")).json()
    return decoded


async def test_the_server_reports_its_probe_port_and_serves_probes_there() -> None:
    cfg = Config(port=0, probe_port=0, num_rollouts_per_prompt=2,
                 memory_limit_bytes=2 * 2**30)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            lambda task_status: run_server(cfg, shutdown=stop, task_status=task_status))
        async with httpx2.AsyncClient(base_url=url) as client:
            config = (await status(client))["config"]
            assert isinstance(config, dict)
            probe_port = config["probe_port"]
            assert isinstance(probe_port, int) and probe_port not in (0, cfg.port)
            assert probe_port != int(url.rsplit(":", 1)[1])
            assert config["max_active_bytes"] == 2**29  # auto: a quarter of 2 GiB
            assert config["max_active_bytes_source"] == (
                "auto: a quarter of memory_limit_bytes (2.0 GiB, configured)")
            answer, _ = await get(probe_port, request("/readyz"))
            assert answer is not None and answer[0] == 200
            answer, _ = await get(probe_port, request("/verify", "POST"))
            assert answer is not None and answer[0] == 404  # the app is not behind it
        stop.set()
    with pytest.raises(OSError):  # closed with the server
        await trio.open_tcp_stream("127.0.0.1", probe_port)


async def test_readiness_is_503_on_the_probe_port_through_the_shutdown_grace() -> None:
    cfg = Config(port=0, probe_port=0, num_rollouts_per_prompt=2, shutdown_grace_s=30.0)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            lambda task_status: run_server(cfg, shutdown=stop, task_status=task_status))
        async with httpx2.AsyncClient(base_url=url) as client:
            probe_port = (await client.get("/status")).json()["config"]["probe_port"]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        # An upload in progress holds the server in its grace period once shutdown begins.
        payload = msgspec.json.encode(body(0, group="held"))
        upload = await trio.open_tcp_stream(host, int(port))
        await upload.send_all(
            b"POST /verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload[:10])
        stop.set()
        await trio.testing.wait_all_tasks_blocked()
        answer, _ = await get(probe_port, request("/readyz"))
        assert answer is not None and answer[0] == 503
        assert json.loads(answer[2]) == {"detail": "the server is shutting down",
                                         "failure_kind": "shutdown"}
        answer, _ = await get(probe_port, request("/livez"))
        assert answer is not None and answer[0] == 200
        await upload.aclose()  # the last connection goes: the server ends before its grace


async def test_a_probe_port_in_use_stops_the_start_with_a_config_error() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        cfg = Config(port=0, probe_port=taken.getsockname()[1])
        with pytest.raises(BaseExceptionGroup) as info:
            await run_server(cfg)  # never serves: no task_status needed
    finally:
        taken.close()
    assert info.group_contains(ConfigError, depth=None)
    found = info.value.subgroup(ConfigError)
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    assert isinstance(found, ConfigError)
    assert found.key == "probe_port" and "in use" in found.problem
