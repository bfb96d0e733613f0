"""Drain (server/drain.py, README "Rolling restart"): open cohorts finish, new ones go elsewhere.

Registry and drain task on trio's virtual clock; the admin routes and the probe port's agent
answer in process on loopback; SIGUSR1 on a real ``genrm-trio serve``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from genrm_trio.config import Config, drain_bound_s, load_config
from genrm_trio.errors import ConfigError
from genrm_trio.server.drain import DrainMode, DrainState
from genrm_trio.server.probes import AGENT_REQUEST
from genrm_trio.server.serve import run_server
from tests.lifecycle_helpers import Outcomes, ScriptedJudge, member, open_registry
from tests.process_helpers import get_json, http_call, serve_process
from tests.server_helpers import running_server

N = 2


def cfg_n(**overrides: object) -> Config:
    return Config(num_rollouts_per_prompt=N, cohort_collection_timeout_s=60.0,
                  cohort_evaluation_timeout_s=30.0, **overrides)  # type: ignore[arg-type]


def test_drain_timeout_defaults_to_the_longest_a_cohort_can_stay_open() -> None:
    assert drain_bound_s(cfg_n()) == 90.0
    assert drain_bound_s(cfg_n(drain_timeout_s=5.0)) == 5.0
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        load_config(None, ["drain_timeout_s=0"])


async def test_a_draining_registry_finishes_open_cohorts_and_refuses_new_ones(
        autojump_clock: trio.testing.MockClock) -> None:
    cfg = cfg_n()
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("open-0", member(cfg, 0, group="open"))
        out.send("done-0", member(cfg, 0, group="done"))
        out.send("done-1", member(cfg, 1, group="done"))
        await trio.testing.wait_all_tasks_blocked()
        assert out.reward("done-0") is not None  # a finished group, replayable later

        registry.begin_drain()
        assert registry.draining
        # A member that would open a new cohort: 425, and nothing changes.
        before = registry.snapshot()
        refused = await registry.verify(member(cfg, 0, group="new"))
        assert (refused.status, refused.kind) == (425, "draining")  # type: ignore[union-attr]
        assert registry.snapshot() == before
        # A legacy group is refused the same way.
        legacy = await registry.verify(member(cfg, 0, group=None, attempt=None, task=7))
        assert legacy.kind == "draining"  # type: ignore[union-attr]
        # A replay of a finished group is answered from its record.
        replay = await registry.verify(member(cfg, 1, group="done"))
        assert replay.reward == out.reward("done-1")  # type: ignore[union-attr]
        # The open group's last member is admitted and both are rewarded.
        out.send("open-1", member(cfg, 1, group="open"))
        await trio.testing.wait_all_tasks_blocked()
        out.reward("open-0")
        out.reward("open-1")
        assert registry.counters["drain_refused"] == 2

        registry.end_drain()
        out.send("new-0", member(cfg, 0, group="new"))
        out.send("new-1", member(cfg, 1, group="new"))
        await trio.testing.wait_all_tasks_blocked()
        out.reward("new-0")


async def test_a_newer_attempt_of_a_group_held_here_is_admitted_while_draining(
        autojump_clock: trio.testing.MockClock) -> None:
    cfg = cfg_n()
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("a0-0", member(cfg, 0, group="g", attempt=0))
        await trio.testing.wait_all_tasks_blocked()
        registry.begin_drain()
        out.send("a1-0", member(cfg, 0, group="g", attempt=1))
        out.send("a1-1", member(cfg, 1, group="g", attempt=1))
        await trio.testing.wait_all_tasks_blocked()
        assert out.failure("a0-0").kind == "superseded"
        out.reward("a1-0")
        out.reward("a1-1")


async def test_the_drain_task_stops_the_server_when_the_last_open_cohort_finishes(
        autojump_clock: trio.testing.MockClock) -> None:
    cfg = cfg_n()
    stop = trio.Event()
    async with open_registry(cfg, ScriptedJudge(latency_s=1.0)) as registry, \
            trio.open_nursery() as nursery:
        mode = DrainMode(drain_bound_s(cfg))
        nursery.start_soon(mode.run, registry, stop)
        out = Outcomes(registry, nursery)
        out.send("g-0", member(cfg, 0, group="g"))
        await trio.sleep(3.0)
        start = trio.current_time()
        assert mode.request()
        assert mode.status()["open_cohorts"] == 1
        # Its last deadline: collection (60 s from its first member, 3 s ago), then 30 s.
        assert mode.status()["open_deadline_s"] == pytest.approx(87.0)
        await trio.sleep(5.0)
        assert not stop.is_set()  # its cohort is still collecting
        out.send("g-1", member(cfg, 1, group="g"))
        await stop.wait()
        # The last member at +5 s, then its comparisons (one second each, run together).
        assert trio.current_time() - start == pytest.approx(6.0)
        assert mode.state is DrainState.STOPPING
        out.reward("g-0")
        out.reward("g-1")
        assert not mode.take_back()  # too late


async def test_a_drain_that_outlasts_its_bound_stops_the_server_at_the_bound(
        autojump_clock: trio.testing.MockClock) -> None:
    cfg = cfg_n(drain_timeout_s=10.0)
    stop = trio.Event()
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        mode = DrainMode(drain_bound_s(cfg))
        nursery.start_soon(mode.run, registry, stop)
        out = Outcomes(registry, nursery)
        out.send("g-0", member(cfg, 0, group="g"))
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        mode.request()
        await stop.wait()
        assert trio.current_time() - start == pytest.approx(10.0)
        registry.begin_shutdown()  # what serve does once stop is set
        await trio.testing.wait_all_tasks_blocked()
        assert out.failure("g-0").kind == "shutdown"
        # After a drain, new requests still get 425 (a proxy sends them elsewhere).
        late = await registry.verify(member(cfg, 0, group="late"))
        assert late.kind == "draining"  # type: ignore[union-attr]


async def test_a_drain_taken_back_serves_on(autojump_clock: trio.testing.MockClock) -> None:
    cfg = cfg_n(drain_timeout_s=10.0)
    stop = trio.Event()
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        mode = DrainMode(drain_bound_s(cfg))
        nursery.start_soon(mode.run, registry, stop)
        out = Outcomes(registry, nursery)
        out.send("g-0", member(cfg, 0, group="g"))
        await trio.testing.wait_all_tasks_blocked()
        mode.request()
        await trio.sleep(4.0)
        assert mode.take_back()
        assert not registry.draining and mode.state is DrainState.SERVING
        await trio.sleep(20.0)
        assert not stop.is_set()
        out.send("new-0", member(cfg, 0, group="new"))
        out.send("new-1", member(cfg, 1, group="new"))
        out.send("g-1", member(cfg, 1, group="g"))
        await trio.testing.wait_all_tasks_blocked()
        out.reward("new-0")
        out.reward("g-1")
        # A second drain is bounded afresh from its own start.
        mode.request()
        out.send("h-0", member(cfg, 0, group="h2"))  # refused: a new group
        start = trio.current_time()
        await stop.wait()
        assert trio.current_time() == start  # nothing was open
        assert out.failure("h-0").kind == "draining"
        nursery.cancel_scope.cancel()


def _agent(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(AGENT_REQUEST)
        chunks = []
        while chunk := sock.recv(100):
            chunks.append(chunk)
        return b"".join(chunks)


def _verify_body(group: str, slot: int) -> bytes:
    return msgspec.json.encode({
        "responses_create_params": {"input": "q"},
        "response": {"output": [{"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": f"answer {slot}"}]}]},
        "_ng_rollout_index": slot, "_ng_group_id": group, "_ng_group_attempt": 0})


async def test_admin_routes_need_auth_and_drive_the_drain_and_the_agent_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Without inbound auth the admin routes are refused.
    async with running_server(cfg_n(port=0)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        status, _, raw = await http_call(host, int(port), "POST", "/admin/drain")
        assert status == 403 and json.loads(raw)["failure_kind"] == "forbidden", raw
        assert (await get_json(host, int(port), "/status"))["drain"]["state"] == "serving"

    monkeypatch.setenv("DRAIN_TEST_TOKEN", "s3cret")
    cfg = cfg_n(port=0, probe_port=0, auth_token_env="DRAIN_TEST_TOKEN")
    async with running_server(cfg) as url, trio.open_nursery() as nursery:
        import httpx2

        headers = {"authorization": "Bearer s3cret"}
        answers: dict[int, int] = {}
        async with httpx2.AsyncClient(base_url=url, headers=headers, timeout=30) as client:

            async def send(slot: int) -> None:
                answer = await client.post("/verify", content=_verify_body("held", slot))
                answers[slot] = answer.status_code

            probe_port = (await client.get("/status")).json()["config"]["probe_port"]
            assert await trio.to_thread.run_sync(_agent, probe_port) == b"up\n"
            # A cohort held open, else the drain would end (and the server stop) at once.
            nursery.start_soon(send, 0)
            while (await client.get("/status")).json()["cohorts"]["active_cohorts"] != 1:  # noqa: ASYNC110 - behind HTTP
                await trio.sleep(0.01)
            async with httpx2.AsyncClient(base_url=url) as anonymous:
                assert (await anonymous.post("/admin/drain")).status_code == 401
            drained = await client.post("/admin/drain")
            assert drained.status_code == 200, drained.text
            assert drained.json()["state"] == "draining"
            assert drained.json()["open_cohorts"] == 1
            # Draining, it stays on HAProxy's ring: its open groups' members must reach it.
            assert await trio.to_thread.run_sync(_agent, probe_port) == b"up\n"
            assert (await client.get("/readyz")).status_code == 200
            status = (await client.get("/status")).json()
            assert status["drain"]["state"] == "draining"
            assert status["drain"]["open_cohorts"] == 1
            metrics = (await client.get("/metrics")).text
            assert "genrm_draining 1.0" in metrics
            refused = await client.post("/verify", content=_verify_body("new", 0))
            assert refused.status_code == 425
            assert refused.json()["failure_kind"] == "draining"
            assert "genrm_drain_refused_total 1.0" in (await client.get("/metrics")).text
            ready = await client.post("/admin/ready")
            assert ready.json()["state"] == "serving"
            assert "genrm_draining 0.0" in (await client.get("/metrics")).text
            await send(1)  # the held cohort completes; nothing was lost
            await trio.testing.wait_all_tasks_blocked()
        assert answers == {0: 200, 1: 200}


async def test_an_admin_drain_with_nothing_open_stops_the_server_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAIN_TEST_TOKEN", "s3cret")
    cfg = cfg_n(port=0, probe_port=0, auth_token_env="DRAIN_TEST_TOKEN")
    stop = trio.Event()
    with trio.fail_after(30):  # a hang guard, not a timing goal
        async with trio.open_nursery() as nursery:
            url = await nursery.start(
                lambda task_status: run_server(cfg, shutdown=stop, task_status=task_status))
            import httpx2

            async with httpx2.AsyncClient(base_url=url) as client:
                drained = await client.post("/admin/drain",
                                            headers={"authorization": "Bearer s3cret"})
            assert drained.status_code == 200, drained.text
            await stop.wait()  # the drain set the server's stop event: run_server returns


async def test_sigusr1_drains_a_real_server_which_exits_0_once_its_cohort_is_answered(
        tmp_path: Path) -> None:
    async with serve_process([f"num_rollouts_per_prompt={N}", "probe_port=0"],
                             tmp_path / "serve.log") as server, trio.open_nursery() as nursery:
        answers: dict[int, tuple[int, bytes]] = {}

        async def send(slot: int) -> None:
            body = msgspec.json.encode({
                "responses_create_params": {"input": "q"},
                "response": {"output": [{"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": f"answer {slot}"}]}]},
                "_ng_rollout_index": slot, "_ng_group_id": "g", "_ng_group_attempt": 0})
            status, _, raw = await http_call(server.host, server.port, "POST", "/verify", body)
            answers[slot] = (status, raw)

        nursery.start_soon(send, 0)
        with trio.fail_after(30):  # a hang guard on real processes, not a timing goal
            while (await get_json(server.host, server.port, "/status")  # noqa: ASYNC110
                   )["cohorts"]["active_cohorts"] != 1:
                await trio.sleep(0.05)
            os.kill(server.proc.pid, signal.SIGUSR1)
            while (await get_json(server.host, server.port, "/status")  # noqa: ASYNC110
                   )["drain"]["state"] != "draining":
                await trio.sleep(0.05)
            assert server.proc.returncode is None  # its cohort is open: it waits
            nursery.start_soon(send, 1)
            assert await server.proc.wait() == 0
    assert [answers[s][0] for s in (0, 1)] == [200, 200], answers
    assert all(json.loads(raw)["mask_sample"] is False for _, raw in answers.values())
    log = (tmp_path / "serve.log").read_text()
    assert "drain complete" in log


async def test_a_rejoining_registry_opens_no_cohort_and_keeps_refused_groups_elsewhere(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_n(rejoin_s=10.0)  # collection 60 s + evaluation 30 s: how long a group stays away
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        assert registry.rejoining_s == pytest.approx(10.0)
        before = registry.snapshot()
        away = await registry.verify(member(cfg, 0, group="away"))
        assert (away.status, away.kind) == (425, "draining")  # type: ignore[union-attr]
        assert registry.snapshot() == before and registry.groups_elsewhere == 1
        await trio.sleep(10.0)
        assert registry.rejoining_s == 0.0
        # The window is over: a new group opens here, the one sent on stays away.
        out.send("new-0", member(cfg, 0, group="new"))
        out.send("new-1", member(cfg, 1, group="new"))
        late = await registry.verify(member(cfg, 1, group="away"))
        assert late.kind == "draining"  # type: ignore[union-attr]
        newer = await registry.verify(member(cfg, 0, group="away", attempt=1))
        assert newer.kind == "draining"  # type: ignore[union-attr]
        await trio.testing.wait_all_tasks_blocked()
        out.reward("new-0")
        # Its cohort elsewhere is over by 90 s after the last refusal: then it may open here.
        await trio.sleep(89.0)
        assert (await registry.verify(member(cfg, 0, group="away", attempt=1))
                ).kind == "draining"  # type: ignore[union-attr]
        await trio.sleep(90.0)
        out.send("away-0", member(cfg, 0, group="away", attempt=2))
        out.send("away-1", member(cfg, 1, group="away", attempt=2))
        await trio.testing.wait_all_tasks_blocked()
        out.reward("away-0")
        assert registry.groups_elsewhere == 0
        assert registry.counters["drain_refused"] == 4

    # Bounded: past MAX_GROUPS_ELSEWHERE the oldest group is forgotten.
    monkeypatch.setattr("genrm_trio.server.cohort.MAX_GROUPS_ELSEWHERE", 2)
    async with open_registry(cfg, ScriptedJudge()) as registry:
        for group in ("a", "b", "c"):
            await registry.verify(member(cfg, 0, group=group))
        assert registry.groups_elsewhere == 2
        registry.end_rejoin()  # POST /admin/ready
        assert registry.rejoining_s == 0.0
        assert (await registry.verify(member(cfg, 0, group="b"))).kind == "draining"  # type: ignore[union-attr]
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            out.send("a-0", member(cfg, 0, group="a"))  # forgotten: opens here
            out.send("a-1", member(cfg, 1, group="a"))
            await trio.testing.wait_all_tasks_blocked()
            out.reward("a-0")


async def test_admin_ready_ends_the_rejoin_window(autojump_clock: trio.testing.MockClock) -> None:
    cfg = cfg_n(rejoin_s=30.0)
    async with open_registry(cfg, ScriptedJudge()) as registry:
        mode = DrainMode(drain_bound_s(cfg))
        mode.attach(registry)
        assert mode.status()["rejoining_s"] == pytest.approx(30.0)
        await registry.verify(member(cfg, 0, group="away"))
        assert mode.take_back()
        assert registry.rejoining_s == 0.0
        assert mode.status()["groups_elsewhere"] == 1 and mode.status()["refused"] == 1


def test_rejoin_s_is_validated() -> None:
    assert load_config(None, ["rejoin_s=12.5"]).rejoin_s == 12.5
    with pytest.raises(ConfigError, match="rejoin_s"):
        load_config(None, ["rejoin_s=-1"])
