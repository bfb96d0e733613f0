"""``scaleout``: one replica, two behind HAProxy, the pair driven directly and the bare ASGI
app, side by side, driven by wrk in rotating rounds."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass

import trio

from genrm_trio.bench.loadgen import BodyFactory, H11Client, median
from genrm_trio.bench.processes import launch_process
from genrm_trio.bench.records import BenchContext, Case, RunRecord, ServerSettings
from genrm_trio.bench.rig import READY_OURS, ours_command

_READY_BARE = "genrm-trio bare listening on "


def bare_command() -> list[str]:
    """The bare Hypercorn ASGI app (:mod:`genrm_trio.bench.bare`) on a free loopback port."""
    return [sys.executable, "-m", "genrm_trio.bench.bare", "--port", "0"]


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
    in flight at the end; the window leaves both out (:func:`genrm_trio.bench.wrk.run_wrk`):
    two replicas behind HAProxy open about three times the connections one replica does. The
    load is wrk (:mod:`genrm_trio.bench.wrk`, a load generator in C: the Python one would take
    a third of a core the servers need) with K cohorts of N in flight per server process
    (K x N connections to the bare app and to one replica, 2 x K x N through HAProxy to two),
    so each server sees the same depth of work: with K cohorts shared by two, each replica ran
    out of work at times (measured: 10 to 20 % fewer verifies/s through HAProxy at K = 32 than
    at 64). The replicas judge with :func:`genrm_trio.bench.bare.canned_judge`
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
    from genrm_trio.bench.bare import CANNED_JUDGE
    from genrm_trio.bench.haproxy import open_haproxy
    from genrm_trio.bench.wrk import WrkResult, ensure_wrk, run_wrk

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
                replica_cmd, log_path=logs / "scaleout-one.log", ready_prefix=READY_OURS))
            procs = [
                await stack.enter_async_context(launch_process(
                    replica_cmd, log_path=logs / f"scaleout-replica{i}.log",
                    ready_prefix=READY_OURS))
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
