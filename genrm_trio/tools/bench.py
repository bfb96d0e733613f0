"""Side-by-side benchmarks: genrm-trio against NeMo Gym 0.7.0's ``genrm_compare``.

Every run starts fresh processes (mock judge, then the server under test) and drives them with
:mod:`genrm_trio.tools.loadgen`. Runs of one case alternate A B A B (ours, NeMo Gym, ours, ...)
so machine drift hits both; the summary reports medians per server and the per-pair ratio.

::

    run_bench(presets, ...)                    one trio task tree, nothing detached
      +-- for each case, for each pair: ours, then nemo
            +-- _rig(kind, ...)                nursery: mock judge process, server process,
            |                                  a stdout-draining task per process
            +-- case.run(rig)                  load generator tasks (loadgen.drive_load, ...)
      +-- write results.json, summary.md, *.png

Processes are ours to end: SIGTERM, a grace period, then SIGKILL. NeMo Gym lives in its own
venv (``~/.cache/genrm-trio/nemo-gym-0.7.0`` or ``$GENRM_TRIO_NEMO_VENV``), created on demand
from a Python 3.13 under pyenv; without one its runs are skipped with a message.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

import click
import msgspec
import trio
import trio.testing
import yaml

from genrm_trio.tools import loadgen, step
from genrm_trio.tools.loadgen import (
    BodyFactory,
    H11Client,
    LoadPlan,
    LoadResult,
    MemberResult,
    median,
    percentile,
    read_proc_stats,
)
from genrm_trio.tools.processes import stop_process

__all__ = [
    "PRESETS",
    "BenchError",
    "bench_cli",
    "launch_process",
    "run_bench",
]

KINDS = ("ours", "nemo")
NEMO_VERSION = "0.7.0"
_STARTUP_S = 90.0
_STOP_GRACE_S = 10.0
_READY_OURS = "genrm-trio serve listening on "
_READY_MOCK = "genrm-trio mock-judge listening on "


class BenchError(Exception):
    """A benchmark could not run (a process did not start, a venv is missing, ...)."""


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Proc:
    """A process we started: its pid, base URL once ready, and the trio handle."""

    process: trio.Process
    base_url: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def host_port(self) -> tuple[str, int]:
        hostport = self.base_url.split("://", 1)[1]
        host, _, port = hostport.rpartition(":")
        return host.strip("[]"), int(port)


def _free_port() -> int:
    # Only for NeMo Gym, which needs its port in the config; the tiny race is acceptable here.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _drain(stream: trio.abc.ReceiveStream, log: Any, ready: Callable[[str], None]) -> None:
    buffer = b""
    async for chunk in stream:
        log.write(chunk)
        log.flush()
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            ready(line.decode(errors="replace"))


async def _wait_healthy(proc: Proc) -> None:
    host, port = proc.host_port
    client = H11Client(host, port)
    try:
        while True:
            if proc.process.returncode is not None:
                raise BenchError(f"process exited with {proc.process.returncode} during startup")
            try:
                answer = await client.get("/health")
                if answer.status == 200:
                    return
            except loadgen.LoadgenError:
                pass
            await trio.sleep(0.05)
    finally:
        await client.aclose()


@asynccontextmanager
async def launch_process(
    cmd: Sequence[str],
    *,
    log_path: Path,
    ready_prefix: str | None = None,
    base_url: str = "",
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> AsyncIterator[Proc]:
    """Start ``cmd``, wait until it is ready, yield it, then SIGTERM it (SIGKILL after a grace).

    Ready means a stdout line starting with ``ready_prefix`` (the URL follows it) or, without a
    prefix, ``GET base_url/health`` answering 200. Blocks up to ``_STARTUP_S`` for readiness,
    then raises :class:`BenchError`. The stdout-draining task lives in this context's nursery.
    """
    log = await trio.to_thread.run_sync(_open_log, log_path)
    with log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        process = await trio.lowlevel.open_process(
            list(cmd), stdout=subprocess.PIPE, stderr=log, env=env, cwd=cwd
        )
        proc = Proc(process, base_url)
        ready_event = trio.Event()

        def on_line(line: str) -> None:
            if ready_prefix and not ready_event.is_set() and line.startswith(ready_prefix):
                proc.base_url = line[len(ready_prefix) :].strip()
                ready_event.set()

        try:
            async with trio.open_nursery() as nursery:
                assert process.stdout is not None
                nursery.start_soon(_drain, process.stdout, log, on_line)
                with trio.move_on_after(_STARTUP_S) as startup:
                    if ready_prefix:
                        async with trio.open_nursery() as watch:

                            async def exited() -> None:
                                await process.wait()
                                watch.cancel_scope.cancel()

                            watch.start_soon(exited)
                            await ready_event.wait()
                            watch.cancel_scope.cancel()
                    else:
                        await _wait_healthy(proc)
                if startup.cancelled_caught or not proc.base_url or process.returncode is not None:
                    raise BenchError(
                        f"{cmd[0]} did not become ready (exit {process.returncode}); see {log_path}"
                    )
                try:
                    yield proc
                finally:
                    await stop_process(process, _STOP_GRACE_S)
                    nursery.cancel_scope.cancel()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.move_on_after(_STOP_GRACE_S, shield=True):
                    await process.wait()


def _open_log(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "ab")  # noqa: SIM115 - closed by the caller's with-block



# -- the two servers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSettings:
    """The knobs a case sets on the server under test (same meaning for both servers)."""

    n: int = 16
    collection_timeout_s: float = 1800.0
    result_ttl_s: float | None = 3600.0
    max_terminal_cohorts: int = 4096
    ours_extra: tuple[tuple[str, str], ...] = ()
    """More ``--set KEY=VALUE`` items for our server only (NeMo Gym has no such keys)."""
    ours_env: tuple[tuple[str, str], ...] = ()
    """Environment variables set for our server's process only (the soak's diagnostics:
    ``PYTHONTRACEMALLOC``, ``MALLOC_ARENA_MAX``)."""


@dataclass(frozen=True)
class JudgeSettings:
    """The mock judge of a case: latency (plus uniform jitter) and capacity (None: unlimited)."""

    latency_ms: float = 50.0
    jitter_ms: float = 0.0
    capacity: int | None = None


def default_nemo_venv() -> Path:
    """Where NeMo Gym's venv lives: ``$GENRM_TRIO_NEMO_VENV`` or the cache folder."""
    env = os.environ.get("GENRM_TRIO_NEMO_VENV")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "genrm-trio" / f"nemo-gym-{NEMO_VERSION}"


def _pyenv_313() -> Path | None:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(root.glob("3.13*"), reverse=True):
        python = candidate / "bin" / "python"
        if python.exists():
            return python
    return None


def ensure_nemo_venv(venv: Path) -> Path | str:
    """Return NeMo Gym's ``genrm_compare`` folder, creating the venv if needed (blocking, minutes).

    Returns a one-line reason instead when it cannot (no Python 3.13, install failed).
    """
    python = venv / "bin" / "python"
    if not python.exists():
        base = _pyenv_313()
        if base is None:
            return "NeMo Gym skipped: no Python 3.13 under pyenv (nemo-gym 0.7.0 needs 3.13)"
        venv.parent.mkdir(parents=True, exist_ok=True)
        steps = [
            [str(base), "-m", "venv", str(venv)],
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--ignore-requires-python",
                f"nemo-gym=={NEMO_VERSION}",
            ],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
                return f"NeMo Gym skipped: {' '.join(step[:3])} failed: {' '.join(tail)}"
    found = sorted(venv.glob("lib/python3*/site-packages/resources_servers/genrm_compare/app.py"))
    if not found:
        return f"NeMo Gym skipped: no resources_servers/genrm_compare in {venv}"
    return found[0].parent


def nemo_config(port: int, judge_url: str, server: ServerSettings) -> str:
    """The resolved NeMo Gym config (YAML) for ``genrm_compare`` with the mock judge as model."""
    judge_host, _, judge_port = judge_url.split("://", 1)[1].rpartition(":")
    config = {
        "head_server": {"host": "127.0.0.1", "port": _free_port()},  # never contacted
        "dry_run": False,
        "genrm_compare_bench": {
            "resources_servers": {
                "genrm_compare": {
                    "entrypoint": "app.py",
                    "host": "127.0.0.1",
                    "port": port,
                    "domain": "rlhf",
                    "genrm_model_server": {"type": "responses_api_models", "name": "genrm_model"},
                    "genrm_responses_create_params": {
                        "input": [],
                        "max_output_tokens": 16384,
                        "temperature": 0.6,
                        "top_p": 0.95,
                    },
                    "num_rollouts_per_prompt": server.n,
                    "cohort_collection_timeout_s": server.collection_timeout_s,
                    "cohort_result_ttl_s": server.result_ttl_s,
                    "max_terminal_cohorts": server.max_terminal_cohorts,
                }
            }
        },
        "genrm_model": {
            "responses_api_models": {
                "genrm_model": {
                    "entrypoint": "app.py",
                    "host": judge_host.strip("[]"),
                    "port": int(judge_port),
                }
            }
        },
    }
    return yaml.safe_dump(config, sort_keys=False)


def ours_command(judge_url: str, server: ServerSettings) -> list[str]:
    """``genrm-trio serve`` on a free loopback port with the case's settings (no judge URL:
    the built-in judge)."""
    exe = shutil.which("genrm-trio")
    base = [exe] if exe else [sys.executable, "-m", "genrm_trio.cli"]
    ttl = "null" if server.result_ttl_s is None else repr(server.result_ttl_s)
    sets = {
        "num_rollouts_per_prompt": str(server.n),
        "max_terminal_cohorts": str(server.max_terminal_cohorts),
        "cohort_collection_timeout_s": repr(server.collection_timeout_s),
        "cohort_result_ttl_s": ttl,
        "judge_max_concurrency": "4096",
        "log_level": "WARNING",
        **dict(server.ours_extra),
    }
    cmd = [*base, "serve", "--host", "127.0.0.1", "--port", "0"]
    if judge_url:
        cmd += ["--judge-url", judge_url]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def mock_command(judge: JudgeSettings) -> list[str]:
    """The mock judge as its own process (its CPU is never counted as the server's)."""
    cmd = [
        sys.executable,
        "-m",
        "genrm_trio.tools.mock",
        "--port",
        "0",
        "--latency-ms",
        repr(judge.latency_ms),
        "--set",
        f"latency_jitter_s={judge.jitter_ms / 1000}",
    ]
    if judge.capacity is not None:
        cmd += ["--capacity", str(judge.capacity)]
    return cmd


