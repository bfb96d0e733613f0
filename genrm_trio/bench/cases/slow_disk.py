"""The ``slow_disk`` bench preset: the journal (``state_dir``) on a disk whose every sync is slow.

The server runs with ``state_dir`` and ``probe_port: 0`` under an ``LD_PRELOAD`` shim
(:mod:`genrm_trio.bench.sync_shim`, compiled with ``cc`` into the output directory) that delays
every ``fsync``/``fdatasync``/``syncfs``/``msync``/``sync_file_range`` of the server process by
``sync_ms`` (0, 10 and 200 ms: a healthy disk, a slow one, a degraded disk or a busy network
volume), with ``state_sync`` ``normal`` or ``full``. An open-loop load sends ``rate_per_s``
explicit cohorts of N a second (every member at once) for ``duration_s``, whatever the server
does; each cohort waits at most ``client_timeout_s`` (a client's 60 s) for its answers. A
prober process (the flood preset's) times ``GET /healthz`` on the probe port every
``probe_interval_s`` on a fresh connection, from its own event loop.

::

    slow_disk_case(...).run               one rig: mock judge, genrm-trio serve (shimmed)
      +-- prober process                  GET /healthz on probe_port every probe_interval_s
      +-- a task per cohort, started      its N members at once, bounded by client_timeout_s
          every 1/rate_per_s s
      +-- GET /status (the journal's counters); the rig stops the server by its pid

Reported: ``rewarded`` (cohorts whose every member got an unmasked reward within the client's
timeout) of ``cohorts``, the throughput ``rewarded_per_s`` (rewarded cohorts per second from the
first send to the last answer), cohort latency p50/p99/max (first send to last answer), probe
p50/p99/max, the journal's commits and largest batch when the server reports them, and
whether it degraded. ``GENRM_BENCH_SERVER_PYTHONPATH`` (e.g. ``/work/main``) runs the server
under test from another checkout, for before/after figures. Ours only.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases.flood import _run_prober, _status
from genrm_trio.bench.loadgen import BodyFactory, CohortResult, CohortSpec, percentile
from genrm_trio.bench.records import (
    BenchContext,
    BenchError,
    Case,
    JudgeSettings,
    RunRecord,
    ServerSettings,
)
from genrm_trio.bench.rig import Rig, _rig
from genrm_trio.bench.sync_shim import ShimUnavailable, build_sync_shim, shim_env

SERVER_PYTHONPATH = "GENRM_BENCH_SERVER_PYTHONPATH"


def slow_disk_case(
    sync_ms: float,
    state_sync: str,
    *,
    rate_per_s: float = 20.0,
    duration_s: float = 10.0,
    n: int = 4,
    judge_ms: float = 20.0,
    client_timeout_s: float = 60.0,
    probe_interval_s: float = 0.05,
) -> Case:
    """One disk speed and ``state_sync`` (see the module docstring)."""
    label = f"sync{sync_ms:g}ms-{state_sync}"
    params: dict[str, Any] = {
        "sync_ms": sync_ms, "state_sync": state_sync, "rate_per_s": rate_per_s,
        "duration_s": duration_s, "n": n, "judge_ms": judge_ms,
        "client_timeout_s": client_timeout_s, "probe_interval_s": probe_interval_s,
        "server_pythonpath": os.environ.get(SERVER_PYTHONPATH),
    }

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        try:
            library = await trio.to_thread.run_sync(build_sync_shim, ctx.out_dir / "shim")
        except ShimUnavailable as exc:
            raise BenchError(str(exc)) from exc
        state_dir = ctx.out_dir / "state" / f"{tag}-{ctx.runs + 1}"
        syncs = ctx.out_dir / "state" / f"{tag}-{ctx.runs + 1}.syncs"
        env = shim_env(library, sync_ms, syncs)
        if params["server_pythonpath"]:
            env["PYTHONPATH"] = params["server_pythonpath"]
        settings = ServerSettings(
            n=n, collection_timeout_s=120.0,
            ours_extra=(("state_dir", str(state_dir)), ("state_sync", state_sync),
                        ("probe_port", "0")),
            ours_env=tuple(env.items()))
        async with _rig(ctx, kind, JudgeSettings(latency_ms=judge_ms), settings, tag) as rig:
            record = await _load(rig)
        record.metrics["syncs"] = float(syncs.stat().st_size) if syncs.exists() else 0.0
        return record

    async def _load(rig: Rig) -> RunRecord:
        host, port = rig.server.host_port
        first = await _status(host, port)
        probe_port = int(first["config"]["probe_port"])
        bodies = BodyFactory(seed=11, run_tag=rig.run_tag)
        count = int(rate_per_s * duration_s)
        results: list[CohortResult | None] = [None] * count
        probes: list[tuple[str, float, float, int]] = []
        pid = rig.server.pid
        cpu_before = loadgen.read_proc_stats(pid).cpu_s

        async def cohort(index: int) -> None:
            with trio.move_on_after(client_timeout_s):
                results[index] = await loadgen.run_cohort(rig.client, bodies,
                                                          CohortSpec(index, n))

        spec = {"targets": [["probe/healthz", host, probe_port, "/healthz"]],
                "interval_s": probe_interval_s, "timeout_s": 30.0}
        started = time.perf_counter()
        async with trio.open_nursery() as prober:
            stop_probing = await prober.start(_run_prober, spec, probes)
            async with trio.open_nursery() as load:
                for index in range(count):
                    # Open loop: cohort i starts at i / rate whatever the server does.
                    await trio.sleep_until(trio.current_time() + max(
                        0.0, started + index / rate_per_s - time.perf_counter()))
                    load.start_soon(cohort, index)
            load_s = time.perf_counter() - started
            await stop_probing()
        status = await _status(host, port)
        cpu_s = loadgen.read_proc_stats(pid).cpu_s - cpu_before
        done = [r for r in results if r is not None]
        rewarded = [r for r in done if r.ok]
        latencies = [1000 * (max(m.done_at for m in r.members)
                             - min(m.sent_at for m in r.members)) for r in rewarded]
        took = [1000 * t for name, _, t, status_code in probes]
        failed_probes = sum(1 for *_, status_code in probes if status_code != 200)
        journal = status.get("journal") or {}
        metrics: dict[str, float] = {
            "cohorts": float(count),
            "rewarded": float(len(rewarded)),
            # Throughput: cohorts rewarded per second, from the first send to the last answer
            # (the offered rate, rate_per_s, while the server keeps up).
            "rewarded_per_s": len(rewarded) / max(1e-9, max(
                (m.done_at for r in rewarded for m in r.members), default=started) - started),
            "unanswered": float(count - len(done)),
            "answered_not_rewarded": float(len(done) - len(rewarded)),
            "cohort_p50_ms": percentile(latencies, 0.5),
            "cohort_p99_ms": percentile(latencies, 0.99),
            "cohort_max_ms": max(latencies, default=math.nan),
            "probe_p50_ms": percentile(took, 0.5),
            "probe_p99_ms": percentile(took, 0.99),
            "probe_max_ms": max(took, default=math.nan),
            "probes": float(len(took)),
            "failed_probes": float(failed_probes),
            "load_s": load_s,
            "server_cpu_pct": 100.0 * cpu_s / load_s,
            "journal_degraded": float(bool(journal.get("degraded"))),
            "journal_commits": float(journal.get("commits", math.nan)),
            "journal_largest_batch": float(journal.get("largest_batch", math.nan)),
        }
        notes = {"journal": journal}
        samples = {"cohort_ms": latencies, "probe_ms": took,
                   "probe_at_s": [at for _, at, _, _ in probes]}
        return RunRecord(metrics, samples, notes)

    def resize(seconds: float) -> Case:
        return slow_disk_case(sync_ms, state_sync, rate_per_s=rate_per_s, duration_s=seconds,
                              n=n, judge_ms=judge_ms, client_timeout_s=client_timeout_s,
                              probe_interval_s=probe_interval_s)

    return Case("slow_disk", label, run, params, kinds=("ours",), resize=resize)


def slow_disk_cases() -> list[Case]:
    """The preset: 0, 10 and 200 ms per sync, each with ``state_sync`` normal and full."""
    return [slow_disk_case(ms, sync) for ms in (0.0, 10.0, 200.0) for sync in ("normal", "full")]
