"""``rolling``: rolling restarts under steady load, two replicas behind HAProxy (README "Rolling
restart").

::

    rolling_case()                               one run
      +-- mock judge                             counts a prompt judged again (repeated_calls)
      +-- replicas r1, r2                        fixed ports, probe_port, state_dir each
      +-- HAProxy (configs/haproxy.cfg)          stick table, agent check, retry-on 425
      +-- load: K group workers                  a group of N, members spread over spread_s,
      |                                          then the next group
      +-- the restarts                           per round, each replica in turn: SIGUSR1
                                                 (drain), exit 0, restart on its ports and
                                                 state_dir, ready in HAProxy, replays of its
                                                 finished groups

:class:`Replica` (one replica's ports, state_dir and current process, restarted in place) is
also what ``tests/test_rolling.py`` drives. Nothing here imports the server: the replicas,
HAProxy and the mock judge are processes spoken to over HTTP.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import re
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from genrm_trio.bench.loadgen import BodyFactory, H11Client, HttpAnswer, LoadgenError
from genrm_trio.bench.processes import Proc, free_port, launch_process
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import READY_MOCK, READY_OURS, mock_command, ours_command

__all__ = ["DRAIN_COMPLETE", "Replica", "rolling_case", "start_replicas"]

DRAIN_COMPLETE = re.compile(r"drain complete after ([0-9.]+) s")
"""The replica's log line once its last open cohort has finished (server/drain.py)."""
_REPLICA = b"x-genrm-replica"
_EXIT_MARGIN_S = 30.0  # past the drain bound and the shutdown grace: a hang guard
_READY_S = 60.0


@dataclass
class Replica:
    """One replica behind HAProxy: its name there (``r1``...), fixed main and probe ports and
    ``state_dir``, and its current process (restarted in place: same ports, same state). Each
    process lives in a task of ``nursery`` (the one :func:`start_replicas` owns), so it can be
    stopped and started again from any task."""

    name: str
    port: int
    probe_port: int
    state_dir: Path
    command: list[str]
    log_dir: Path
    nursery: trio.Nursery
    rejoin_s: float = 0.0
    """``rejoin_s`` of every generation after the first (a restart into a running fleet)."""
    generation: int = 0
    proc: Proc | None = None
    _stop: trio.Event | None = None
    _ended: trio.Event | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"rolling-{self.name}-{self.generation}.log"

    async def start(self) -> None:
        """Start a new generation on the same ports and state_dir (from the second on, with
        ``rejoin_s``); returns once it serves."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} is running")
        self.generation += 1
        command = list(self.command)
        if self.generation > 1:
            command += ["--set", f"rejoin_s={self.rejoin_s!r}"]
        await self.nursery.start(self._generation, command)

    async def wait_rejoined(self, limit_s: float) -> None:
        """Poll ``/status`` until the rejoin window is over (a hang guard: ``limit_s``)."""
        with trio.fail_after(limit_s):
            while (await self.get_json("/status"))["drain"]["rejoining_s"] > 0:  # noqa: ASYNC110
                await trio.sleep(0.1)  # the state lives behind HTTP

    async def _generation(self, command: list[str],
                          task_status: trio.TaskStatus[None]) -> None:
        stop, ended = trio.Event(), trio.Event()
        self._stop, self._ended = stop, ended
        try:
            async with launch_process(command, log_path=self.log_path,
                                      ready_prefix=READY_OURS) as proc:
                self.proc = proc
                task_status.started()
                await stop.wait()
        finally:
            self.proc = None
            ended.set()

    async def drain_and_wait(self, bound_s: float) -> int:
        """SIGUSR1 (drain), then wait for the process to exit; its exit code. Raises
        ``TimeoutError`` past ``bound_s`` plus a margin (a hang guard)."""
        proc = self._require()
        proc.process.send_signal(signal.SIGUSR1)
        with trio.fail_after(bound_s + _EXIT_MARGIN_S):
            return await proc.process.wait()

    async def stop(self) -> None:
        """End the current process (SIGTERM when it still runs) and wait until it has."""
        if self._stop is not None and self._ended is not None:
            self._stop.set()
            await self._ended.wait()

    def drain_seconds(self) -> float | None:
        """The current generation's ``drain complete after X s`` (None: not in its log)."""
        try:
            found = DRAIN_COMPLETE.search(self.log_path.read_text(errors="replace"))
        except OSError:
            return None
        return float(found.group(1)) if found else None

    async def get_json(self, path: str) -> Any:
        client = H11Client("127.0.0.1", self.port)
        try:
            answer = await client.get(path)
        finally:
            await client.aclose()
        return json.loads(answer.body)

    def _require(self) -> Proc:
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self.proc