@dataclass
class Rig:
    """One run's processes: the mock judge and the server under test, plus a client to it."""

    kind: str
    judge: Proc
    server: Proc
    client: H11Client
    judge_client: H11Client
    run_tag: str
    server_log: Path | None = None
    """Where the server under test writes its log (stderr)."""

    def stats(self) -> loadgen.ProcStats:
        return read_proc_stats(self.server.pid)

    async def judge_calls(self) -> int:
        answer = await self.judge_client.get("/admin/stats")
        calls: int = msgspec.json.decode(answer.body)["calls"]
        return calls

    async def ping(self) -> None:
        """One ``GET /health`` round trip: everything sent before it has been read."""
        await self.client.get("/health")


@dataclass
class BenchContext:
    """Where logs go, where NeMo Gym lives, and a counter that makes run tags unique."""

    out_dir: Path
    nemo_dir: Path | None
    runs: int = 0


@asynccontextmanager
async def _rig(
    ctx: BenchContext, kind: str, judge: JudgeSettings, server: ServerSettings, label: str
) -> AsyncIterator[Rig]:
    ctx.runs += 1
    tag = f"r{ctx.runs}-{int(time.time())}"
    logs = ctx.out_dir / "logs"
    async with launch_process(
        mock_command(judge), log_path=logs / f"{label}-{kind}-judge.log", ready_prefix=_READY_MOCK
    ) as judge_proc:
        if kind == "ours":
            cmd = ours_command(judge_proc.base_url, server)
            launch = launch_process(
                cmd, log_path=logs / f"{label}-ours.log", ready_prefix=_READY_OURS,
                env={**os.environ, **dict(server.ours_env)} if server.ours_env else None,
            )
        else:
            if ctx.nemo_dir is None:
                raise BenchError("NeMo Gym is not available")
            port = _free_port()
            env = dict(os.environ)
            env["NEMO_GYM_CONFIG_DICT"] = nemo_config(port, judge_proc.base_url, server)
            env["NEMO_GYM_CONFIG_PATH"] = "genrm_compare_bench"
            env.pop("VIRTUAL_ENV", None)
            python = str(ctx.nemo_dir.parents[4] / "bin" / "python")
            launch = launch_process(
                [python, "app.py"],
                log_path=logs / f"{label}-nemo.log",
                base_url=f"http://127.0.0.1:{port}",
                env=env,
                cwd=str(ctx.nemo_dir),
            )
        async with launch as server_proc:
            host, port = server_proc.host_port
            jhost, jport = judge_proc.host_port
            client = H11Client(host, port)
            judge_client = H11Client(jhost, jport)
            try:
                yield Rig(kind, judge_proc, server_proc, client, judge_client, tag,
                          server_log=logs / f"{label}-{kind}.log")
            finally:
                await client.aclose()
                await judge_client.aclose()


# -- cases -------------------------------------------------------------------------------------


class RunRecord(msgspec.Struct):
    """One run of one case against one server: scalar metrics and raw samples (for plots)."""

    metrics: dict[str, float]
    samples: dict[str, list[float]] = msgspec.field(default_factory=dict)
    notes: dict[str, Any] = msgspec.field(default_factory=dict)


RunFn = Callable[[BenchContext, str, str], Awaitable[RunRecord]]


@dataclass(frozen=True)
class Case:
    """One measured configuration of a preset: ``run(ctx, kind, label)`` does one run.

    ``higher_is_better`` lists the metrics where a larger number is better (for the table).
    """

    preset: str
    label: str
    run: RunFn
    params: dict[str, Any] = field(default_factory=dict)
    kinds: tuple[str, ...] = KINDS
    """The servers the case compares; a case that measures only ours has ``("ours",)``."""
    resize: Callable[[float], Case] | None = None
    """For a case whose length is a parameter: the same case lasting that many seconds
    (``--duration-s``)."""


def _ms(seconds: float) -> float:
    return seconds * 1000.0


def _load_metrics(
    result: LoadResult, cpu_s: float, peak_rss: int, judge_ms: float
) -> tuple[dict[str, float], dict[str, list[float]], dict[str, Any]]:
    lat = [_ms(x) for x in result.latencies_s()]
    cohorts_ok = sum(1 for c in result.cohorts if c.ok)
    metrics = {
        "verifies_per_s": result.verifies / result.wall_s if result.wall_s else math.nan,
        "cohorts_per_s": cohorts_ok / result.wall_s if result.wall_s else math.nan,
        "cpu_ms_per_cohort": _ms(cpu_s) / cohorts_ok if cohorts_ok else math.nan,
        "latency_p50_ms": percentile(lat, 0.5),
        "latency_p99_ms": percentile(lat, 0.99),
        "latency_max_ms": max(lat) if lat else math.nan,
        "over_judge_p50_ms": percentile(lat, 0.5) - judge_ms,
        "over_judge_p99_ms": percentile(lat, 0.99) - judge_ms,
        "peak_rss_mb": peak_rss / 2**20,
        "cohorts": float(len(result.cohorts)),
        "failed_members": float(sum(result.failures.values())),
    }
    return metrics, {"latency_ms": lat}, {"failures": result.failures}


async def _measured_load(
    rig: Rig, bodies: BodyFactory, plan: LoadPlan, judge_ms: float, **kw: Any
) -> RunRecord:
    before = rig.stats()
    own_before = time.process_time()
    result = await loadgen.drive_load(rig.client, bodies, plan, **kw)
    own_s = time.process_time() - own_before
    after = rig.stats()
    metrics, samples, notes = _load_metrics(
        result, after.cpu_s - before.cpu_s, after.peak_rss_bytes, judge_ms
    )
    # The load generator's own CPU use: near 100% means the harness, not the server, is the
    # limit of this run.
    metrics["loadgen_cpu_pct"] = 100.0 * own_s / result.wall_s if result.wall_s else math.nan
    return RunRecord(metrics, samples, notes)


async def _warm_up(rig: Rig, bodies: BodyFactory, n: int) -> None:
    plan = LoadPlan(n=n, k=1, max_cohorts=2, duration_s=60.0, first_cohort=1_000_000)
    await loadgen.drive_load(rig.client, bodies, plan)


async def _judge_floor(rig: Rig, n: int, rounds: int = 30) -> list[float]:
    """Time ``rounds`` batches of ``n`` concurrent judge calls sent straight to the mock judge
    (no server in between): what the harness and the mock alone cost at this fan-out."""
    body = msgspec.json.encode(
        {
            "input": [{"role": "user", "content": "x" * 500, "type": "message"}],
            "metadata": {"response_1": "a" * 1500, "response_2": "b" * 1500},
            "max_output_tokens": 16384,
        }
    )
    out: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(rig.judge_client.request, "POST", "/v1/responses", body)
        out.append(_ms(time.perf_counter() - start))
    return out


def load_case(
    preset: str,
    label: str,
    *,
    n: int,
    k: int,
    judge_ms: float,
    duration_s: float,
    max_cohorts: int = 100_000,
    id_mode: str = "explicit",
    reasoning: bool = False,
    warm_up: bool = True,
) -> Case:
    """K cohorts of N in flight against a judge of ``judge_ms`` for ``duration_s`` (or count)."""

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        judge = JudgeSettings(latency_ms=judge_ms)
        async with _rig(ctx, kind, judge, ServerSettings(n=n), tag) as rig:
            bodies = BodyFactory(seed=7, id_mode=id_mode, reasoning=reasoning, run_tag=rig.run_tag)
            if warm_up:
                await _warm_up(rig, bodies, n)
            floor = await _judge_floor(rig, n) if k == 1 else []
            plan = LoadPlan(n=n, k=k, max_cohorts=max_cohorts, duration_s=duration_s)
            record = await _measured_load(rig, bodies, plan, judge_ms)
            if floor:
                # The harness's own floor: N concurrent calls straight to the mock judge.
                record.metrics["judge_direct_p50_ms"] = percentile(floor, 0.5)
                record.metrics["over_direct_p50_ms"] = record.metrics[
                    "latency_p50_ms"
                ] - percentile(floor, 0.5)
                record.samples["judge_direct_ms"] = floor
            return record

    params = {
        "n": n,
        "k": k,
        "judge_ms": judge_ms,
        "duration_s": duration_s,
        "max_cohorts": max_cohorts,
        "id_mode": id_mode,
        "reasoning": reasoning,
    }
    return Case(preset, label, run, params)


def staggered_case(
    *,
    n: int = 16,
    k: int = 64,
    judge_ms: float = 50.0,
    capacity: int = 32,
    median_gen_s: float = 1.0,
    sigma: float = 0.6,
) -> Case:
    """K cohorts at once, each member sent after a lognormal generation time, against a judge
    that serves at most ``capacity`` calls at once: makespan and tail."""

    def delay(rng: Any) -> float:
        return float(min(10.0 * median_gen_s, rng.lognormvariate(math.log(median_gen_s), sigma)))

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        judge = JudgeSettings(latency_ms=judge_ms, capacity=capacity)
        async with _rig(ctx, kind, judge, ServerSettings(n=n), tag) as rig:
            bodies = BodyFactory(seed=11, reasoning=True, run_tag=rig.run_tag)
            await _warm_up(rig, bodies, n)
            plan = LoadPlan(n=n, k=k, max_cohorts=k, duration_s=600.0)
            before = rig.stats()
            result = await loadgen.drive_load(rig.client, bodies, plan, delays=delay, seed=5)
            after = rig.stats()
            metrics, samples, notes = _load_metrics(
                result, after.cpu_s - before.cpu_s, after.peak_rss_bytes, judge_ms
            )
            metrics["makespan_s"] = result.wall_s
            return RunRecord(metrics, samples, notes)

    params = {
        "n": n,
        "k": k,
        "judge_ms": judge_ms,
        "capacity": capacity,
        "median_gen_s": median_gen_s,
        "sigma": sigma,
    }
    return Case("staggered", f"n{n}-k{k}-cap{capacity}", run, params)


