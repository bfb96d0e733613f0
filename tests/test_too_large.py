"""A body over ``max_request_bytes`` gets a 413 that every client can read, also one that
writes its whole body before it reads (curl, urllib, requests, without ``Expect``): the server
answers, reads and discards the rest of the body (bounded in bytes and time), then closes. Real
sockets on 127.0.0.1; the bodies are far larger than the kernel's socket buffers, so a server
that closed with the body unread would reset the connection under the client's writes."""

from __future__ import annotations

import json

import h11
import pytest
import trio

from genrm_trio.config import Config
from genrm_trio.server import app as app_mod
from tests.server_helpers import Answer, read_answer, running_server

LIMIT = 1 << 20
BODY = 40 << 20  # far beyond what loopback socket buffers hold


def cfg(**kw: object) -> Config:
    return Config(num_rollouts_per_prompt=2, port=0, max_request_bytes=LIMIT,  # type: ignore[arg-type]
                  **kw)


def head(path: str, length: int | None, extra: str = "") -> bytes:
    framing = (f"Content-Length: {length}\r\n" if length is not None
               else "Transfer-Encoding: chunked\r\n")
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"{framing}{extra}\r\n").encode()


async def write_then_read(url: str, request_head: bytes, body_bytes: int,
                          chunked: bool = False) -> tuple[bool, Answer | None]:
    """Write the whole request, then read the answer, like a blocking client. Returns whether
    every byte could be written, and the answer (None: the connection was reset or closed
    before a complete answer)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    block = b" " * (1 << 20)
    wrote_all = True
    async with stream:
        try:
            await stream.send_all(request_head)
            for _ in range(body_bytes // len(block)):
                if chunked:
                    await stream.send_all(f"{len(block):x}\r\n".encode() + block + b"\r\n")
                else:
                    await stream.send_all(block)
            if chunked:
                await stream.send_all(b"0\r\n\r\n")
        except trio.BrokenResourceError:
            wrote_all = False
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="POST", target="/", headers=[("Host", "t")]))
        try:
            answer = await read_answer(stream, conn)
        except trio.BrokenResourceError:
            answer = None
    return wrote_all, answer


@pytest.mark.parametrize(("path", "chunked"), [
    ("/verify", False), ("/verify", True), ("/compare", False), ("/seed_session", False),
    ("/ng-rollout/1-0/verify", False),
])
async def test_a_client_that_writes_everything_first_reads_the_413(path: str,
                                                                   chunked: bool) -> None:
    async with running_server(cfg()) as url:
        with trio.fail_after(60):
            wrote_all, answer = await write_then_read(
                url, head(path, None if chunked else BODY), BODY, chunked)
        assert wrote_all, "the server closed while the client was still writing"
        assert answer is not None, "no answer: the connection was reset"
        status, headers, data = answer
        assert status == 413 and headers["connection"] == "close"
        detail = json.loads(data)
        assert detail["failure_kind"] == "too_large"
        assert str(LIMIT) in detail["detail"]


async def test_a_refused_large_body_is_read_too() -> None:
    """A 401 for a body over the 64 KiB kept-alive drain: answered, the body discarded."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GENRM_TEST_DISCARD_TOKEN", "t0ken")
        async with running_server(cfg(auth_token_env="GENRM_TEST_DISCARD_TOKEN")) as url:
            with trio.fail_after(60):
                wrote_all, answer = await write_then_read(url, head("/verify", 8 << 20),
                                                          8 << 20)
    assert wrote_all and answer is not None
    assert answer[0] == 401 and json.loads(answer[2])["failure_kind"] == "unauthorized"


async def test_discarding_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past DISCARD_BYTES the server closes: a client still writing then meets the close
    (what the bound costs), but one that reads while it writes has the 413 already."""
    monkeypatch.setattr(app_mod, "DISCARD_BYTES", 2 << 20)
    async with running_server(cfg()) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        answers: list[object] = []
        wrote_all = True
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="POST", target="/", headers=[("Host", "t")]))

            async def reader() -> None:
                answers.append(await read_answer(stream, conn))

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reader)
                    try:
                        await stream.send_all(head("/verify", BODY))
                        for _ in range(BODY >> 20):
                            await stream.send_all(b" " * (1 << 20))
                    except trio.BrokenResourceError:
                        wrote_all = False
    assert not wrote_all, "the server read more than DISCARD_BYTES of a refused body"
    (answer,) = answers
    assert isinstance(answer, tuple) and answer[0] == 413


async def test_discarding_is_bounded_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that declares a large body and then stalls is closed after DISCARD_S."""
    monkeypatch.setattr(app_mod, "DISCARD_S", 0.2)
    async with running_server(cfg()) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(head("/verify", BODY) + b" " * 1000)
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="POST", target="/", headers=[("Host", "t")]))
            with trio.fail_after(30):
                answer = await read_answer(stream, conn)
                assert answer is not None and answer[0] == 413
                # ... and then the server closes: the next read sees the end of the stream.
                assert await stream.receive_some(65536) == b""