@asynccontextmanager
async def start_replicas(sets: dict[str, str], *, judge_url: str, work: Path, log_dir: Path,
                         count: int = 2, rejoin_s: float = 0.0) -> AsyncIterator[list[Replica]]:
    """``count`` replicas (``genrm-trio serve``) on fixed free loopback ports, each with a
    probe port and a state_dir of its own under ``work``, with ``sets`` (``--set`` items;
    restarts add ``rejoin_s``); all stopped on exit."""
    async with trio.open_nursery() as nursery:
        replicas: list[Replica] = []
        ports: set[int] = set()
        while len(ports) < 2 * count:  # free now, and distinct
            ports.add(free_port())
        free = sorted(ports)
        try:
            for i in range(1, count + 1):
                port, probe_port = free[2 * i - 2], free[2 * i - 1]
                state_dir = work / f"r{i}-state"
                state_dir.mkdir(parents=True, exist_ok=True)
                extra = {**sets, "probe_port": str(probe_port), "state_dir": str(state_dir)}
                settings = ServerSettings(
                    n=int(sets["num_rollouts_per_prompt"]), ours_extra=tuple(extra.items()),
                    collection_timeout_s=float(sets["cohort_collection_timeout_s"]))
                cmd = ours_command(judge_url, settings)
                cmd[cmd.index("--port") + 1] = str(port)
                replica = Replica(f"r{i}", port, probe_port, state_dir, cmd, log_dir, nursery,
                                  rejoin_s)
                replicas.append(replica)
                await replica.start()
            yield replicas
        finally:
            with trio.CancelScope(shield=True):
                for replica in replicas:
                    await replica.stop()


@dataclass
class _Member:
    group: int
    slot: int
    status: int
    reward: float | None
    masked: bool
    kind: str | None
    replica: str | None


@dataclass
class _Restart:
    replica: str
    round: int
    open_cohorts: int = 0
    open_deadline_s: float | None = None
    drain_s: float | None = None
    exit_s: float = 0.0
    exit_code: int | None = None
    haproxy_down_s: float | None = None
    restart_ready_s: float = 0.0
    refused_while_draining: int = 0
    refused_while_rejoining: int = 0
    groups_sent_elsewhere: int = 0
    replays_sent: int = 0
    replays_answered: int = 0
    verdicts_after_restart: int = 0
    records_after_restart: int = 0


@dataclass
class _Load:
    members: list[_Member] = field(default_factory=list)
    # Groups answered whole by one replica: replica -> [(group, member 0's body, its reward)].
    finished: dict[str, list[tuple[int, bytes, float]]] = field(default_factory=dict)


def _decode(answer: HttpAnswer) -> tuple[float | None, bool, str | None]:
    try:
        body = msgspec.json.decode(answer.body)
    except msgspec.DecodeError:
        return None, False, "undecodable"
    if not isinstance(body, dict):
        return None, False, "undecodable"
    reward = body.get("reward")
    return (float(reward) if isinstance(reward, int | float) else None,
            bool(body.get("mask_sample")), body.get("failure_kind"))