def judge_client_case(
    *, calls: int = 1024, n: int = 16, judge_ms: float = 1000.0, rounds: int = 2
) -> Case:
    """``calls`` judge calls in flight (``calls / n`` concurrent ``POST /compare`` of n answers,
    circular pairs: n calls each) against a slow judge: server CPU per judge call."""
    requests = calls // n

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        judge = JudgeSettings(latency_ms=judge_ms)
        async with _rig(ctx, kind, judge, ServerSettings(n=n), tag) as rig:
            bodies = BodyFactory(seed=3, run_tag=rig.run_tag)
            encoder = msgspec.json.Encoder()
            statuses: list[int] = []

            def compare_body(i: int) -> bytes:
                members = [msgspec.json.decode(bodies.member(i, j)) for j in range(n)]
                return encoder.encode(
                    {
                        "conversation_history": members[0]["responses_create_params"]["input"],
                        "response_objs": [m["response"] for m in members],
                    }
                )

            payloads = [compare_body(i) for i in range(requests)]
            await rig.client.request("POST", "/compare", payloads[0])  # warm-up
            calls_before = await rig.judge_calls()
            before = rig.stats()
            start = time.perf_counter()
            for _ in range(rounds):
                async with trio.open_nursery() as nursery:
                    for body in payloads:

                        async def one(b: bytes = body) -> None:
                            try:
                                answer = await rig.client.request("POST", "/compare", b)
                                statuses.append(answer.status)
                            except loadgen.LoadgenError:
                                statuses.append(loadgen.TRANSPORT_ERROR)

                        nursery.start_soon(one)
            wall = time.perf_counter() - start
            after = rig.stats()
            made = await rig.judge_calls() - calls_before
            cpu_ms = _ms(after.cpu_s - before.cpu_s)
            metrics = {
                "cpu_ms_per_judge_call": cpu_ms / made if made else math.nan,
                "judge_calls": float(made),
                "wall_s_per_round": wall / rounds,
                "failed_requests": float(sum(1 for s in statuses if s != 200)),
                "peak_rss_mb": after.peak_rss_bytes / 2**20,
            }
            return RunRecord(metrics)

    params = {"calls_in_flight": calls, "n": n, "judge_ms": judge_ms, "rounds": rounds}
    return Case("judge_client", f"{calls}-in-flight-judge{int(judge_ms)}ms", run, params)


async def _send_many(
    rig: Rig,
    bodies: BodyFactory,
    members: Sequence[tuple[int, int]],
    results: list[tuple[int, MemberResult]],
    *,
    all_sent: trio.Event | None = None,
    on_sent: Callable[[int, int], None] | None = None,
    hold: trio.Event | None = None,
    connect_limit: int = 64,
) -> None:
    """POST each (cohort, index) member and append (cohort, result); blocks until all are
    answered. At most ``connect_limit`` requests are being connected and written at once
    (listen backlogs are small); ``all_sent`` is set once every request is written."""
    limiter = trio.CapacityLimiter(connect_limit)
    remaining = len(members)

    async def one(cohort: int, index: int) -> None:
        nonlocal remaining
        sent = trio.Event()
        async with trio.open_nursery() as nursery:
            await limiter.acquire_on_behalf_of(sent)

            async def release() -> None:
                nonlocal remaining
                try:
                    await sent.wait()
                finally:
                    limiter.release_on_behalf_of(sent)
                remaining -= 1
                if remaining == 0 and all_sent is not None:
                    all_sent.set()

            nursery.start_soon(release)
            result = await loadgen.send_member(
                rig.client,
                bodies.member(cohort, index),
                index,
                sent=sent,
                on_sent=None if on_sent is None else functools.partial(on_sent, cohort),
                hold=hold,
            )
            sent.set()
            results.append((cohort, result))

    async with trio.open_nursery() as nursery:
        for cohort, index in members:
            nursery.start_soon(one, cohort, index)


async def _wait_idle(rig: Rig, limit_s: float = 60.0) -> None:
    """Wait until the server burns under 5 ms CPU per 100 ms (it has read everything sent)."""
    with trio.move_on_after(limit_s):
        last = rig.stats().cpu_s
        while True:
            await trio.sleep(0.1)
            now = rig.stats().cpu_s
            if now - last < 0.005:
                return
            last = now


def steady_state_case(
    *,
    n: int = 16,
    k: int = 16,
    judge_ms: float = 50.0,
    retained: int = 4096,
    fill_deadline_s: float = 20.0,
    duration_s: float = 6.0,
    latency_cohorts: int = 20,
) -> Case:
    """Fresh numbers, then ``retained`` terminal cohorts, then the same numbers again.

    The fill uses one member per cohort and lets the collection deadline fail each one: a
    failed cohort is a terminal record like a completed one (both count against
    ``max_terminal_cohorts``) and costs the server one request instead of N plus judging.
    """

    async def measure(
        rig: Rig, bodies: BodyFactory, first: int
    ) -> tuple[dict[str, float], list[float]]:
        plan = LoadPlan(n=n, k=k, max_cohorts=100_000, duration_s=duration_s, first_cohort=first)
        record = await _measured_load(rig, bodies, plan, judge_ms)
        lat_plan = LoadPlan(
            n=n, k=1, max_cohorts=latency_cohorts, duration_s=120.0, first_cohort=first + 500_000
        )
        lat = await loadgen.drive_load(rig.client, bodies, lat_plan)
        lat_ms = [_ms(x) for x in lat.latencies_s()]
        return {
            "verifies_per_s": record.metrics["verifies_per_s"],
            "cpu_ms_per_cohort": record.metrics["cpu_ms_per_cohort"],
            "k1_latency_p50_ms": percentile(lat_ms, 0.5),
            "failed_members": record.metrics["failed_members"] + sum(lat.failures.values()),
        }, lat_ms

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        judge = JudgeSettings(latency_ms=judge_ms)
        server = ServerSettings(
            n=n,
            collection_timeout_s=fill_deadline_s,
            result_ttl_s=None,
            max_terminal_cohorts=retained,
        )
        async with _rig(ctx, kind, judge, server, tag) as rig:
            bodies = BodyFactory(seed=13, run_tag=rig.run_tag)
            await _warm_up(rig, bodies, n)
            fresh, fresh_lat = await measure(rig, bodies, 0)
            fill: list[tuple[int, MemberResult]] = []
            fill_start = time.perf_counter()
            await _send_many(rig, bodies, [(2_000_000 + i, 0) for i in range(retained)], fill)
            fill_s = time.perf_counter() - fill_start
            steady, steady_lat = await measure(rig, bodies, 3_000_000)
            metrics = {f"fresh_{k2}": v for k2, v in fresh.items()}
            metrics.update({f"steady_{k2}": v for k2, v in steady.items()})
            metrics["steady_over_fresh_throughput"] = (
                steady["verifies_per_s"] / fresh["verifies_per_s"]
            )
            metrics["steady_over_fresh_cpu"] = (
                steady["cpu_ms_per_cohort"] / fresh["cpu_ms_per_cohort"]
            )
            metrics["fill_s"] = fill_s
            metrics["peak_rss_mb"] = rig.stats().peak_rss_bytes / 2**20
            kinds = sorted({m.failure_kind or "reward" for _, m in fill})
            return RunRecord(
                metrics,
                {"fresh_k1_latency_ms": fresh_lat, "steady_k1_latency_ms": steady_lat},
                {"fill_answers": kinds},
            )

    params = {
        "n": n,
        "k": k,
        "judge_ms": judge_ms,
        "retained": retained,
        "fill_deadline_s": fill_deadline_s,
        "duration_s": duration_s,
    }
    return Case("steady_state", f"n{n}-k{k}-retained{retained}", run, params)


