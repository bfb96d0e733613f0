"""The trainer hooks' client (``genrm_trio/integrations/client.py``) against the real server.

The server runs in process on 127.0.0.1 port 0 (built-in heuristic judge, or the mock judge for
judge faults) and the client runs on the same trio loop: it is written against anyio, so trio
and the trainers' asyncio loops (tests/test_integrations_trl.py) both run it. Real sockets, so
no autojump clock here, except for the tests whose transport is an ``httpx2.MockTransport``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx2
import msgspec
import pytest
import trio
import trio.testing

from genrm_trio.config import load_config
from genrm_trio.integrations.client import (
    DEFAULT_MAX_CONNECTIONS,
    Failed,
    GenRMClient,
    Masked,
    Member,
    RequestRefused,
    Rewarded,
    ServerSettings,
    ServerUnreachable,
    WaitExceeded,
    bearer_token,
)
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.serve import run_server

N = 4
TOKEN = "client-test-token-0123456789"
TOKEN_ENV = "GENRM_TEST_CLIENT_TOKEN"
T = TypeVar("T")


@asynccontextmanager
async def server(*settings: str, n: int = N, judge: MockJudgeState | None = None
                 ) -> AsyncIterator[str]:
    """A server on a loopback port 0; ``judge``: the mock judge in front of it (in process)."""
    async with trio.open_nursery() as nursery:
        judge_urls: list[str] = []
        if judge is not None:
            judge_urls.append(await nursery.start(
                functools.partial(run_mock_judge, MockJudgeSettings(), state=judge)))
        cfg = load_config(None, [
            "port=0", f"num_rollouts_per_prompt={n}",
            # Long enough for a starved machine; the tests of the deadline pass a short one.
            "cohort_collection_timeout_s=30", "cohort_evaluation_timeout_s=30",
            "judge_request_timeout_s=5", "genrm_parse_retries=0",
            "genrm_parse_retry_sleep_s=0.01",
            *([f'judge.base_urls=["{judge_urls[0]}"]'] if judge_urls else []),
            *settings], {})
        url: str = await nursery.start(run_server, cfg)
        yield url
        nursery.cancel_scope.cancel()


def member(group: str, slot: int, text: str | None = None) -> Member:
    answer = text if text is not None else f"answer {slot} " + "more " * slot
    return Member(
        group_id=group, slot=slot,
        responses_create_params={"input": [{"role": "user", "content": f"question {group}"}]},
        response={"object": "response", "status": "completed", "output": [
            {"type": "message", "role": "assistant", "id": "msg_0", "status": "completed",
             "content": [{"type": "output_text", "text": answer, "annotations": []}]}]})


def group_of(name: str, n: int = N) -> list[Member]:
    return [member(name, slot) for slot in range(n)]


def dispositions(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "cohort"]


async def status(url: str) -> dict[str, Any]:
    async with httpx2.AsyncClient() as http:
        return dict((await http.get(url + "/status")).json())


async def until(read: Callable[[], Awaitable[T]], done: Callable[[T], bool]) -> None:
    """Poll the server (over HTTP: it is in another task's hands) until ``done(read())``."""
    with trio.fail_after(20):
        while not done(await read()):  # noqa: ASYNC110 - the state lives behind HTTP
            await trio.sleep(0.02)


@pytest.fixture
def cohort_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="genrm_trio.server"):
        yield caplog


# ----------------------------------------------------------------------------- outcomes


