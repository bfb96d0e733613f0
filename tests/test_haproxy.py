"""Scale-out: two ``genrm-trio serve`` replicas behind HAProxy with the shipped
``configs/haproxy.cfg``, all on loopback (CONTRACT section 9).

Every group must stay whole on one replica (HAProxy hashes its key from the buffered body), a
client that goes away through HAProxy must still release its waiter on the replica, and a
replica that dies must leave the other replica's groups alone while new groups (and
replacement attempts of the dead replica's groups) complete on the survivor. HAProxy is the
Debian package: ``.ci/run`` installs it, and the fixture below tries too when it is missing.
Every process is started here and stopped by pid (``launch_process`` / ``open_haproxy``).
"""

from __future__ import annotations

import functools
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.haproxy import (
    REPLICA_HEADER,
    HaproxyError,
    ensure_haproxy,
    open_haproxy,
)
from genrm_trio.bench.processes import launch_process
from tests.process_helpers import require_program

REPO = Path(__file__).resolve().parent.parent
N = 8
MAX_REQUEST_BYTES = 256 * 1024
READY = "genrm-trio serve listening on "
#: A hang guard for a whole scenario (real processes, no clock to jump), not a timing goal:
#: a scenario takes about 4 s here, and over 40 s at an eighth of a core.
SCENARIO_BOUND_S = 240.0


@pytest.fixture(scope="session")
def haproxy_installed() -> str:
    return require_program(ensure_haproxy, HaproxyError, "haproxy")


@dataclass
class Stack:
    url: str
    replicas: dict[str, str]  # HAProxy server name -> replica base URL
    processes: dict[str, trio.Process]
    client: httpx2.AsyncClient

    async def status(self, name: str) -> dict[str, Any]:
        answer = await self.client.get(self.replicas[name] + "/status")
        assert answer.status_code == 200
        body: dict[str, Any] = answer.json()
        return body

    async def cohorts(self, name: str) -> dict[str, int]:
        snapshot: dict[str, int] = (await self.status(name))["cohorts"]
        return snapshot

    async def wait_for(self, name: str, key: str, value: int, limit_s: float = 15.0) -> None:
        """Poll replica ``name``'s /status until ``cohorts[key] == value`` (real sockets, real
        processes: there is no clock to jump)."""
        with trio.fail_after(limit_s):
            while True:
                if (await self.cohorts(name))[key] == value:
                    return
                await trio.sleep(0.05)


@asynccontextmanager
async def two_replicas_behind_haproxy(tmp: Path) -> AsyncIterator[Stack]:
    sets = {
        "num_rollouts_per_prompt": str(N),
        "cohort_collection_timeout_s": "30",
        "max_request_bytes": str(MAX_REQUEST_BYTES),
        "log_level": "WARNING",
    }
    cmd = [sys.executable, "-m", "genrm_trio.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    async with AsyncExitStack() as stack:
        procs = []
        for i in (1, 2):
            launch = launch_process(cmd, log_path=tmp / f"replica{i}.log", ready_prefix=READY,
                                    cwd=str(REPO))
            procs.append((i, await stack.enter_async_context(launch)))
        names = {f"r{i}": p for i, p in procs}
        addresses = [p.base_url.removeprefix("http://") for _, p in procs]
        proxy = await stack.enter_async_context(
            open_haproxy(addresses, max_request_bytes=MAX_REQUEST_BYTES,
                         log_path=tmp / "haproxy.log"))
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=64)
        client = await stack.enter_async_context(
            httpx2.AsyncClient(timeout=60.0, limits=limits, trust_env=False))
        yield Stack(proxy.url, {n: p.base_url for n, p in names.items()},
                    {n: p.process for n, p in names.items()}, client)


def member_body(group: str, slot: int, *, attempt: int = 0, pad: int = 0,
                legacy_task: int | None = None) -> bytes:
    """A ``/verify`` member; the routing key goes LAST, after ``pad`` bytes of answer text, so
    HAProxy only finds it when it has buffered the whole body."""
    body: dict[str, Any] = {
        "responses_create_params": {"input": f"prompt of {group}"},
        "response": {"output": [{"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": f"answer {slot} of {group} " + "x" * pad}]}]},
        "_ng_rollout_index": slot,
    }
    if legacy_task is None:
        body["_ng_group_attempt"] = attempt
        body["_ng_group_id"] = group
    else:
        body["_ng_task_index"] = legacy_task
    return msgspec.json.encode(body)