def release_case(
    trigger: str, *, waiters: int = 10_000, cohorts: int = 625, deadline_s: float = 30.0
) -> Case:
    """``waiters`` members waiting in ``cohorts`` incomplete cohorts (the server expects twice
    as many members per cohort), then one trigger releases them all:

    - ``deadline``: each cohort's collection deadline (from its first member's arrival);
    - ``sigterm``: SIGTERM to the server;
    - ``disconnect``: every client connection closes at once.

    Release time per waiter (``release_*``). ``deadline`` and ``sigterm``: when its answer
    (or the dropped connection) reached the load generator's socket, stamped by epoll in a
    thread while the waiters hold off reading, minus the trigger (for ``deadline``, its cohort's
    own deadline: first member's arrival, pinned by a ``/health`` round trip, plus the timeout).
    ``disconnect``: every waiter socket is shut down at once from a thread, which then samples
    the server's open-descriptor count (i-th close = i-th released waiter).
    """
    per = waiters // cohorts
    timeout_s = deadline_s if trigger == "deadline" else 3600.0

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        judge = JudgeSettings(latency_ms=50.0)
        server = ServerSettings(n=2 * per, collection_timeout_s=timeout_s)
        async with _rig(ctx, kind, judge, server, tag) as rig:
            pid = rig.server.pid
            bodies = BodyFactory(seed=17, run_tag=rig.run_tag)
            host, port = rig.server.host_port
            # Waiters get their own connections (never pooled), so closing them is visible.
            waiting_client = H11Client(host, port, max_idle=0)
            waiting = Rig(rig.kind, rig.judge, rig.server, waiting_client, rig.judge_client, tag)
            opened: dict[int, float] = {}
            results: list[tuple[int, MemberResult]] = []
            cohort_of: dict[int, int] = {}
            watch = loadgen.ReadableWatch()
            hold = trio.Event()
            closes: list[float] = []
            notes: dict[str, Any] = {}
            fds_idle = loadgen.count_fds(pid)
            t0 = 0.0
            seen: dict[int, float] = {}

            def on_sent(cohort: int, fd: int) -> None:
                cohort_of[fd] = cohort
                watch.add(fd)

            async with trio.open_nursery() as nursery:
                # Phase 1: open every cohort with one member, pinning its arrival time between
                # the end of its send and the next /health answer (one round trip).
                for c in range(cohorts):
                    sent = trio.Event()

                    async def first(c: int = c, sent: trio.Event = sent) -> None:
                        result = await loadgen.send_member(
                            waiting_client,
                            bodies.member(c, 0),
                            0,
                            sent=sent,
                            on_sent=functools.partial(on_sent, c),
                            hold=hold,
                        )
                        results.append((c, result))

                    nursery.start_soon(first)
                    await sent.wait()
                    t_sent = time.perf_counter()
                    await rig.ping()
                    opened[c] = (t_sent + time.perf_counter()) / 2
                # Phase 2: the other members, as fast as the server accepts them.
                rest = [(c, i) for c in range(cohorts) for i in range(1, per)]
                all_sent = trio.Event()
                nursery.start_soon(
                    functools.partial(
                        _send_many,
                        waiting,
                        bodies,
                        rest,
                        results,
                        all_sent=all_sent,
                        on_sent=on_sent,
                        hold=hold,
                    )
                )
                await all_sent.wait()
                await rig.ping()
                await _wait_idle(rig)
                notes["send_s"] = time.perf_counter() - min(opened.values())
                rss_mb = rig.stats().rss_bytes / 2**20
                if trigger == "disconnect":
                    fds_full = loadgen.count_fds(pid)
                    expected = min(fds_full - fds_idle, waiters)
                    t0, closes = await trio.to_thread.run_sync(
                        _disconnect_and_time, pid, list(cohort_of), fds_full, expected
                    )
                    nursery.cancel_scope.cancel()
                else:
                    # The waiters do not read until the watch is over: the stamps come from
                    # epoll in a thread, free of the load generator's own work.
                    limit_s = deadline_s + 60.0 if trigger == "deadline" else 60.0
                    if trigger == "sigterm":
                        t0 = time.perf_counter()
                        rig.server.process.send_signal(signal.SIGTERM)
                    seen = await trio.to_thread.run_sync(watch.watch, limit_s)
                    hold.set()
                    _limit(nursery, 30.0)
            if trigger == "deadline":
                release_ms = [
                    _ms(t - (opened[cohort_of[fd]] + deadline_s)) for fd, t in seen.items()
                ]
                notes["deadline_spread_ms"] = _ms(max(opened.values()) - min(opened.values()))
            elif trigger == "sigterm":
                release_ms = [_ms(t - t0) for t in seen.values()]
            else:
                release_ms = [_ms(t - t0) for t in closes]
                notes["close_and_release_ms"] = _ms(time.perf_counter() - t0)
            await waiting_client.aclose()
            statuses: dict[str, int] = {}
            for _, m in results:
                key = str(m.status) if m.status != loadgen.TRANSPORT_ERROR else "dropped"
                statuses[key] = statuses.get(key, 0) + 1
            notes["answers"] = statuses
            metrics = {
                "release_p50_ms": percentile(release_ms, 0.5),
                "release_p99_ms": percentile(release_ms, 0.99),
                "release_max_ms": max(release_ms) if release_ms else math.nan,
                "released": float(len(release_ms)),
                "rss_waiting_mb": rss_mb,
                "send_s": notes["send_s"],
            }
            return RunRecord(metrics, {"release_ms": release_ms}, notes)

    params = {
        "trigger": trigger,
        "waiters": waiters,
        "cohorts": cohorts,
        "members_expected_per_cohort": 2 * per,
        "deadline_s": timeout_s,
    }
    return Case("release", trigger, run, params)


def _limit(nursery: trio.Nursery, limit_s: float) -> None:
    """Let the nursery's waiters finish on their own, but cancel what is left after ``limit_s``."""
    nursery.cancel_scope.deadline = trio.current_time() + limit_s


def _disconnect_and_time(
    pid: int, fds: list[int], fds_full: int, expected: int, limit_s: float = 120.0
) -> tuple[float, list[float]]:
    """Blocks (run it in a thread while the trio side idles). Shuts down every waiter socket at
    once (``shutdown``, so the server sees the client go away now; the owning tasks close them
    later), then samples the server's descriptor count until ``expected`` have closed or
    ``limit_s`` passed. Returns the trigger time and, per closed descriptor, the first sample
    (``time.perf_counter``) that showed it closed. A process that is gone has closed all."""
    t0 = time.perf_counter()
    for fd in fds:
        sock = socket.socket(fileno=fd)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer: nothing to trigger
        finally:
            sock.detach()
    out: list[float] = []
    deadline = time.perf_counter() + limit_s
    while len(out) < expected and time.perf_counter() < deadline:
        try:
            closed = fds_full - loadgen.count_fds(pid)
        except OSError:
            closed = expected
        now = time.perf_counter()
        while len(out) < min(closed, expected):
            out.append(now)
        time.sleep(0.0005)
    return t0, out


# -- admission cost against active groups (in process) ----------------------------------------


class _InstantJudge:
    """A judge that answers every pair at once with a tie: admission is measured, not judging."""

    async def judge_pair(self, request: Any, group: Any = None) -> Any:
        from genrm_trio.scoring import Verdict

        return Verdict(score_1=3.0, score_2=3.0, ranking=3.5)


def admission_case(active_groups: int, *, cap: int = 1000, admissions: int = 2000) -> Case:
    """Time ``admissions`` new-cohort admissions (``/verify`` registrations, in process) in a
    registry that already holds ``active_groups`` collecting groups and more idle watermarks
    than ``max_terminal_cohorts`` (``cap``) keeps, so every admission prunes. Reports
    microseconds per admission (the synchronous registration) and watermark visits per
    admission (constant when pruning never walks active groups). Ours alone; ``nemo`` skipped."""
    from genrm_trio.config import Config as ServerConfig
    from genrm_trio.server.cohort import CohortRegistry
    from genrm_trio.wire import decode_verify

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        if kind != "ours":
            return RunRecord({}, notes={"skipped": "in-process measure of our registry"})
        cfg = ServerConfig(num_rollouts_per_prompt=2, max_terminal_cohorts=cap,
                           cohort_collection_timeout_s=1e6, cohort_result_ttl_s=None)
        encode = msgspec.json.Encoder().encode

        def member(group: str, slot: int) -> Any:
            return decode_verify(encode({
                "responses_create_params": {"input": "admission bench prompt"},
                "response": {"id": "r", "output": [{"type": "message", "content": [
                    {"type": "output_text", "text": f"answer {slot}"}]}]},
                "_ng_group_id": group, "_ng_group_attempt": 0, "_ng_rollout_index": slot,
            }), 2)

        async with CohortRegistry.open(cfg, _InstantJudge()) as registry:
            async with trio.open_nursery() as done:  # completed groups: idle watermarks
                for g in range(2 * cap + 10):
                    for slot in (0, 1):
                        done.start_soon(registry.verify, member(f"idle{g}", slot))
            async with trio.open_nursery() as waiting:
                for g in range(active_groups):
                    waiting.start_soon(registry.verify, member(f"active{g}", 0))
                await trio.testing.wait_all_tasks_blocked()
                members = [member(f"new-{i}", 0) for i in range(admissions)]
                visits_before = registry.watermark_visits
                elapsed = 0.0
                # The collector is off while timing: with tens of thousands of live tasks in
                # this process its passes (``serve`` tunes and freezes it) would dominate.
                gc.collect()
                gc.disable()
                for i, one in enumerate(members):
                    # The synchronous admission step of /verify (what every request pays before
                    # it waits), timed alone: task scheduling is not admission cost.
                    start = time.perf_counter()
                    registry._admit(one)
                    elapsed += time.perf_counter() - start
                    if i % 100 == 99:
                        await trio.testing.wait_all_tasks_blocked()
                gc.enable()
                visits = registry.watermark_visits - visits_before
                registry.begin_shutdown()
        return RunRecord({
            "us_per_admission": elapsed / admissions * 1e6,
            "watermark_visits_per_admission": visits / admissions,
        })

    return Case("admission", f"active{active_groups}-cap{cap}", run,
                {"active_groups": active_groups, "max_terminal_cohorts": cap,
                 "admissions": admissions})


# -- scale-out ---------------------------------------------------------------------------------

_READY_BARE = "genrm-trio bare listening on "


def bare_command() -> list[str]:
    """The bare Hypercorn ASGI app (:mod:`genrm_trio.tools.bare`) on a free loopback port."""
    return [sys.executable, "-m", "genrm_trio.tools.bare", "--port", "0"]