async def test_groups_in_any_order_get_their_slots_rewards(
        cohort_log: pytest.LogCaptureFixture) -> None:
    async with server() as url, GenRMClient(url, max_connections=N) as client:
        settings = await client.settings()
        assert settings == ServerSettings(30.0, 30.0, N)
        members = [m for name in ("a", "b", "c") for m in group_of(name)]
        # Slot-major order: with a bound of one group, whole-group admission is what makes
        # this finish (a connection per member in this order would hold four first slots).
        order = sorted(range(len(members)), key=lambda i: (members[i].slot, i))
        outcomes = await client.verify_groups([members[i] for i in order])
        by_member = {(members[i].group_id, members[i].slot): o
                     for i, o in zip(order, outcomes, strict=True)}
        assert all(isinstance(o, Rewarded) for o in outcomes)
        # Each member gets its own slot's reward, and the same texts give the same rewards.
        rewards = {g: [by_member[(g, s)].reward for s in range(N)]  # type: ignore[union-attr]
                   for g in "abc"}
        assert len(set(rewards["a"])) > 1
        for name in "abc":
            answers = [by_member[(name, s)].answer for s in range(N)]  # type: ignore[union-attr]
            assert [a["_ng_rollout_index"] for a in answers] == list(range(N))
            assert {a["_ng_group_id"] for a in answers} == {name}
    lines = dispositions(cohort_log)
    assert sorted(r.key for r in lines) == [f"group '{g}' attempt 0" for g in "abc"]  # type: ignore[attr-defined]
    assert {(r.kind, r.members) for r in lines} == {("completed", N)}  # type: ignore[attr-defined]


async def test_a_masked_cohort_is_masked_with_the_servers_reason() -> None:
    judge = MockJudgeState(fault=Fault.HTTP_503)
    async with server(judge=judge) as url, GenRMClient(url) as client:
        outcomes = await client.verify_groups(group_of("masked"))
    assert all(isinstance(o, Masked) for o in outcomes)
    assert all("503" in o.reason for o in outcomes)  # type: ignore[union-attr]
    assert judge.calls >= 1


async def test_a_cohort_failure_is_an_outcome_and_a_refusal_raises() -> None:
    async with server("cohort_collection_timeout_s=0.3") as url, GenRMClient(url) as client:
        # Three of four members: the collection deadline fails the cohort.
        outcomes = await client.verify_groups(group_of("short")[:3])
        assert {(type(o), o.status, o.kind) for o in outcomes} == {  # type: ignore[union-attr]
            (Failed, 503, "cohort_incomplete")}
        # The same slot with another answer, while its cohort collects: 409 conflict, raised
        # with the server's detail; the member already there is unchanged.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.verify, member("clash", 0, "first answer"))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(RequestRefused) as info:
                await client.verify(member("clash", 0, "another answer"))
            nursery.cancel_scope.cancel()
    assert (info.value.status, info.value.kind) == (409, "conflict")
    assert "slot 0" in info.value.detail or "different" in info.value.detail


async def test_the_first_refusal_cancels_the_other_members_of_the_batch() -> None:
    async with server() as url, GenRMClient(url) as client:
        bad = Member("bad", N + 3, {"input": "q"}, {"output": []})  # slot outside [0, N)
        with trio.fail_after(20), pytest.raises(RequestRefused) as info:
            # The good group never completes (a member missing): without the cancel, this
            # would wait out the 30 s collection deadline.
            await client.verify_groups([*group_of("waits")[:2], bad])
        assert (info.value.status, info.value.kind) == (422, "bad_coordinates")
        await until(lambda: status(url), lambda s: s["cohorts"]["waiters"] == 0)


# ----------------------------------------------------------------------------- re-sends


