"""``/verify`` bodies count in ``max_active_bytes`` while they are read and processed (issue 26).

A body reserves :data:`~genrm_trio.server.cohort.BODY_RESERVE_FACTOR` times its length before it
is read (its ``Content-Length``) or as it arrives (chunked); a body past
:data:`~genrm_trio.server.cohort.REFUSABLE_BODY_BYTES` whose reservation would pass the budget,
while another such body holds one, waits unread for room up to
:data:`~genrm_trio.server.cohort.BODY_ROOM_WAIT_S` (chunked: not at all), then gets 429
``overloaded`` (``Retry-After``) before it is read, changes no state, and its connection is
closed once the rest of its body was discarded. The reservation is released when the member
waits in its cohort, when the answer is handed to the connection, or when the request ends.
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


async def test_the_lone_body_is_not_let_past_the_budget_beside_unsent_answers() -> None:
    """The exemption (a lone refusable body past the budget, for progress) holds against
    members of open cohorts, not against answers waiting for their clients: those drain by
    themselves, so the body waits for them instead of adding its share on top."""
    cfg = Config(num_rollouts_per_prompt=2, max_active_bytes=1000)
    async with open_registry(cfg, ScriptedJudge()) as registry:
        registry.answer_sending(900)  # a slow reader's answer
        refused = registry.reserve_body(200)
        assert isinstance(refused, Failure) and refused.kind == "overloaded"
        assert registry.snapshot()["body_bytes"] == 0
        assert registry.reserve_body(100) is None  # fits beside it
        registry.release_body(100)
        registry.answer_sent(900)
        # Nothing unsent: a body larger than the whole budget is still served.
        assert registry.reserve_body(1500) is None
        registry.release_body(1500)
        # Unsent answers and the lone body within the budget together: exempt as before.
        registry.answer_sending(300)
        assert registry.reserve_body(700) is None
        # More of the body that holds the lone reservation: checked against the others only.
        assert registry.reserve_body(400, more=True) is None
        registry.release_body(1100)
        registry.answer_sent(300)
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


async def test_reserve_body_within_waits_for_room_then_refuses_at_its_deadline(
        autojump_clock: trio.abc.Clock) -> None:
    cfg = Config(num_rollouts_per_prompt=2, max_active_bytes=1000)
    async with open_registry(cfg, ScriptedJudge()) as registry:
        assert registry.reserve_body(1500) is None  # a lone large body: admitted
        got: list[Failure | None] = []

        async def second() -> None:
            got.append(await registry.reserve_body_within(10, trio.current_time() + 5))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            await trio.sleep(1)
            waiting = registry.snapshot()
            assert got == [] and waiting["bodies_waiting"] == 1 and waiting["body_bytes"] == 1500
            registry.release_body(1500)  # room: the waiting body gets it, within its deadline
        assert got == [None]
        after = registry.snapshot()
        assert (after["body_bytes"], after["body_refusals"], after["bodies_waiting"]) == (10, 0, 0)

        # No room before its deadline: 429 then, counted once, nothing reserved.
        started = trio.current_time()
        refused = await registry.reserve_body_within(995, started + 5)
        assert isinstance(refused, Failure) and refused.status == 429
        assert "max_active_bytes (1000) reached" in refused.detail
        assert trio.current_time() - started == 5
        after = registry.snapshot()
        assert (after["body_bytes"], after["body_refusals"], after["bodies_waiting"]) == (10, 1, 0)
        registry.release_body(10)
        registry.begin_shutdown()


class _SlowSender:
    """A ``POST /verify`` whose ``Content-Length`` is declared and whose body is sent in two
    parts, the second when the test says: its reservation is held while it is read."""

    def __init__(self, url: str, payload: bytes) -> None:
        self.url = url
        self.payload = payload
        self.rest = trio.Event()
        self.answer: Answer | None = None

    async def run(self) -> None:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            half = len(self.payload) // 2
            await stream.send_all(conn.send(h11.Request(
                method="POST", target="/verify",
                headers=[("Host", host), ("Content-Type", "application/json"),
                         ("Content-Length", str(len(self.payload)))])))
            await stream.send_all(conn.send(h11.Data(data=self.payload[:half])))
            await self.rest.wait()
            await stream.send_all(conn.send(h11.Data(data=self.payload[half:])))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            self.answer = await read_answer(stream, conn)


async def _until(url: str, check: Any) -> dict[str, Any]:
    """Poll ``/status`` until ``check(cohorts)`` holds; the caller bounds the time."""
    while True:
        cohorts = await _cohorts(url)
        if check(cohorts):
            return cohorts
        await trio.sleep(0.02)


async def test_a_large_body_waits_unread_for_room_and_a_waiting_member_holds_none() -> None:
    """End to end on loopback, with room for one large body's reservation: a large member that
    waits in its open cohort holds no reservation (its bytes count as the cohort's); a large
    body being read holds one; a second large body with a ``Content-Length`` then waits,
    unread, for room (no 429: it may be a member of an open cohort) and is admitted once the
    first is read and registered; a chunked large body is refused at once (429,
    ``Retry-After``, connection closed, the request after it never read). Every member is
    then answered, and nothing stays reserved."""
    size = 2 * REFUSABLE_BODY_BYTES
    cfg = Config(num_rollouts_per_prompt=2, max_active_bytes=BODY_RESERVE_FACTOR * size + 2**20,
                 memory_limit_bytes=2**31)

    def big(group: str, slot: int = 0) -> bytes:
        return msgspec.json.encode(body(slot, group=group, padding=group * size))

    with trio.fail_after(60):
        async with running_server(cfg) as url, trio.open_nursery() as nursery:
            answers: dict[str, Answer] = {}

            async def send(name: str, payload: bytes) -> None:
                (answers[name],) = await raw_http(url, [_verify(payload)], timeout_s=60.0)

            nursery.start_soon(send, "a0", big("a"))
            waiting = await _until(url, lambda c: c["active_cohorts"] == 1)
            waiting = await _until(url, lambda c: c["waiters"] == 1)
            assert waiting["body_bytes"] == 0 and waiting["active_bytes"] >= size

            slow = _SlowSender(url, big("b"))
            nursery.start_soon(slow.run)
            reading = await _until(url, lambda c: c["body_bytes"] >= BODY_RESERVE_FACTOR * size)
            nursery.start_soon(send, "c0", big("c"))
            held = await _until(url, lambda c: c["bodies_waiting"] == 1)
            assert held["active_cohorts"] == 1 and held["body_refusals"] == 0
            assert held["body_bytes"] == reading["body_bytes"]

            # Chunked: no length to wait for; refused once past the line, its bytes released.
            chunked = await _chunked_verify(url, big("d"))
            assert chunked is not None and chunked[0] == 429, chunked
            assert chunked[1]["connection"] == "close" and chunked[1]["retry-after"] == "1"
            error = msgspec.json.decode(chunked[2])
            assert error["failure_kind"] == "overloaded" and "max_active_bytes" in error["detail"]
            refused = await _cohorts(url)
            assert refused["body_refusals"] == 1 and refused["active_cohorts"] == 1
            assert refused["body_bytes"] == held["body_bytes"]
            (metrics,) = await raw_http(url, [("GET", "/metrics", b"")])
            assert b"genrm_body_refusals_total 1.0" in metrics[2]
            assert b"genrm_bodies_waiting 1.0" in metrics[2]

            slow.rest.set()  # b is read and registered; c gets its room
            opened = await _until(url, lambda c: c["active_cohorts"] == 3)
            assert opened["bodies_waiting"] == 0
            for group in ("a", "b", "c"):
                nursery.start_soon(send, f"{group}1", msgspec.json.encode(body(1, group=group)))
            await _until(url, lambda c: c["active_cohorts"] == 0 and c["waiters"] == 0)
            # A replay of a large member on a kept-alive connection: reserved, answered,
            # released.
            again = await raw_http(url, [_verify(big("a")), ("GET", "/healthz", b"")])
            assert [a[0] for a in again] == [200, 200]
            assert (await _cohorts(url))["body_bytes"] == 0
        assert slow.answer is not None and slow.answer[0] == 200
        assert {k: a[0] for k, a in answers.items()} == {
            "a0": 200, "a1": 200, "b1": 200, "c0": 200, "c1": 200}