def scaleout_case(
    *, n: int = 8, k: int = 32, slice_s: int = 5, slices: int = 5, replicas: int = 2,
    judge: str = "canned",
) -> Case:
    """One replica, ``replicas`` replicas behind HAProxy (``configs/haproxy.cfg``) and the bare
    Hypercorn app, side by side in one run, and, to tell HAProxy's share of the scaling from the
    machine's, the same replicas each driven directly by its own wrk (``pair``, all wrk runs
    measuring one window): all four are started together and driven in turn,
    ``slices`` rounds, each measuring a window of ``slice_s`` whole seconds in a run of wrk
    (the order rotating from round to round), so a change in the machine's speed (a shared
    host) hits all of them alike. Each wrk run opens its connections anew and drops its requests
    in flight at the end; the window leaves both out (:func:`genrm_trio.tools.wrk.run_wrk`):
    two replicas behind HAProxy open about three times the connections one replica does. The
    load is wrk (:mod:`genrm_trio.tools.wrk`, a load generator in C: the Python one would take
    a third of a core the servers need) with K cohorts of N in flight per server process
    (K x N connections to the bare app and to one replica, 2 x K x N through HAProxy to two),
    so each server sees the same depth of work: with K cohorts shared by two, each replica ran
    out of work at times (measured: 10 to 20 % fewer verifies/s through HAProxy at K = 32 than
    at 64). The replicas judge with :func:`genrm_trio.tools.bare.canned_judge`
    (``judge="canned"``: a plugin answering a fixed verdict at once) or the built-in heuristic
    judge (``judge="builtin"``), both in process, so all of them answer every request with one
    HTTP exchange and the bare app is the limit of the HTTP stack they share; what a replica
    does beyond it is its own work (decoding, the cohort, parsing verdicts, aggregating,
    answering).

    Metrics (medians over the rounds): verifies/s of each; ``one_over_bare``,
    ``two_over_one``, ``pair_over_one`` (what two replicas give on this machine with no
    HAProxy) and ``two_over_pair`` (what HAProxy costs), the medians of each round's ratios;
    CPU per verify and CPU use (percent of one core) of the load generator, the servers and
    HAProxy, per setup; and, from CPU per verify, the verifies/s each setup reaches when
    CPU-bound on an otherwise idle machine (``*_cpu_bound_verifies_per_s``,
    ``one_over_bare_by_cpu``, ``two_over_one_by_cpu``).
    """
    from genrm_trio.tools.bare import CANNED_JUDGE
    from genrm_trio.tools.haproxy import open_haproxy
    from genrm_trio.tools.wrk import WrkResult, ensure_wrk, run_wrk

    runs = 0
    replica_cmd = ours_command("", ServerSettings(n=n))
    if judge == "canned":
        replica_cmd += ["--set", f"judge.plugin={CANNED_JUDGE}"]
    elif judge != "builtin":
        raise ValueError(f"judge must be canned or builtin, got {judge!r}")

    @dataclass
    class Setup:
        """``targets``: each URL with the server pids its wrk drives (one wrk per target, all
        measuring the same window); ``proxy_pid``: HAProxy, when the target is HAProxy."""

        targets: list[tuple[str, list[int]]]
        proxy_pid: int | None = None

        @property
        def pids(self) -> list[int]:
            return [pid for _, pids in self.targets for pid in pids]

    async def drive(ctx: BenchContext, tag: str, setup: Setup, connections: int,
                    window_s: int) -> dict[str, float]:
        results: list[WrkResult] = []
        window_start = math.ceil(time.time()) + 2

        async def one(i: int, url: str, pids: list[int]) -> None:
            bodies = BodyFactory(seed=19, run_tag=f"{tag}-{i}-{time.time_ns()}")
            watched = pids + ([setup.proxy_pid] if setup.proxy_pid else [])
            results.append(await run_wrk(
                url, bodies, n, connections=connections, window_s=window_s,
                workdir=ctx.out_dir, watch=watched, window_start=window_start))

        async with trio.open_nursery() as nursery:
            for i, (url, pids) in enumerate(setup.targets):
                nursery.start_soon(one, i, url, pids)
        # Each run watched its own target's servers (and HAProxy, when it is the target).
        cpu = sum(t for r in results for p, t in r.cpu_s.items() if p != setup.proxy_pid)
        wrk_cpu = sum(r.wrk_cpu_s for r in results)
        answered = sum(r.window_good for r in results)
        good, wall = max(answered, 1), results[0].window_s
        out = {
            "verifies_per_s": answered / wall,
            "server_cpu_pct": 100.0 * cpu / wall,
            # CPU per verify barely depends on how busy the machine is (throughput does).
            "server_cpu_ms_per_verify": 1000.0 * cpu / good,
            "loadgen_cpu_ms_per_verify": 1000.0 * wrk_cpu / good,
            "loadgen_cpu_pct": 100.0 * wrk_cpu / wall,
            "failed_members": float(sum(r.window_bad for r in results)),
        }
        if setup.proxy_pid:
            proxy_cpu = results[0].cpu_s[setup.proxy_pid]
            out["haproxy_cpu_pct"] = 100.0 * proxy_cpu / wall
            out["haproxy_cpu_ms_per_verify"] = 1000.0 * proxy_cpu / good
        return out

    async def answer_bytes(url: str, bodies: BodyFactory, cohort: int) -> float:
        """Mean answer size over one whole cohort (a lone member would wait for the rest)."""
        host, port = url.removeprefix("http://").rsplit(":", 1)
        client = H11Client(host, int(port))
        sizes: list[int] = []

        async def member(i: int) -> None:
            answer = await client.request("POST", "/verify", bodies.member(cohort, i))
            sizes.append(len(answer.body))

        try:
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(member, i)
        finally:
            await client.aclose()
        return sum(sizes) / len(sizes)

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        nonlocal runs
        runs += 1
        logs = ctx.out_dir / "logs"
        # Installed (when missing) before any window is planned: drive() fixes one window
        # start for every wrk it runs, seconds ahead, which an install would overrun.
        await trio.to_thread.run_sync(ensure_wrk)
        async with contextlib.AsyncExitStack() as stack:
            bare = await stack.enter_async_context(launch_process(
                bare_command(), log_path=logs / "scaleout-bare.log", ready_prefix=_READY_BARE))
            one = await stack.enter_async_context(launch_process(
                replica_cmd, log_path=logs / "scaleout-one.log", ready_prefix=_READY_OURS))
            procs = [
                await stack.enter_async_context(launch_process(
                    replica_cmd, log_path=logs / f"scaleout-replica{i}.log",
                    ready_prefix=_READY_OURS))
                for i in range(1, replicas + 1)
            ]
            proxy = await stack.enter_async_context(open_haproxy(
                [p.base_url.removeprefix("http://") for p in procs],
                max_request_bytes=16 * 2**20, log_path=logs / "scaleout-haproxy.log"))
            setups = {
                "bare": Setup([(bare.base_url, [bare.pid])]),
                "one": Setup([(one.base_url, [one.pid])]),
                "two": Setup([(proxy.url, [p.pid for p in procs])], proxy.process.pid),
                # The same replicas, each driven by its own wrk: no HAProxy in the way.
                "pair": Setup([(p.base_url, [p.pid]) for p in procs]),
            }
            for name, setup in setups.items():  # warm-up: connections, caches, allocators
                await drive(ctx, f"{tag}-{runs}-warm-{name}", setup, 8 * n, 1)
            names = list(setups)
            rounds: list[dict[str, dict[str, float]]] = []
            for r in range(slices):
                order = names[r % len(names):] + names[:r % len(names)]
                if runs % 2 == 0:
                    order.reverse()
                got = {}
                for name in order:
                    setup = setups[name]
                    per_target = k * n * len(setup.pids) // len(setup.targets)
                    got[name] = await drive(ctx, f"{tag}-{runs}-{r}-{name}", setup,
                                            per_target, slice_s)
                rounds.append(got)
            sizes = BodyFactory(seed=19, run_tag=f"{tag}-{runs}-sizes-{time.time_ns()}")
            answer = {name: await answer_bytes(setups[name].targets[0][0], sizes, i)
                      for i, name in enumerate(("bare", "one"))}
        metrics: dict[str, float] = {}
        for name in names:
            for m in rounds[0][name]:
                metrics[f"{name}_{m}"] = median([g[name][m] for g in rounds])
        for name, size in answer.items():
            metrics[f"{name}_answer_bytes"] = size

        pairs = (("one", "bare"), ("two", "one"), ("two", "bare"), ("pair", "one"),
                 ("two", "pair"))
        per_round = [{f"{a}_over_{b}": g[a]["verifies_per_s"] / g[b]["verifies_per_s"]
                      for a, b in pairs} for g in rounds]
        for ratio in per_round[0]:
            metrics[ratio] = median([g[ratio] for g in per_round])
        # From CPU per verify, which barely depends on how busy the machine is: the verifies/s
        # each setup reaches on an otherwise idle machine with this many cores (each server
        # process bound by one core; all processes, load generator and HAProxy included, by
        # the cores together).
        cores = float(os.cpu_count() or 1)

        def cpu_bound(name: str, processes: int) -> float:
            server = metrics[f"{name}_server_cpu_ms_per_verify"]
            total = (server + metrics[f"{name}_loadgen_cpu_ms_per_verify"]
                     + metrics.get(f"{name}_haproxy_cpu_ms_per_verify", 0.0))
            return min(1000.0 * min(processes, cores) / server, 1000.0 * cores / total)

        bound = {"bare": cpu_bound("bare", 1), "one": cpu_bound("one", 1),
                 "two": cpu_bound("two", replicas), "pair": cpu_bound("pair", replicas)}
        for name, value in bound.items():
            metrics[f"{name}_cpu_bound_verifies_per_s"] = value
        metrics["one_over_bare_by_cpu"] = bound["one"] / bound["bare"]
        metrics["two_over_one_by_cpu"] = bound["two"] / bound["one"]
        return RunRecord(metrics, notes={"rounds": per_round,
                                         "loadavg_1min_before_end": os.getloadavg()[0]})

    params = {"n": n, "k_per_server": k, "slice_s": slice_s, "slices": slices,
              "replicas": replicas, "judge": judge, "load": "wrk"}
    return Case("scaleout", f"n{n}-k{k}-{replicas}replicas-{judge}", run, params,
                kinds=("ours",))