@dataclass(frozen=True)
class Answer:
    status: int
    replica: str | None
    body: Any


async def post(stack: Stack, body: bytes, path: str = "/verify") -> Answer:
    try:
        answer = await stack.client.post(stack.url + path, content=body,
                                         headers={"content-type": "application/json"})
    except httpx2.TransportError:
        return Answer(loadgen.TRANSPORT_ERROR, None, None)
    try:
        decoded = answer.json()
    except ValueError:
        decoded = answer.text
    return Answer(answer.status_code, answer.headers.get(REPLICA_HEADER), decoded)


async def send_group(stack: Stack, bodies: Sequence[bytes]) -> list[Answer]:
    """All members at once; odd slots come as NeMo Gym sends them with observability on
    (``/ng-rollout/<id>/verify``): HAProxy routes by the body, so they join their group."""
    answers: list[Answer | None] = [None] * len(bodies)

    async def one(i: int) -> None:
        answers[i] = await post(stack, bodies[i], f"/ng-rollout/t-{i}/verify" if i % 2 else
                                "/verify")

    async with trio.open_nursery() as nursery:
        for i in range(len(bodies)):
            nursery.start_soon(one, i)
    return [a for a in answers if a is not None]


def rewarded(answers: Sequence[Answer]) -> bool:
    return all(a.status == 200 and isinstance(a.body, dict) and not a.body["mask_sample"]
               and isinstance(a.body["reward"], float) for a in answers)


async def send_groups(stack: Stack, groups: dict[str, list[bytes]],
                      in_flight: int = 25) -> dict[str, list[Answer]]:
    """Every group's members at once, ``in_flight`` groups at a time."""
    out: dict[str, list[Answer]] = {}
    limiter = trio.CapacityLimiter(in_flight)

    async def one(gid: str) -> None:
        async with limiter:
            out[gid] = await send_group(stack, groups[gid])

    async with trio.open_nursery() as nursery:
        for gid in groups:
            nursery.start_soon(one, gid)
    return out


def single_replica(answers: Sequence[Answer]) -> str:
    served = {a.replica for a in answers}
    assert len(served) == 1 and None not in served, f"one group served by {served}"
    replica = served.pop()
    assert replica is not None
    return replica


async def test_groups_stay_whole_on_one_replica_and_disconnects_release_waiters(
    haproxy_installed: str, tmp_path: Path
) -> None:
    async with two_replicas_behind_haproxy(tmp_path) as stack:
        with trio.fail_after(SCENARIO_BOUND_S):
            groups = {f"g{i:03d}": [member_body(f"g{i:03d}", s) for s in range(N)]
                      for i in range(100)}
            # A legacy group (no _ng_group_id): routed by its _ng_task_index.
            groups["legacy"] = [member_body("legacy", s, legacy_task=7) for s in range(N)]
            answers = await send_groups(stack, groups)

            assert all(rewarded(a) for a in answers.values()), {
                gid: [(x.status, x.body) for x in a] for gid, a in answers.items()
                if not rewarded(a)}
            placement = {gid: single_replica(a) for gid, a in answers.items()}
            split = Counter(placement[f"g{i:03d}"] for i in range(100))
            print(f"100 explicit groups over two replicas: {dict(sorted(split.items()))}")
            # The ring is even (weight 256); 100 keys still vary by about +-5 around 50.
            assert min(split["r1"], split["r2"]) >= 35, split

            # Each replica judged exactly the groups HAProxy says it answered, and nothing of
            # any group is left waiting anywhere.
            for name in ("r1", "r2"):
                snapshot = await stack.cohorts(name)
                expected = sum(1 for r in placement.values() if r == name)
                legacy = 1 if placement["legacy"] == name else 0  # legacy: no record kept
                assert snapshot["retained_records"] == expected - legacy, (name, snapshot)
                assert snapshot["active_cohorts"] == 0 and snapshot["waiters"] == 0

            # Bodies that fill the buffer HAProxy reads the key from (the key is their last
            # field, the body just under max_request_bytes) are routed by that key too: the
            # big members of a group join its small ones on its replica. (A request without a
            # key, like this GET, goes where the constant "no-key" hashes: pick a group that
            # lives elsewhere, so a truncated body would land on the wrong replica.)
            keyless = (await stack.client.get(stack.url + "/readyz")).headers[REPLICA_HEADER]
            gid = next(g for g, r in sorted(placement.items())
                       if r != keyless and g not in ("legacy", "g000"))
            big = MAX_REQUEST_BYTES - 1024
            mixed = [member_body(gid, s, attempt=1, pad=big if s % 2 else 0) for s in range(N)]
            assert all(big < len(b) < MAX_REQUEST_BYTES for b in mixed[1::2])
            mixed_answers = await send_group(stack, mixed)
            assert rewarded(mixed_answers) and single_replica(mixed_answers) == placement[gid]

            # A second attempt of a group goes to the replica that holds the first (fencing
            # is per replica): an older attempt after it is refused as stale.
            home = placement["g000"]
            newer = await send_group(stack, [member_body("g000", s, attempt=1)
                                             for s in range(N)])
            assert rewarded(newer) and single_replica(newer) == home
            stale = await post(stack, member_body("g000", 0, attempt=0))
            assert stale.status == 409 and stale.body["failure_kind"] == "stale_attempt"

            # A client that goes away through HAProxy releases its waiter on the replica.
            lone = member_body("lonely", 0)
            host, port = stack.url.removeprefix("http://").rsplit(":", 1)
            raw = loadgen.H11Client(host, int(port), max_idle=0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(raw.request, "POST", "/verify", lone))
                waiting = await _replica_with_waiter(stack)
                nursery.cancel_scope.cancel()  # closes the client's connection
            await stack.wait_for(waiting, "waiters", 0)
            snapshot = await stack.cohorts(waiting)
            # The member's cohort stays (collecting); only its waiter went away.
            assert snapshot["collecting"] == 1
            await raw.aclose()