def rolling_case(*, n: int = 8, groups_in_flight: int = 8, spread_s: float = 3.0,
                 rounds: int = 2, settle_s: float = 4.0, judge_ms: float = 100.0,
                 rejoin_s: float = 10.0, replays_per_restart: int = 8, seed: int = 29) -> Case:
    """``rounds`` full rolling restarts of two replicas behind HAProxy under a steady load:
    ``groups_in_flight`` groups of ``n`` at all times, each member sent after a uniform random
    delay in [0, ``spread_s``) from its group's start (so groups are open on both replicas at
    every moment). In each round each replica in turn, ``settle_s`` after the previous one has
    rejoined: SIGUSR1 (drain), exit (must be 0), restart on its ports and ``state_dir`` with
    ``rejoin_s`` (longer than a group's members take to arrive: ``spread_s`` plus the
    restart's few seconds), wait until HAProxy shows it up, then replay member 0 of up to
    ``replays_per_restart`` groups it answered before the restart (through HAProxy: the stick
    table sends them to it; its journal must answer each with the same reward).

    Metrics: members sent, rewarded, masked, failed (any other answer, or none); comparisons
    judged twice (the mock judge's ``repeated_calls``); replays sent and answered; drains,
    their longest ``drain complete`` time and the longest open cohort's remaining deadline at
    the drain's start, and whether every drain ended within it. Gating: a check that fails
    makes ``genrm-trio bench`` exit 1.
    """

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        from genrm_trio.bench.haproxy import HaproxyError, open_haproxy

        logs = ctx.out_dir / "logs"
        work = ctx.out_dir / "rolling" / f"{tag}-{time.time_ns()}"
        sets = {
            "num_rollouts_per_prompt": str(n),
            "cohort_collection_timeout_s": "60",
            "cohort_evaluation_timeout_s": "60",
            "log_level": "INFO",
            "max_request_bytes": str(1 << 20),
        }
        bound_s = 120.0  # drain_timeout_s null: collection + evaluation timeouts
        load = _Load()
        restarts: list[_Restart] = []
        rng = random.Random(seed)
        bodies = BodyFactory(seed=seed, run_tag=f"rolling-{tag}-{time.time_ns()}",
                             answer_chars=(200, 400))
        async with contextlib.AsyncExitStack() as stack:
            judge = await stack.enter_async_context(launch_process(
                mock_command(JudgeSettings(latency_ms=judge_ms)), log_path=logs /
                "rolling-judge.log", ready_prefix=READY_MOCK))
            replicas = await stack.enter_async_context(start_replicas(
                sets, judge_url=judge.base_url, work=work, log_dir=logs, rejoin_s=rejoin_s))
            proxy = await stack.enter_async_context(open_haproxy(
                [r.address for r in replicas], max_request_bytes=1 << 20,
                log_path=logs / "rolling-haproxy.log",
                probe_ports=[r.probe_port for r in replicas]))
            for r in replicas:
                await proxy.wait_until(r.name, lambda s: s.ready, _READY_S)
            host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
            client = H11Client(host, int(port))
            stack.push_async_callback(client.aclose)
            stop_load = trio.Event()
            groups = itertools.count()

            async def send(group: int, slot: int, delay: float) -> _Member:
                await trio.sleep(delay)
                try:
                    answer = await client.request("POST", "/verify", bodies.member(group, slot))
                except LoadgenError:
                    return _Member(group, slot, -1, None, False, "transport", None)
                reward, masked, failure = _decode(answer)
                replica = answer.header(_REPLICA)
                return _Member(group, slot, answer.status, reward, masked, failure,
                               replica.decode() if replica else None)

            async def worker() -> None:
                while not stop_load.is_set():
                    group = next(groups)
                    got: list[_Member] = []

                    async def one(slot: int, delay: float) -> None:
                        got.append(await send(group, slot, delay))  # noqa: B023

                    async with trio.open_nursery() as nursery:
                        for slot in range(n):
                            nursery.start_soon(one, slot, rng.uniform(0.0, spread_s))
                    load.members.extend(got)
                    served = {m.replica for m in got}
                    if (len(served) == 1 and None not in served
                            and all(m.status == 200 and not m.masked for m in got)):
                        [m0] = [m for m in got if m.slot == 0]
                        assert m0.reward is not None
                        load.finished.setdefault(m0.replica or "", []).append(
                            (group, bodies.member(group, 0), m0.reward))

            async def restart(replica: Replica, round_no: int) -> None:
                record = _Restart(replica.name, round_no)
                restarts.append(record)
                started = time.monotonic()
                exit_task = trio.Event()
                codes: list[int] = []

                async def wait_exit() -> None:
                    codes.append(await replica.drain_and_wait(bound_s))
                    exit_task.set()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(wait_exit)
                    # What the replica holds when its drain begins (while it still answers).
                    with contextlib.suppress(LoadgenError, ValueError):
                        seen = False
                        while not exit_task.is_set():
                            status = (await replica.get_json("/status"))["drain"]
                            if status["state"] != "serving":
                                if not seen:
                                    record.open_cohorts = status.get("open_cohorts", 0)
                                    record.open_deadline_s = status.get("open_deadline_s")
                                    seen = True
                                record.refused_while_draining = status["refused"]
                            await trio.sleep(0.01 if not seen else 0.05)
                    with contextlib.suppress(HaproxyError):
                        # The replica stays on the ring until it shuts down ("down" from
                        # its agent, or its health check).
                        await proxy.wait_until(replica.name, lambda s: not s.up, bound_s)
                        record.haproxy_down_s = time.monotonic() - started
                record.exit_code = codes[0]
                record.exit_s = time.monotonic() - started
                record.drain_s = replica.drain_seconds()
                before = {g for g, _, _ in load.finished.get(replica.name, [])}
                await replica.stop()
                ready_from = time.monotonic()
                await replica.start()
                await proxy.wait_until(replica.name, lambda s: s.ready, _READY_S)
                record.restart_ready_s = time.monotonic() - ready_from
                status = await replica.get_json("/status")
                record.verdicts_after_restart = status["verdict_reuse"]["entries"]
                record.records_after_restart = status["cohorts"]["retained_records"]
                earlier = [f for f in load.finished.get(replica.name, []) if f[0] in before]
                for _, body, reward in earlier[-replays_per_restart:]:
                    record.replays_sent += 1
                    answer = await client.request("POST", "/verify", body)
                    got, masked, _ = _decode(answer)
                    if (answer.status == 200 and got == reward and not masked
                            and answer.header(_REPLICA) == replica.name.encode()):
                        record.replays_answered += 1
                await replica.wait_rejoined(rejoin_s + _READY_S)
                status = (await replica.get_json("/status"))["drain"]
                record.refused_while_rejoining = status["refused"]
                record.groups_sent_elsewhere = status["groups_elsewhere"]

            async with trio.open_nursery() as nursery:
                for _ in range(groups_in_flight):
                    nursery.start_soon(worker)
                for round_no in range(1, rounds + 1):
                    for replica in replicas:
                        await trio.sleep(settle_s)
                        await restart(replica, round_no)
                await trio.sleep(settle_s)
                stop_load.set()
            judge_client = H11Client(*judge.host_port)
            try:
                stats = json.loads((await judge_client.get("/admin/stats")).body)
            finally:
                await judge_client.aclose()

        members = load.members
        rewarded = sum(1 for m in members if m.status == 200 and not m.masked)
        masked = sum(1 for m in members if m.status == 200 and m.masked)
        failed = len(members) - rewarded - masked
        metrics = {
            "members_sent": float(len(members)),
            "rewarded": float(rewarded),
            "masked": float(masked),
            "failed": float(failed),
            "groups": float(len({m.group for m in members})),
            "judge_calls": float(stats["calls"]),
            "judged_twice": float(stats["repeated_calls"]),
            "restarts": float(len(restarts)),
            "clean_exits": float(sum(1 for r in restarts if r.exit_code == 0)),
            "replays_sent": float(sum(r.replays_sent for r in restarts)),
            "replays_answered": float(sum(r.replays_answered for r in restarts)),
            "open_cohorts_at_drain_max": float(max(r.open_cohorts for r in restarts)),
            "refused_425_draining": float(sum(r.refused_while_draining for r in restarts)),
            "refused_425_rejoining": float(sum(r.refused_while_rejoining for r in restarts)),
            "drain_max_s": max((r.drain_s or 0.0) for r in restarts),
            "exit_max_s": max(r.exit_s for r in restarts),
            "restart_ready_max_s": max(r.restart_ready_s for r in restarts),
            "drains_within_deadline": float(sum(
                1 for r in restarts if r.drain_s is not None
                and (r.open_deadline_s is None or r.drain_s <= r.open_deadline_s))),
        }
        checks = {
            "no member failed": failed == 0,
            "no member masked": masked == 0,
            "no comparison judged twice": stats["repeated_calls"] == 0,
            "every replay answered": metrics["replays_answered"] == metrics["replays_sent"] > 0,
            "every drain exited 0": metrics["clean_exits"] == len(restarts),
            "every drain ended within the longest open cohort's deadline":
                metrics["drains_within_deadline"] == len(restarts),
            "groups were open at every drain": all(r.open_cohorts > 0 for r in restarts),
        }
        kinds = sorted({str(m.kind) for m in members if not (m.status == 200 and not m.masked)})
        return RunRecord(metrics, notes={
            "restarts": [vars(r) for r in restarts],
            "failure_kinds": kinds,
            "failed_checks": [name for name, ok in checks.items() if not ok],
        })

    params = {"n": n, "groups_in_flight": groups_in_flight, "spread_s": spread_s,
              "rounds": rounds, "settle_s": settle_s, "judge_ms": judge_ms,
              "rejoin_s": rejoin_s, "gate": True}
    return Case("rolling", f"n{n}-k{groups_in_flight}-{rounds}rounds", run, params,
                kinds=("ours",))
