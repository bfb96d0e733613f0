"""What several cases measure alike: load metrics from a load run, a warm-up, the judge floor,
many cohorts sent at once, waiting for the server to go idle."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.loadgen import BodyFactory, LoadPlan, LoadResult, MemberResult, percentile
from genrm_trio.bench.records import RunRecord
from genrm_trio.bench.rig import Rig


def to_ms(seconds: float) -> float:
    return seconds * 1000.0


def load_metrics(
    result: LoadResult, cpu_s: float, peak_rss: int, judge_ms: float
) -> tuple[dict[str, float], dict[str, list[float]], dict[str, Any]]:
    lat = [to_ms(x) for x in result.latencies_s()]
    cohorts_ok = sum(1 for c in result.cohorts if c.ok)
    metrics = {
        "verifies_per_s": result.verifies / result.wall_s if result.wall_s else math.nan,
        "cohorts_per_s": cohorts_ok / result.wall_s if result.wall_s else math.nan,
        "cpu_ms_per_cohort": to_ms(cpu_s) / cohorts_ok if cohorts_ok else math.nan,
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


async def measured_load(
    rig: Rig, bodies: BodyFactory, plan: LoadPlan, judge_ms: float, **kw: Any
) -> RunRecord:
    before = rig.stats()
    own_before = time.process_time()
    result = await loadgen.drive_load(rig.client, bodies, plan, **kw)
    own_s = time.process_time() - own_before
    after = rig.stats()
    metrics, samples, notes = load_metrics(
        result, after.cpu_s - before.cpu_s, after.peak_rss_bytes, judge_ms
    )
    # The load generator's own CPU use: near 100% means the harness, not the server, is the
    # limit of this run.
    metrics["loadgen_cpu_pct"] = 100.0 * own_s / result.wall_s if result.wall_s else math.nan
    return RunRecord(metrics, samples, notes)


async def warm_up_run(rig: Rig, bodies: BodyFactory, n: int) -> None:
    plan = LoadPlan(n=n, k=1, max_cohorts=2, duration_s=60.0, first_cohort=1_000_000)
    await loadgen.drive_load(rig.client, bodies, plan)


async def judge_floor(rig: Rig, n: int, rounds: int = 30) -> list[float]:
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
        out.append(to_ms(time.perf_counter() - start))
    return out


async def send_many(
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


async def wait_idle(rig: Rig, limit_s: float = 60.0) -> None:
    """Wait until the server burns under 5 ms CPU per 100 ms (it has read everything sent)."""
    with trio.move_on_after(limit_s):
        last = rig.stats().cpu_s
        while True:
            await trio.sleep(0.1)
            now = rig.stats().cpu_s
            if now - last < 0.005:
                return
            last = now