async def _replica_with_waiter(stack: Stack) -> str:
    with trio.fail_after(15):
        while True:
            for name in stack.replicas:
                if (await stack.cohorts(name))["waiters"] == 1:
                    return name
            await trio.sleep(0.05)


async def test_a_dead_replica_leaves_the_other_replicas_groups_alone(
    haproxy_installed: str, tmp_path: Path
) -> None:
    async with two_replicas_behind_haproxy(tmp_path) as stack:
        with trio.fail_after(SCENARIO_BOUND_S):
            # Learn where 40 groups live, then open their second attempts with 7 of 8 members.
            first = await send_groups(stack, {
                f"k{i:02d}": [member_body(f"k{i:02d}", s) for s in range(N)] for i in range(40)
            })
            assert all(rewarded(a) for a in first.values())
            home = {gid: single_replica(a) for gid, a in first.items()}
            doomed = sorted(g for g, r in home.items() if r == "r1")
            spared = sorted(g for g, r in home.items() if r == "r2")
            assert doomed and spared

            results: dict[str, list[Answer]] = {}
            async with trio.open_nursery() as nursery:
                for gid in doomed + spared:
                    bodies = [member_body(gid, s, attempt=1) for s in range(N - 1)]

                    async def one(gid: str = gid, bodies: list[bytes] = bodies) -> None:
                        results[gid] = await send_group(stack, bodies)

                    nursery.start_soon(one)
                await stack.wait_for("r1", "waiters", len(doomed) * (N - 1))
                await stack.wait_for("r2", "waiters", len(spared) * (N - 1))
                stack.processes["r1"].send_signal(signal.SIGKILL)
                await stack.processes["r1"].wait()
                # The survivor's groups complete once their last members arrive.
                last = await send_groups(stack, {
                    gid: [member_body(gid, N - 1, attempt=1)] for gid in spared})
            for gid in spared:
                whole = results[gid] + last[gid]
                assert rewarded(whole) and single_replica(whole) == "r2", gid
            # The dead replica's callers got errors, never a reward.
            for gid in doomed:
                assert all(a.status in (502, 503, loadgen.TRANSPORT_ERROR)
                           for a in results[gid]), [a.status for a in results[gid]]

            # Replacement attempts of the dead replica's groups, and new groups, complete on
            # the survivor, each whole.
            again = await send_groups(stack, {
                **{gid: [member_body(gid, s, attempt=2) for s in range(N)] for gid in doomed},
                **{f"new{i:02d}": [member_body(f"new{i:02d}", s) for s in range(N)]
                   for i in range(20)},
            })
            assert all(rewarded(a) and single_replica(a) == "r2" for a in again.values()), {
                gid: [(x.status, x.replica) for x in a] for gid, a in again.items()}
            snapshot = await stack.cohorts("r2")
            assert snapshot["active_cohorts"] == 0 and snapshot["waiters"] == 0