class CutOnce(httpx2.AsyncBaseTransport):
    """A real transport that cuts the first ``/verify`` of one slot mid-wait: it lets the
    request reach the server, waits until every task is blocked (the server's handler waits
    on its cohort), cancels it (its connection closes) and raises ``ReadError``, as a dropped
    connection would. The client's re-send then goes through untouched."""

    def __init__(self, slot: int) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.slot = slot
        self.cut = 0
        self.bodies: list[bytes] = []
        self.resent = trio.Event()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path != "/verify":
            return await self.inner.handle_async_request(request)
        body = await request.aread()
        if msgspec.json.decode(body)["_ng_rollout_index"] != self.slot:
            return await self.inner.handle_async_request(request)
        self.bodies.append(body)
        if self.cut:
            self.resent.set()
            return await self.inner.handle_async_request(request)
        self.cut += 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.inner.handle_async_request, request)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        raise httpx2.ReadError("injected: connection lost while waiting")

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_connection_lost_mid_wait_is_resent_and_reattaches(
        cohort_log: pytest.LogCaptureFixture) -> None:
    cutter = CutOnce(slot=0)
    async with server() as url:
        async with GenRMClient(url) as control:
            expected = await control.verify_groups(group_of("control"))
        async with GenRMClient(url, transport=cutter) as client:
            first = [member("cut", 0)]
            rest = [member("cut", s) for s in range(1, N)]
            async with trio.open_nursery() as nursery:
                results: dict[str, list[Any]] = {}

                async def send(name: str, members: list[Member]) -> None:
                    results[name] = await client.verify_groups(members)

                nursery.start_soon(send, "first", first)
                with trio.fail_after(20):
                    await cutter.resent.wait()
                    # The re-sent member waits again (the cohort still lacks its others) and
                    # the cut one's waiter goes once the server notices (its cohort is half a
                    # second old): one member, one waiter.
                    await until(lambda: status(url), lambda s: s["cohorts"]["waiters"] == 1)
                    assert (await status(url))["cohorts"]["active_cohorts"] == 1
                nursery.start_soon(send, "rest", rest)
    assert cutter.cut == 1 and len(cutter.bodies) == 2
    assert cutter.bodies[0] == cutter.bodies[1]  # the identical member, byte for byte
    outcomes = results["first"] + results["rest"]
    assert [o.reward for o in outcomes] == [o.reward for o in expected]  # type: ignore[union-attr]
    lines = [r for r in dispositions(cohort_log) if "'cut'" in r.key]  # type: ignore[attr-defined]
    assert [(r.kind, r.members) for r in lines] == [("completed", N)]  # type: ignore[attr-defined]
    # The server saw the first connection go away while the member waited.
    assert any("client went away" in r.getMessage() for r in cohort_log.records)


async def test_an_overloaded_server_is_retried_after_its_retry_after() -> None:
    async with server("max_active_cohorts=1") as url, GenRMClient(url) as client:
        async with trio.open_nursery() as nursery:
            done: dict[str, list[Any]] = {}

            async def send(name: str, members: list[Member]) -> None:
                done[name] = await client.verify_groups(members)

            # Group "held" opens the one cohort allowed; group "later" is refused with 429
            # (Retry-After: 1) until "held" completes.
            nursery.start_soon(send, "held", group_of("held")[:3])
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(send, "later", group_of("later"))
            await until(lambda: _metric(url, 'genrm_verify_duration_seconds_count{outcome='
                                        '"overloaded"}'), lambda count: count >= 1)
            nursery.start_soon(send, "rest", group_of("held")[3:])
    assert all(isinstance(o, Rewarded) for v in done.values() for o in v)
    assert len(done["later"]) == N


async def _metric(url: str, name: str) -> float:
    async with httpx2.AsyncClient() as http:
        text = (await http.get(url + "/metrics")).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name)]
    return sum(values)