def step_cases(params: step.StepParams) -> list[Case]:
    """The ``step`` preset: one case per judge capacity of the sweep. Each run measures every
    schedule (and judge order) on the same arrival trace, one after the other, each in fresh
    processes, and compares their rewards member by member (see :mod:`genrm_trio.tools.step`).
    Our server only: NeMo Gym has no eager schedule."""
    arrivals = step.arrival_trace(params)
    pairs = step.pairs_of(params)
    eager_peak = step.peak_demand(step.ready_times(arrivals, pairs, "eager"), params.judge_s)
    wait_peak = step.peak_demand(step.ready_times(arrivals, pairs, "wait_for_all"),
                                 params.judge_s)
    capacities = params.capacities or step.default_capacities(params)
    orders: tuple[str | None, ...] = params.orders or (None,)
    runs = [(schedule, order) for schedule in step.SCHEDULES for order in orders]
    keys = [step.run_key(schedule, order) for schedule, order in runs]

    def make(capacity: int) -> Case:
        async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
            metrics: dict[str, float] = {}
            samples: dict[str, list[float]] = {}
            rewards: dict[str, dict[tuple[int, int], float | None]] = {}
            for (schedule, order), key in zip(runs, keys, strict=True):
                judge = JudgeSettings(latency_ms=params.judge_ms, capacity=capacity)
                server = ServerSettings(
                    n=params.n, collection_timeout_s=params.collection_timeout_s,
                    ours_extra=step.judge_sets(params, schedule, capacity, order))
                label = f"{tag}-{key.replace('/', '-')}"
                async with _rig(ctx, kind, judge, server, label) as rig:
                    done = await step.run_step(rig.client, rig.judge_client, params, arrivals,
                                               schedule)
                for name, value in step.step_metrics(done, params, capacity).items():
                    metrics[f"{key}:{name}"] = value
                rewards[key] = step.rewards_of(done)
                first = min(m.sent_at for c in done.cohorts for m in c.members) - done.t0
                samples[f"{key}:t"] = [t - first for t in done.samples_t]
                samples[f"{key}:in_flight"] = done.samples_in_flight
            for key in keys:
                metrics[f"{key}:rewards_equal"] = float(rewards[key] == rewards[keys[0]])
            return RunRecord(metrics, samples)

        case_params = {"label": params.label(), "capacity": capacity, "runs": keys,
                       "eager_peak": eager_peak, "wait_peak": wait_peak,
                       **{k: v for k, v in vars(params).items() if k != "capacities"}}
        return Case("step", f"{params.label()}-cap{capacity}", run, case_params,
                    kinds=("ours",))

    return [make(c) for c in capacities]


# -- presets -----------------------------------------------------------------------------------


def _soak_case(**overrides: Any) -> Case:
    from genrm_trio.tools.soak import soak_case  # soak builds on this module

    return soak_case(**overrides)


def _throughput_cases() -> list[Case]:
    return [
        load_case(
            "throughput", f"n{n}-k{k}-judge{j}ms", n=n, k=k, judge_ms=float(j), duration_s=4.0
        )
        for j in (0, 50)
        for n in (8, 16)
        for k in (1, 16, 64)
    ]


PRESETS: Mapping[str, Callable[[], list[Case]]] = MappingProxyType({
    "smoke": lambda: [
        load_case(
            "smoke",
            "n4-k2-judge0ms",
            n=4,
            k=2,
            judge_ms=0.0,
            duration_s=30.0,
            max_cohorts=6,
            warm_up=False,
        ),
    ],
    "throughput": _throughput_cases,
    "latency": lambda: [
        load_case(
            "latency",
            "k1-n16-judge50ms",
            n=16,
            k=1,
            judge_ms=50.0,
            duration_s=60.0,
            max_cohorts=100,
        ),
    ],
    "release": lambda: [release_case(t) for t in ("deadline", "sigterm", "disconnect")],
    "judge_client": lambda: [judge_client_case()],
    "staggered": lambda: [staggered_case()],
    "steady_state": lambda: [steady_state_case()],
    "admission": lambda: [admission_case(g) for g in (0, 1000, 3000, 5000, 10000)],
    "scaleout": lambda: [scaleout_case(judge="canned"), scaleout_case(judge="builtin")],
    "step": lambda: step_cases(step.StepParams()),
    "tail": lambda: [
        load_case(
            "tail", "k1-n16-judge50ms", n=16, k=1, judge_ms=50.0, duration_s=120.0, max_cohorts=400
        ),
    ],
    "soak": lambda: [_soak_case()],
})
"""Preset name -> its cases. ``all`` runs every preset but ``smoke`` and ``soak``, in order."""
_NOT_IN_ALL = frozenset({"smoke", "soak"})


# -- running and reporting ---------------------------------------------------------------------


class CaseResult(msgspec.Struct):
    """Every run of one case: per server the runs in order, then medians and per-pair ratios."""

    preset: str
    label: str
    params: dict[str, Any]
    runs: dict[str, list[RunRecord]]
    median: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    pair_ratios: dict[str, list[float]] = msgspec.field(default_factory=dict)
    median_ratio: dict[str, float] = msgspec.field(default_factory=dict)
    skipped: dict[str, str] = msgspec.field(default_factory=dict)


def _finite(x: float) -> bool:
    return isinstance(x, float | int) and math.isfinite(x)


def summarize(result: CaseResult) -> None:
    """Fill ``median``, ``pair_ratios`` (ours / nemo, pair by pair) and ``median_ratio``."""
    for kind, runs in result.runs.items():
        names = sorted({m for r in runs for m in r.metrics})
        result.median[kind] = {
            name: loadgen.median(
                [r.metrics[name] for r in runs if name in r.metrics and _finite(r.metrics[name])]
            )
            for name in names
        }
    ours, nemo = result.runs.get("ours", []), result.runs.get("nemo", [])
    for name in sorted({m for r in ours for m in r.metrics}):
        ratios = []
        for a, b in zip(ours, nemo, strict=False):
            x, y = a.metrics.get(name, math.nan), b.metrics.get(name, math.nan)
            if _finite(x) and _finite(y) and y != 0:
                ratios.append(x / y)
        if ratios:
            result.pair_ratios[name] = ratios
            result.median_ratio[name] = loadgen.median(ratios)


async def run_bench(
    presets: Sequence[str],
    *,
    out_dir: Path,
    kinds: Sequence[str] = KINDS,
    repeats: int = 2,
    nemo_venv: Path | None = None,
    echo: Callable[[str], None] = print,
    duration_s: float | None = None,
    step_params: step.StepParams | None = None,
    soak_overrides: Mapping[str, Any] | None = None,
) -> list[CaseResult]:
    """Run the presets' cases, alternating the servers A B A B ``repeats`` times per case, and
    write ``results.json``, ``summary.md`` and the plots into ``out_dir``.

    Blocks for as long as the runs take (minutes for ``all``). Every process started is ended
    before this returns, also on cancellation. A run that fails is recorded with its error and
    the bench goes on. Raises ``KeyError`` for an unknown preset name. ``step_params`` shapes
    the ``step`` preset (default :class:`~genrm_trio.tools.step.StepParams`);
    ``soak_overrides`` are keyword arguments of :func:`~genrm_trio.tools.soak.soak_case`.
    """
    names = ([p for p in PRESETS if p not in _NOT_IN_ALL] if list(presets) == ["all"]
             else list(presets))
    cases = [
        case
        for name in names
        for case in (step_cases(step_params) if name == "step" and step_params
                     else [_soak_case(**soak_overrides)] if name == "soak" and soak_overrides
                     else PRESETS[name]())
    ]
    if duration_s is not None:
        cases = [case.resize(duration_s) if case.resize else case for case in cases]
    await trio.to_thread.run_sync(functools.partial(out_dir.mkdir, parents=True, exist_ok=True))
    skip_nemo: str | None = None
    nemo_dir: Path | None = None
    if "nemo" in kinds and any("nemo" in case.kinds for case in cases):
        found = await trio.to_thread.run_sync(ensure_nemo_venv, nemo_venv or default_nemo_venv())
        if isinstance(found, Path):
            nemo_dir = found
        else:
            skip_nemo = found
            echo(found)
    ctx = BenchContext(out_dir, nemo_dir)
    results: list[CaseResult] = []
    for case in cases:
        result = CaseResult(case.preset, case.label, case.params, {k: [] for k in kinds})
        for rep in range(repeats):
            for kind in kinds:
                if kind not in case.kinds:
                    result.skipped[kind] = f"{kind} skipped: this case measures ours only"
                    continue
                if kind == "nemo" and skip_nemo:
                    result.skipped[kind] = skip_nemo
                    continue
                tag = f"{case.preset}-{case.label}-{rep}"
                started = time.perf_counter()
                try:
                    record = await case.run(ctx, kind, tag)
                except Exception as exc:  # one run's failure is a result; the bench goes on
                    why = _describe(exc)
                    record = RunRecord({}, notes={"error": why})
                    echo(f"  {tag} {kind}: FAILED {why}")
                else:
                    shown = ", ".join(f"{k}={v:.4g}" for k, v in list(record.metrics.items())[:5])
                    echo(f"  {tag} {kind} ({time.perf_counter() - started:.1f}s): {shown}")
                result.runs[kind].append(record)
        summarize(result)
        results.append(result)
        await trio.to_thread.run_sync(write_outputs, results, out_dir)
    return results


def gate_failures(results: Sequence[CaseResult]) -> list[str]:
    """One line per failed check (or error) of a gating case's runs; empty when all passed.

    A case gates when its params say ``gate: True`` (the soak): a run with ``failed_checks``
    in its notes, or one that raised, then makes ``genrm-trio bench`` exit 1."""
    out: list[str] = []
    for result in results:
        if not result.params.get("gate"):
            continue
        for kind, runs in result.runs.items():
            for run in runs:
                name = f"{result.preset}/{result.label} {kind}"
                if "error" in run.notes:
                    out.append(f"{name}: {run.notes['error']}")
                out.extend(f"{name}: {check}" for check in run.notes.get("failed_checks", []))
    return out


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:500]


