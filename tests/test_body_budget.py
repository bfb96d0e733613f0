"""``/verify`` bodies count in ``max_active_bytes`` while they are read and processed (issue 26).

A body reserves :data:`~genrm_trio.server.cohort.BODY_RESERVE_FACTOR` times its length before it
is read (its ``Content-Length``) or as it arrives (chunked); a body past
:data:`~genrm_trio.server.cohort.REFUSABLE_BODY_BYTES` whose reservation would pass the budget,
while another such body holds one, gets 429 ``overloaded`` (``Retry-After``) before it is read,
changes no state, and its connection is closed once the rest of its body was discarded. The
reservation is released when the answer is handed to the connection (or the request ends).
"""

from __future__ import annotations

from typing import Any

import h11
import msgspec
import trio

from genrm_trio.config import Config
from genrm_trio.server.cohort import BODY_RESERVE_FACTOR, REFUSABLE_BODY_BYTES, Failure
from tests.lifecycle_helpers import ScriptedJudge, body, open_registry
from tests.server_helpers import Answer, raw_http, read_answer, running_server


async def test_reserve_body_refuses_past_the_budget_and_changes_no_state() -> None:
    cfg = Config(num_rollouts_per_prompt=2, max_active_bytes=1000)
    async with open_registry(cfg, ScriptedJudge()) as registry:
        # Small bodies are counted but never refused, however far past the budget.
        assert registry.reserve_body(5000, refusable=False) is None
        registry.release_body(5000, refusable=False)
        # A lone refusable body is admitted even past the budget (progress) ...
        assert registry.reserve_body(1500) is None
        before = registry.snapshot()
        # ... and a second one that would pass it is refused, changing nothing but the count.
        refused = registry.reserve_body(10)
        assert isinstance(refused, Failure)
        assert (refused.status, refused.kind, refused.retry_after_s) == (429, "overloaded", 1.0)
        assert "max_active_bytes (1000) reached" in refused.detail
        after = registry.snapshot()
        assert after.pop("body_refusals") == before.pop("body_refusals") + 1
        assert after == before and after["body_bytes"] == 1500
        # More of the body that holds the reservation is checked against the others only.
        assert registry.reserve_body(10, more=True) is None
        registry.release_body(1510)
        assert registry.snapshot()["body_bytes"] == 0
        # Released: two bodies that fit together are both admitted.
        assert registry.reserve_body(400) is None
        assert registry.reserve_body(400) is None
        assert isinstance(registry.reserve_body(400), Failure)
        registry.release_body(400)
        registry.release_body(400)
        registry.begin_shutdown()


async def _until_open(url: str) -> None:
    """Poll ``/status`` until a cohort is open (nothing announces it); the caller bounds the
    time."""
    while True:
        if (await _cohorts(url))["active_cohorts"] >= 1:
            return
        await trio.sleep(0.02)


async def _chunked_verify(url: str, payload: bytes) -> Answer | None:
    """``POST /verify`` with ``payload`` sent chunked (no ``Content-Length``), 64 KiB a chunk,
    whole before the answer is read; the answer (None: closed without one)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(conn.send(h11.Request(
            method="POST", target="/verify",
            headers=[("Host", host), ("Content-Type", "application/json"),
                     ("Transfer-Encoding", "chunked")])))
        for start in range(0, len(payload), 65536):
            await stream.send_all(conn.send(h11.Data(data=payload[start:start + 65536])))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        return await read_answer(stream, conn)


def _verify(payload: bytes) -> tuple[str, str, bytes]:
    return ("POST", "/verify", payload)


async def _cohorts(url: str) -> dict[str, Any]:
    (answer,) = await raw_http(url, [("GET", "/status", b"")])
    status: dict[str, Any] = msgspec.json.decode(answer[2])
    return status["cohorts"]


async def test_a_large_body_past_the_budget_gets_429_before_it_is_read() -> None:
    """End to end on loopback: a large member waits in its open cohort, holding its body's
    reservation; a second large body that would pass the budget gets 429 with Retry-After,
    its connection closed after the answer (the request after it on the same connection is
    never read), no cohort opened; once the first cohort is answered the budget is free
    again and the same large body is admitted."""
    size = 2 * REFUSABLE_BODY_BYTES
    cfg = Config(num_rollouts_per_prompt=2, max_active_bytes=BODY_RESERVE_FACTOR * size + 2**20,
                 memory_limit_bytes=2**31)
    big_a = msgspec.json.encode(body(0, group="a", padding="x" * size))
    big_b = msgspec.json.encode(body(0, group="b", padding="y" * size))
    with trio.fail_after(60):
        async with running_server(cfg) as url, trio.open_nursery() as nursery:
            first: list[tuple[int, dict[str, str], bytes]] = []
            answered = trio.Event()

            async def wait_in_cohort() -> None:
                first.extend(await raw_http(url, [_verify(big_a)], timeout_s=60.0))
                answered.set()

            nursery.start_soon(wait_in_cohort)
            await _until_open(url)
            held = await _cohorts(url)
            assert held["body_bytes"] >= BODY_RESERVE_FACTOR * size

            answers = await raw_http(
                url, [_verify(big_b), _verify(msgspec.json.encode(body(1, group="a")))])
            assert len(answers) == 1, answers  # closed after the 429: the second never sent
            status, headers, payload = answers[0]
            assert status == 429 and headers["retry-after"] == "1"
            assert headers["connection"] == "close"
            error = msgspec.json.decode(payload)
            assert error["failure_kind"] == "overloaded"
            assert "max_active_bytes" in error["detail"]
            refused = await _cohorts(url)
            assert refused["active_cohorts"] == 1 and refused["body_refusals"] == 1
            assert refused["body_bytes"] == held["body_bytes"]  # released what it reserved
            # Chunked: reserved as it arrives, refused once past the line, what it had
            # reserved released.
            chunked = await _chunked_verify(url, big_b)
            assert chunked is not None and chunked[0] == 429, chunked
            assert chunked[1]["connection"] == "close"
            refused = await _cohorts(url)
            assert refused["active_cohorts"] == 1 and refused["body_refusals"] == 2
            assert refused["body_bytes"] == held["body_bytes"]
            (metrics,) = await raw_http(url, [("GET", "/metrics", b"")])
            assert b"genrm_body_refusals_total 2.0" in metrics[2]

            # The open cohort completes; its member's reservation is released.
            (sibling,) = await raw_http(url, [_verify(msgspec.json.encode(body(1, group="a")))])
            assert sibling[0] == 200
            await answered.wait()
            assert first[0][0] == 200
            assert (await _cohorts(url))["body_bytes"] == 0

            # Admitted now (a replay of the cohort's member 0, on a kept-alive connection).
            again = await raw_http(url, [_verify(big_a), ("GET", "/healthz", b"")])
            assert [a[0] for a in again] == [200, 200]
            assert (await _cohorts(url))["body_bytes"] == 0