async def test_the_bearer_token_is_sent_and_a_wrong_one_fails_before_any_member(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with server(f"auth_token_env={TOKEN_ENV}") as url:
        async with GenRMClient(url, token_env=TOKEN_ENV) as client:
            assert all(isinstance(o, Rewarded)
                       for o in await client.verify_groups(group_of("authed")))
        for token in (None, "wrong-token"):
            async with GenRMClient(url, token=token) as client:
                with pytest.raises(RequestRefused) as info:
                    await client.verify_groups(group_of("refused"))
            assert (info.value.status, info.value.kind) == (401, "unauthorized")
            assert TOKEN not in str(info.value)
        assert (await status_with(url, TOKEN))["cohorts"]["active_cohorts"] == 0


async def status_with(url: str, token: str) -> dict[str, Any]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        return dict((await http.get(url + "/status")).json())


def test_bearer_token_sources() -> None:
    assert bearer_token(None, None) is None
    assert bearer_token(" tok ", "IGNORED") == "tok"
    assert bearer_token(None, "V", {"V": "abc\n"}) == "abc"
    for env in ({}, {"V": "  "}):
        with pytest.raises(ValueError, match="'V'"):
            bearer_token(None, "V", env)


# ----------------------------------------------------------------------------- no server
# A MockTransport in place of the server: the answers a proxy or a broken server gives.

STATUS_BODY = {"config": {"num_rollouts_per_prompt": 2, "cohort_collection_timeout_s": 5.0,
                          "cohort_evaluation_timeout_s": 7.0}}


def ok_body(slot: int) -> dict[str, Any]:
    return {"reward": 1.5 + slot, "mask_sample": False, "_ng_rollout_index": slot}


async def test_proxy_errors_are_resent_then_give_up(autojump_clock: trio.abc.Clock) -> None:
    calls: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        calls.append(request.url.path)
        if request.url.path == "/status":
            return httpx2.Response(200, json=STATUS_BODY)
        if calls.count("/verify") <= 2:  # HAProxy: no replica up, then a gateway timeout
            return httpx2.Response(503 if len(calls) == 2 else 504, text="<html>proxy</html>")
        return httpx2.Response(200, json=ok_body(1))

    async with GenRMClient("http://genrm", transport=httpx2.MockTransport(handler)) as client:
        outcome = await client.verify(member("g", 1))
    assert outcome == Rewarded(2.5, ok_body(1))
    assert calls == ["/status", "/verify", "/verify", "/verify"]

    def refused(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused")

    async with GenRMClient("http://genrm", transport=httpx2.MockTransport(refused),
                           wait_s=10, transport_retries=3) as client:
        with pytest.raises(ServerUnreachable, match="4 tries"):
            await client.verify(member("g", 0))


async def test_no_answer_within_the_servers_deadlines_is_an_error(
        autojump_clock: trio.abc.Clock) -> None:
    async def hang(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/status":
            return httpx2.Response(200, json=STATUS_BODY)
        await trio.sleep_forever()
        raise AssertionError

    start = trio.current_time()
    async with GenRMClient("http://genrm", transport=httpx2.MockTransport(hang),
                           slack_s=3) as client:
        with pytest.raises(WaitExceeded, match="15 s"):
            await client.verify(member("g", 0))
    # 5 s to collect + 7 s to evaluate + 3 s of slack, read from /status: never shorter.
    assert trio.current_time() - start == pytest.approx(15.0)


async def test_a_server_without_status_gets_the_contract_deadlines(
        autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture) -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/status":
            return httpx2.Response(404, json={"detail": "Not Found"})
        if request.headers.get("x-seen"):
            raise AssertionError
        return httpx2.Response(429, headers={"Retry-After": "2"},
                               json={"detail": "busy", "failure_kind": "overloaded"})

    async with GenRMClient("http://genrm", transport=httpx2.MockTransport(handler),
                           max_overload_wait_s=9) as client:
        assert await client.settings() == ServerSettings(1800.0, 1800.0, None, from_status=False)
        start = trio.current_time()
        with pytest.raises(RequestRefused) as info:
            await client.verify(member("g", 0))
    # Four waits of 2 s fit in the 9 s budget; the fifth would not.
    assert trio.current_time() - start == pytest.approx(8.0)
    assert (info.value.status, info.value.kind) == (429, "overloaded")
    assert any("assuming the contract's deadlines" in r.getMessage() for r in caplog.records)


async def test_a_200_without_a_finite_reward_is_refused() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, json={"reward": None, "mask_sample": False})

    async with GenRMClient("http://genrm", transport=httpx2.MockTransport(handler),
                           wait_s=5) as client:
        with pytest.raises(RequestRefused, match="no finite reward"):
            await client.verify(member("g", 0))


def test_bad_client_settings_name_the_argument() -> None:
    for kwargs, name in (({"max_connections": 0}, "max_connections"),
                         ({"wait_s": float("inf")}, "wait_s"),
                         ({"slack_s": 0}, "slack_s"),
                         ({"transport_retries": -1}, "transport_retries")):
        with pytest.raises(ValueError, match=name):
            GenRMClient("http://genrm", **kwargs)  # type: ignore[arg-type]


async def test_a_group_larger_than_the_bound_is_refused_before_sending() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        raise AssertionError("nothing may be sent")

    async with GenRMClient("http://genrm", max_connections=3, wait_s=5,
                           transport=httpx2.MockTransport(handler)) as client:
        with pytest.raises(ValueError, match="max_connections >= 4"):
            await client.verify_groups(group_of("big"))


# ----------------------------------------------------------------------------- the pool bound


async def test_64_members_at_a_bound_of_32_connections_finish_in_any_order(
        cohort_log: pytest.LogCaptureFixture) -> None:
    """Whole-group admission: 16 groups of 4, sent slot-major (every group's slot 0 first),
    with 32 connections. Admitting members one by one in this order would hold slots 0 and 1
    of all 16 groups on the 32 connections, and no cohort could complete."""
    members = [m for g in range(16) for m in group_of(f"pool{g}")]
    slot_major = sorted(members, key=lambda m: (m.slot, m.group_id))
    async with server() as url, GenRMClient(url, max_connections=32) as client:
        with trio.fail_after(25):  # below the 30 s collection deadline a deadlock would hit
            outcomes = await client.verify_groups(slot_major)
    assert len(outcomes) == 64 and all(isinstance(o, Rewarded) for o in outcomes)
    lines = dispositions(cohort_log)
    assert len(lines) == 16
    assert {(r.kind, r.members) for r in lines} == {("completed", N)}  # type: ignore[attr-defined]


async def test_a_thread_per_waiting_member_deadlocks_at_the_same_bound() -> None:
    """Why the hooks never block a pool thread per member: the same 64 members, slot-major,
    each sent by a blocking call on one of 32 threads. The 32 threads hold slots 0 and 1 of
    every group, waiting for slots 2 and 3, which wait for a thread: nothing completes until
    the collection deadline fails every cohort."""
    members = [m for g in range(16) for m in group_of(f"threads{g}")]
    slot_major = sorted(members, key=lambda m: (m.slot, m.group_id))

    def blocking(url: str) -> list[int]:
        with httpx2.Client(timeout=60) as http, \
                concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
            return list(pool.map(lambda m: http.post(url + "/verify", content=m.encode())
                                 .status_code, slot_major))

    async with server("cohort_collection_timeout_s=2") as url:
        with trio.fail_after(30):
            statuses = await trio.to_thread.run_sync(blocking, url)
    assert statuses == [503] * 64  # cohort_incomplete, every member, not one reward


class PooledCohorts(httpx2.AsyncBaseTransport):
    """A connection pool of ``connections`` in front of a server that answers a group's members
    only once all ``n`` of them are in (a cohort): a member holds its connection from its send to
    its answer, and one beyond the pool waits for a free connection, as in httpx2's own pool.
    ``most``: the most members in at once."""

    def __init__(self, connections: int, n: int) -> None:
        self.pool = trio.Semaphore(connections)
        self.n = n
        self.present: dict[str, set[int]] = {}
        self.full: dict[str, trio.Event] = {}
        self.inside = self.most = 0

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/status":
            return httpx2.Response(200, json=STATUS_BODY)
        async with self.pool:
            self.inside += 1
            self.most = max(self.most, self.inside)
            body = msgspec.json.decode(await request.aread())
            group, slot = body["_ng_group_id"], body["_ng_rollout_index"]
            self.present.setdefault(group, set()).add(slot)
            full = self.full.setdefault(group, trio.Event())
            if len(self.present[group]) == self.n:
                full.set()
            await full.wait()
            self.inside -= 1
        return httpx2.Response(200, json=ok_body(slot))


async def test_512_members_at_the_default_bound_of_256_finish(
        autojump_clock: trio.abc.Clock) -> None:
    """The hooks' own bound (``DEFAULT_MAX_CONNECTIONS``, 256, what ``GenRMReward`` uses
    unless told), with twice as many members waiting: 128 groups of 4, slot-major (every
    group's slot 0 first). A client that sent every member to its pool at once would fill the
    256 connections with slots 0 and 1 of all 128 groups and wait forever: the ``fail_after``
    (autojump clock: below the 5 + 7 s of deadlines the client reads, plus its slack) says so
    instead of a hang."""
    assert DEFAULT_MAX_CONNECTIONS == 256
    members = [m for g in range(128) for m in group_of(f"bound{g}")]
    slot_major = sorted(members, key=lambda m: (m.slot, m.group_id))
    pool = PooledCohorts(DEFAULT_MAX_CONNECTIONS, N)
    async with GenRMClient("http://genrm", transport=pool) as client:
        assert client.max_connections == DEFAULT_MAX_CONNECTIONS
        with trio.fail_after(10):
            outcomes = await client.verify_groups(slot_major)
    assert outcomes == [Rewarded(1.5 + m.slot, ok_body(m.slot)) for m in slot_major]
    assert pool.most == DEFAULT_MAX_CONNECTIONS  # the pool was full, and never over it