_SHOWN: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "throughput": (
        "loadgen_cpu_pct",
        "verifies_per_s",
        "cpu_ms_per_cohort",
        "latency_p50_ms",
        "latency_p99_ms",
        "peak_rss_mb",
    ),
    "smoke": ("verifies_per_s", "cpu_ms_per_cohort", "latency_p50_ms", "failed_members"),
    "latency": (
        "over_judge_p50_ms",
        "over_judge_p99_ms",
        "latency_p50_ms",
        "judge_direct_p50_ms",
        "over_direct_p50_ms",
        "cpu_ms_per_cohort",
    ),
    "tail": (
        "over_judge_p50_ms",
        "over_judge_p99_ms",
        "latency_max_ms",
        "judge_direct_p50_ms",
        "cpu_ms_per_cohort",
    ),
    "release": (
        "release_p50_ms",
        "release_p99_ms",
        "release_max_ms",
        "rss_waiting_mb",
        "released",
    ),
    "judge_client": (
        "cpu_ms_per_judge_call",
        "wall_s_per_round",
        "judge_calls",
        "failed_requests",
        "peak_rss_mb",
    ),
    "scaleout": (
        "bare_verifies_per_s",
        "one_verifies_per_s",
        "two_verifies_per_s",
        "one_over_bare",
        "two_over_one",
        "pair_verifies_per_s",
        "pair_over_one",
        "two_over_pair",
        "one_over_bare_by_cpu",
        "two_over_one_by_cpu",
        "bare_server_cpu_ms_per_verify",
        "one_server_cpu_ms_per_verify",
        "two_server_cpu_ms_per_verify",
        "pair_server_cpu_ms_per_verify",
        "two_haproxy_cpu_ms_per_verify",
        "one_loadgen_cpu_ms_per_verify",
        "two_loadgen_cpu_ms_per_verify",
        "pair_loadgen_cpu_ms_per_verify",
        "bare_server_cpu_pct",
        "one_server_cpu_pct",
        "two_server_cpu_pct",
        "two_haproxy_cpu_pct",
        "bare_loadgen_cpu_pct",
        "one_loadgen_cpu_pct",
        "two_loadgen_cpu_pct",
        "one_answer_bytes",
        "bare_answer_bytes",
        "bare_failed_members",
        "one_failed_members",
        "two_failed_members",
    ),
    "staggered": ("makespan_s", "latency_p50_ms", "latency_p99_ms", "cpu_ms_per_cohort"),
    "steady_state": (
        "fresh_verifies_per_s",
        "steady_verifies_per_s",
        "steady_over_fresh_throughput",
        "fresh_cpu_ms_per_cohort",
        "steady_cpu_ms_per_cohort",
        "fresh_k1_latency_p50_ms",
        "steady_k1_latency_p50_ms",
    ),
})


def _fmt(x: float | None) -> str:
    if x is None or not _finite(x):
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _goal_rows(results: Sequence[CaseResult]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) for the issue's bar, from the medians."""
    by = {(r.preset, r.label): r for r in results}
    rows: list[tuple[str, str, str]] = []

    def med(preset: str, label: str, kind: str, metric: str) -> float:
        r = by.get((preset, label))
        return r.median.get(kind, {}).get(metric, math.nan) if r else math.nan

    def ratio(preset: str, label: str, metric: str) -> float:
        r = by.get((preset, label))
        return r.median_ratio.get(metric, math.nan) if r else math.nan

    def shown(value: float) -> str:
        # Three decimals below 10: a ratio of 1.597 must not read as a 1.6 that was missed.
        return f"{value:.3f}" if abs(value) < 10 else _fmt(value)

    def add(goal: str, value: float, ok: Callable[[float], bool], unit: str) -> None:
        if _finite(value):
            rows.append((goal, f"{shown(value)}{unit}", "met" if ok(value) else "MISSED"))

    so = ("scaleout", "n8-k32-2replicas-canned")
    for prefix, cpu in (("", ""), ("the same, CPU-bound on an idle machine (from CPU per verify): ",
                                   "_by_cpu")):
        add(f"{prefix}2 replicas behind HAProxy >= 1.6x one replica's verifies/s",
            med(*so, "ours", f"two_over_one{cpu}"), lambda v: v >= 1.6, "x")
        add(f"{prefix}one replica >= 80% of the bare Hypercorn app's verifies/s",
            med(*so, "ours", f"one_over_bare{cpu}"), lambda v: v >= 0.8, "x")
    add("the same, with the built-in judge: 2 replicas behind HAProxy >= 1.6x one replica's "
        "verifies/s", med("scaleout", "n8-k32-2replicas-builtin", "ours", "two_over_one"),
        lambda v: v >= 1.6, "x")
    pair = med(*so, "ours", "pair_over_one")
    if _finite(pair):  # context for the 1.6x goal, not a goal of its own
        rows.append(("this machine's own limit: 2 replicas, each driven directly (no HAProxy), "
                     "over one replica's verifies/s", f"{shown(pair)}x",
                     "can show 1.6x" if pair >= 1.6 else "cannot show 1.6x"))
    t = ("throughput", "n16-k16-judge50ms")
    add(
        "verifies/s at N=16,K=16,judge 50 ms >= 2.0x NeMo",
        ratio(*t, "verifies_per_s"),
        lambda v: v >= 2.0,
        "x",
    )
    add(
        "CPU per cohort at N=16,K=16,judge 50 ms <= 0.5x NeMo",
        ratio(*t, "cpu_ms_per_cohort"),
        lambda v: v <= 0.5,
        "x",
    )
    add(
        "K=1 last arrival -> rewards p50 <= judge + 5 ms",
        med("latency", "k1-n16-judge50ms", "ours", "over_judge_p50_ms"),
        lambda v: v <= 5,
        " ms",
    )
    for trig in ("deadline", "sigterm", "disconnect"):
        add(
            f"release of 10,000 waiters ({trig}) p99 <= 10 ms",
            med("release", trig, "ours", "release_p99_ms"),
            lambda v: v <= 10,
            " ms",
        )
    rss = [
        med("release", t2, "ours", "rss_waiting_mb") for t2 in ("deadline", "sigterm", "disconnect")
    ]
    rss = [x for x in rss if _finite(x)]
    if rss:
        add("RSS with 10,000 waiting members <= 250 MB", max(rss), lambda v: v <= 250, " MB")
    add(
        "judge client CPU per call at 1,024 in flight <= 0.5 ms",
        med("judge_client", "1024-in-flight-judge1000ms", "ours", "cpu_ms_per_judge_call"),
        lambda v: v <= 0.5,
        " ms",
    )
    add(
        "steady state (4,096 retained) within 10% of fresh throughput",
        med("steady_state", "n16-k16-retained4096", "ours", "steady_over_fresh_throughput"),
        lambda v: v >= 0.9,
        "x fresh",
    )
    add(
        "p99 at K=1,N=16,judge 50 ms <= judge + 20 ms",
        med("tail", "k1-n16-judge50ms", "ours", "over_judge_p99_ms"),
        lambda v: v <= 20,
        " ms",
    )
    return rows


def render_markdown(results: Sequence[CaseResult]) -> str:
    """The summary table: per case and metric, the median for each server and the median of
    the per-pair ratios (ours / NeMo Gym)."""
    lines = [
        "# genrm-trio vs NeMo Gym 0.7.0 genrm_compare",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} on {os.cpu_count()} CPUs. "
        "Medians over runs; ratio = median of per-pair ours/NeMo ratios (runs alternate "
        "A B A B).",
        "",
    ]
    current = None
    for r in results:
        if r.preset == "step":
            continue  # its own table below: schedules side by side, not servers
        if r.preset != current:
            current = r.preset
            lines += [
                "",
                f"## {r.preset}",
                "",
                "| case | metric | ours | NeMo Gym | ours/NeMo |",
                "| --- | --- | ---: | ---: | ---: |",
            ]
        metrics = _SHOWN.get(r.preset) or tuple(sorted(r.median.get("ours", {})))
        for m in metrics:
            ours = r.median.get("ours", {}).get(m)
            nemo = r.median.get("nemo", {}).get(m)
            if ours is None and nemo is None:
                continue
            lines.append(
                f"| {r.label} | {m} | {_fmt(ours)} | {_fmt(nemo)} | {_fmt(r.median_ratio.get(m))} |"
            )
        for kind, why in r.skipped.items():
            lines.append(f"| {r.label} | ({kind} skipped) | {why} | | |")
        for kind, runs in r.runs.items():
            for i, run in enumerate(runs):
                if "error" in run.notes:
                    lines.append(
                        f"| {r.label} | ({kind} run {i} failed) | {run.notes['error'][:120]} | | |"
                    )
                elif run.notes.get("failures"):
                    lines.append(
                        f"| {r.label} | ({kind} run {i} failures) | {run.notes['failures']} | | |"
                    )
                elif "answers" in run.notes:
                    lines.append(
                        f"| {r.label} | ({kind} run {i} answers) | {run.notes['answers']} | | |"
                    )
    sweep = step.render_sweep(results)
    if sweep:
        lines += ["", "## step", "", sweep]
    goals = _goal_rows(results)
    if goals:
        lines += [
            "",
            "## Goals (ours)",
            "",
            "| goal | measured | verdict |",
            "| --- | ---: | --- |",
        ]
        lines += [f"| {g} | {v} | {ok} |" for g, v, ok in goals]
    return "\n".join(lines) + "\n"


def write_outputs(results: Sequence[CaseResult], out_dir: Path) -> list[Path]:
    """Write ``results.json``, ``summary.md`` and (when matplotlib is installed) the plots."""
    written = [out_dir / "results.json", out_dir / "summary.md"]
    written[0].write_bytes(msgspec.json.format(msgspec.json.encode(list(results)), indent=1))
    written[1].write_text(render_markdown(results), encoding="utf-8")
    try:
        written += plot(results, out_dir)
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
    return written


