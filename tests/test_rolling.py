"""One drain behind HAProxy (README "Rolling restart"): two ``genrm-trio serve`` replicas behind
the shipped ``configs/haproxy.cfg``, all on loopback; the CI-sized version of ``genrm-trio bench
--preset rolling``.

Replica r1 holds open groups when it gets SIGUSR1: new groups must then all be answered by r2
(those hashed to r1 refused there with 425 and retried by HAProxy), r1's open groups must finish
on r1, r1 must exit 0, and, restarted on its ports and state_dir (with ``rejoin_s``), it must
answer its groups' replays from its journal while new groups go on being rewarded. Skipped when
HAProxy is not installed (CI installs it). Every process is started here and stopped by pid.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from genrm_trio.bench.cases.rolling import Replica, start_replicas
from genrm_trio.bench.haproxy import REPLICA_HEADER, open_haproxy
from genrm_trio.bench.loadgen import H11Client

N = 4
#: A hang guard for the whole scenario (real processes, no clock to jump), not a timing goal:
#: it takes about 15 s here.
SCENARIO_BOUND_S = 180.0
HELD = [f"held-{i}" for i in range(6)]
NEW = [f"new-{i}" for i in range(12)]

_SBIN = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/usr/local/sbin"])
pytestmark = pytest.mark.skipif(shutil.which("haproxy", path=_SBIN) is None,
                                reason="haproxy is not installed")


def body(group: str, slot: int, attempt: int = 0) -> bytes:
    return msgspec.json.encode({
        "responses_create_params": {"input": f"prompt of {group}"},
        "response": {"output": [{"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": f"answer {slot} of {group}"}]}]},
        "_ng_rollout_index": slot, "_ng_group_id": group, "_ng_group_attempt": attempt,
    })


async def post(client: H11Client, payload: bytes) -> tuple[int, str | None, dict[str, Any]]:
    answer = await client.request("POST", "/verify", payload)
    replica = answer.header(REPLICA_HEADER.encode())
    return answer.status, replica.decode() if replica else None, json.loads(answer.body)


async def send_groups(client: H11Client, groups: list[str], slots: range,
                      into: dict[str, list[tuple[int, str | None, dict[str, Any]]]]) -> None:
    async def one(group: str, slot: int) -> None:
        into.setdefault(group, []).append(await post(client, body(group, slot)))

    async with trio.open_nursery() as nursery:
        for group in groups:
            for slot in slots:
                nursery.start_soon(one, group, slot)


def rewarded_by_one(answers: list[tuple[int, str | None, dict[str, Any]]]) -> str:
    assert all(status == 200 and not b["mask_sample"] for status, _, b in answers), answers
    served = {replica for _, replica, _ in answers}
    assert len(served) == 1 and None not in served, served
    name = served.pop()
    assert name is not None
    return name


async def held_groups(replica: Replica) -> int:
    active: int = (await replica.get_json("/status"))["cohorts"]["active_cohorts"]
    return active


async def test_one_drain_behind_haproxy_loses_nothing(tmp_path: Path) -> None:
    sets = {"num_rollouts_per_prompt": str(N), "cohort_collection_timeout_s": "60",
            "cohort_evaluation_timeout_s": "60", "log_level": "INFO"}
    with trio.fail_after(SCENARIO_BOUND_S):
        async with start_replicas(sets, judge_url="", work=tmp_path, log_dir=tmp_path,
                                  rejoin_s=60.0) as replicas, open_haproxy(
                [r.address for r in replicas], max_request_bytes=1 << 20,
                log_path=tmp_path / "haproxy.log",
                probe_ports=[r.probe_port for r in replicas]) as proxy:
            r1, r2 = replicas
            for r in replicas:
                await proxy.wait_until(r.name, lambda s: s.up)
            host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
            client = H11Client(host, int(port))
            answers: dict[str, list[tuple[int, str | None, dict[str, Any]]]] = {}
            async with trio.open_nursery() as nursery:
                # Half of each held group now: their cohorts open on both replicas.
                nursery.start_soon(send_groups, client, HELD, range(N // 2), answers)
                while await held_groups(r1) + await held_groups(r2) < len(HELD):  # noqa: ASYNC110
                    await trio.sleep(0.05)
                on_r1 = await held_groups(r1)
                assert 0 < on_r1 < len(HELD), "the held groups must open on both replicas"

                started = time.monotonic()
                exit_code: list[int] = []

                async def drain_r1() -> None:
                    exit_code.append(await r1.drain_and_wait(120.0))

                nursery.start_soon(drain_r1)
                while (await r1.get_json("/status"))["drain"]["state"] != "draining":  # noqa: ASYNC110
                    await trio.sleep(0.02)
                drain = (await r1.get_json("/status"))["drain"]
                assert drain["open_cohorts"] == on_r1
                # New groups while r1 drains: all on r2, those hashed to r1 retried there.
                await send_groups(client, NEW, range(N), answers)
                assert {rewarded_by_one(answers[g]) for g in NEW} == {"r2"}
                refused = (await r1.get_json("/status"))["drain"]["refused"]
                assert refused > 0, "no new group hashed to r1: the 425 retry went untested"
                assert r1.proc is not None and r1.proc.process.returncode is None  # it waits
                # Past two agent checks (agent-inter 1s): HAProxy must keep r1 on the ring.
                await trio.sleep(2.5)
                assert (await proxy.servers())["r1"].ready
                # The held groups' other halves: each group finishes where it opened.
                await send_groups(client, HELD, range(N // 2, N), answers)
            assert exit_code == [0]
            assert time.monotonic() - started < drain["open_deadline_s"]
            placed = {g: rewarded_by_one(answers[g]) for g in HELD}
            assert sum(1 for name in placed.values() if name == "r1") == on_r1
            assert "drain complete" in r1.log_path.read_text()
            rewards = {g: [b["reward"] for _, _, b in answers[g]] for g in HELD}

            # Restarted on its ports and state_dir: r1 answers its groups' replays.
            await r1.stop()
            await r1.start()
            await proxy.wait_until("r1", lambda s: s.up)
            assert (await r1.get_json("/status"))["drain"]["rejoining_s"] > 0
            for group, name in placed.items():
                status, replica, got = await post(client, body(group, 0))
                assert (status, replica) == (200, name), (group, got)
                assert got["reward"] in rewards[group]
            # While it rejoins, new groups are still rewarded (on r2).
            fresh: dict[str, list[tuple[int, str | None, dict[str, Any]]]] = {}
            await send_groups(client, [f"after-{i}" for i in range(4)], range(N), fresh)
            assert {rewarded_by_one(a) for a in fresh.values()} == {"r2"}
            await client.aclose()