def plot(results: Sequence[CaseResult], out_dir: Path) -> list[Path]:
    """PNG plots: latency CDFs, throughput vs K, release-time CDFs. Raises ``ImportError``
    without matplotlib (the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    colors = {"ours": "tab:blue", "nemo": "tab:orange"}

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def cdf_figure(cases: list[CaseResult], sample: str, title: Callable[[CaseResult], str],
                   xlabel: str, ylabel: str, name: str) -> None:
        """One panel per case: the CDF of ``sample`` for each server, log x axis."""
        if not cases:
            return
        fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
        for ax, r in zip(axes[0], cases, strict=True):
            for kind, runs in r.runs.items():
                xs = sorted(max(v, 0.01) for run in runs for v in run.samples.get(sample, []))
                if xs:
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    ax.step(xs, ys, where="post", label=kind, color=colors[kind])
            ax.set_title(title(r), fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        save(fig, name)

    cdf_figure(
        [
            r
            for r in results
            if r.preset in ("latency", "tail", "staggered", "smoke")
            or (r.preset == "throughput" and r.label.startswith("n16-k16"))
        ],
        "latency_ms", lambda r: f"{r.preset} {r.label}",
        "last send -> last reward (ms)", "fraction of cohorts", "latency_cdf.png",
    )

    tp = [r for r in results if r.preset == "throughput"]
    if tp:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, judge in zip(axes, ("judge0ms", "judge50ms"), strict=True):
            for kind in ("ours", "nemo"):
                for n, style in (("n8", "--"), ("n16", "-")):
                    pts = sorted(
                        (int(r.params["k"]), r.median.get(kind, {}).get("verifies_per_s", math.nan))
                        for r in tp
                        if r.label.startswith(n + "-") and r.label.endswith(judge)
                    )
                    pts = [(k, v) for k, v in pts if _finite(v)]
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            style,
                            marker="o",
                            color=colors[kind],
                            label=f"{kind} {n.upper()}",
                        )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("cohorts in flight (K)")
            ax.set_ylabel("verifies / s (median)")
            ax.set_title(f"throughput, {judge.replace('judge', 'judge ')}")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        save(fig, "throughput_vs_k.png")

    cdf_figure(
        [r for r in results if r.preset == "release"],
        "release_ms", lambda r: f"release of 10,000 waiters: {r.label}",
        "trigger -> released (ms)", "fraction of waiters", "release_cdf.png",
    )

    step_results = [r for r in results if r.preset == "step" and r.runs.get("ours")]
    if step_results:
        keys: list[str] = list(step_results[0].params["runs"])
        palette = ["tab:orange", "tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        caps = [int(r.params["capacity"]) for r in step_results]
        for key, color in zip(keys, palette, strict=False):
            ys = [r.median.get("ours", {}).get(f"{key}:makespan_s", math.nan)
                  for r in step_results]
            ax.plot(caps, ys, marker="o", color=color, label=f"{key} makespan")
        bound = [r.median.get("ours", {}).get(f"{keys[0]}:lower_bound_s", math.nan)
                 for r in step_results]
        last = [r.median.get("ours", {}).get(f"{keys[0]}:last_arrival_s", math.nan)
                for r in step_results]
        ax.plot(caps, bound, "k--", label="lower bound")
        ax.plot(caps, [1.1 * x for x in last], "k:", label="last arrival + 10%")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("judge capacity (calls at once)")
        ax.set_ylabel("step makespan (s)")
        ax.set_title(f"step {step_results[0].params['label']}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "step_makespan.png")

        fig, axes = plt.subplots(len(step_results), 1, figsize=(7, 2.2 * len(step_results)),
                                 squeeze=False)
        for ax, r in zip(axes[:, 0], step_results, strict=True):
            cap = int(r.params["capacity"])
            first = r.runs["ours"][0].samples
            for key, color in zip(keys, palette, strict=False):
                ts = first.get(f"{key}:t", [])
                ys = [v / cap for v in first.get(f"{key}:in_flight", [])]
                ax.plot(ts, ys, color=color, lw=0.8, label=key)
            ax.set_ylim(0, 1.05)
            ax.set_ylabel(f"busy / {cap}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        axes[-1, 0].set_xlabel("seconds since the first request")
        fig.suptitle("judge utilisation over the step", fontsize=9)
        save(fig, "step_utilisation.png")

    soak_runs = [(r, run) for r in results if r.preset == "soak"
                 for run in r.runs.get("ours", []) if run.samples.get("t_s")]
    if soak_runs:
        fig, axes = plt.subplots(len(soak_runs), 1, figsize=(8, 3.6 * len(soak_runs)),
                                 squeeze=False)
        for ax, (r, run) in zip(axes[:, 0], soak_runs, strict=True):
            _plot_soak_rss(ax, r, run)
        axes[-1, 0].set_xlabel("minutes since the load started")
        save(fig, "soak_rss.png")
    return written


def _plot_soak_rss(ax: Any, result: CaseResult, run: RunRecord) -> None:
    """One soak run: RSS, malloc's heap and what is in use in it, pymalloc's share (RSS
    outside malloc's heap and mapped blocks), and the least-squares line of the last half."""
    mb = 2**20
    minutes = [t / 60 for t in run.samples["t_s"]]
    ax.plot(minutes, run.samples["rss_mb"], color="tab:blue", lw=1.2, label="RSS")
    heap = run.samples.get("memory.allocator.heap_bytes")
    used = run.samples.get("memory.allocator.in_use_bytes")
    mapped = run.samples.get("memory.allocator.mmapped_bytes")
    if heap and used and len(heap) == len(minutes):
        ax.plot(minutes, [h / mb for h in heap], color="tab:orange", lw=0.8,
                label="malloc heap")
        ax.plot(minutes, [u / mb for u in used], color="tab:green", lw=0.8,
                label="malloc in use")
    if heap and mapped and len(heap) == len(minutes):
        rest = [rss - (h + m) / mb
                for rss, h, m in zip(run.samples["rss_mb"], heap, mapped, strict=True)]
        ax.plot(minutes, rest, color="tab:purple", lw=0.8,
                label="RSS minus malloc's heap and blocks (pymalloc, code; less once trimmed)")
    m = run.metrics
    slope = m.get("rss_last_half_slope_mb_per_min", math.nan)
    start_s = m.get("rss_last_half_start_s", math.nan)
    end_s = m.get("rss_last_half_end_s", math.nan)
    at_start = m.get("rss_last_half_fit_start_mb", math.nan)
    if all(_finite(x) for x in (slope, start_s, end_s, at_start)):
        xs = [start_s / 60, end_s / 60]
        ys = [at_start, at_start + slope * (end_s - start_s) / 60]
        ax.plot(xs, ys, "k--", lw=1.2, label=f"last-half fit: {slope:+.3f} MB/min")
    limit = result.params.get("rss_slope_limit_mb_per_min")
    gate = f", gate < {limit:g} MB/min" if limit is not None else ""
    ax.set_title(f"soak {result.label}: "
                 f"{m.get('offered_verifies_per_s', math.nan):.0f} verifies/s offered "
                 f"(half of {m.get('capacity_verifies_per_s', math.nan):.0f}){gate}",
                 fontsize=9)
    ax.set_ylabel("MB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _default_out_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "bench"
    return (here if here.is_dir() else Path.cwd() / "bench") / "results"


@click.command("bench")
@click.option(
    "--preset",
    "presets",
    multiple=True,
    default=("all",),
    show_default=True,
    help="Preset to run (repeatable): all, " + ", ".join(PRESETS) + ".",
)
@click.option(
    "--repeats",
    type=int,
    default=2,
    show_default=True,
    help="A B pairs per case (runs alternate ours, NeMo Gym, ours, ...).",
)
@click.option(
    "--servers",
    type=click.Choice(["both", "ours", "nemo"]),
    default="both",
    show_default=True,
    help="Which servers to measure.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Results folder (default bench/results).",
)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=1.0),
    default=None,
    help="Length of the cases that take one (the soak: default 600 s).",
)
@click.option(
    "--step",
    "step_overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Shape the step preset (repeatable): n, k, strategy, median_gen_s, sigma, judge_ms, "
    "capacities (comma list), orders (comma list), seed, collection_timeout_s.",
)
@click.option(
    "--soak",
    "soak_items",
    multiple=True,
    metavar="KEY=VALUE",
    help="Shape the soak preset (repeatable): load_fraction, tracemalloc_frames, trace_s, "
    "env=NAME=VALUE (for the server), sample_s, fault_rate, ... (bench/README.md).",
)
@click.option(
    "--nemo-venv",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="NeMo Gym venv (default $GENRM_TRIO_NEMO_VENV or ~/.cache/genrm-trio/...).",
)
def bench_cli(
    presets: tuple[str, ...],
    repeats: int,
    servers: str,
    out_dir: Path | None,
    duration_s: float | None,
    step_overrides: tuple[str, ...],
    soak_items: tuple[str, ...],
    nemo_venv: Path | None,
) -> None:
    """Benchmark genrm-trio side by side with NeMo Gym's genrm_compare on this machine.

    Writes results.json, summary.md and PNG plots into the results folder and prints the table.
    Unknown preset: exit 2. A gating case (the soak) that failed a check or could not run: exit
    1 after the table.
    """
    for p in presets:
        if p != "all" and p not in PRESETS:
            raise click.BadParameter(f"unknown preset {p!r}", param_hint="--preset")
    try:
        step_params = step.parse_overrides(step_overrides) if step_overrides else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--step") from None
    from genrm_trio.tools.soak import parse_soak_overrides

    try:
        soak_overrides = parse_soak_overrides(soak_items) if soak_items else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--soak") from None
    kinds = KINDS if servers == "both" else (servers,)
    out = out_dir or _default_out_dir()
    results = trio.run(
        functools.partial(
            run_bench,
            list(presets),
            out_dir=out,
            kinds=kinds,
            repeats=repeats,
            nemo_venv=nemo_venv,
            echo=lambda s: click.echo(s, err=True),
            duration_s=duration_s,
            step_params=step_params,
            soak_overrides=soak_overrides,
        )
    )
    click.echo(render_markdown(results))
    click.echo(f"results in {out}", err=True)
    failed = gate_failures(results)
    for line in failed:
        click.echo(f"FAILED {line}", err=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    bench_cli()
