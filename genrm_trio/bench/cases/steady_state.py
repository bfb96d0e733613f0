"""``steady_state``: fresh numbers, then thousands of retained terminal cohorts, then the same
numbers again."""

from __future__ import annotations

import time

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases.measure import measured_load, send_many, to_ms, warm_up_run
from genrm_trio.bench.loadgen import BodyFactory, LoadPlan, MemberResult, percentile
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import Rig, _rig


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
        record = await measured_load(rig, bodies, plan, judge_ms)
        lat_plan = LoadPlan(
            n=n, k=1, max_cohorts=latency_cohorts, duration_s=120.0, first_cohort=first + 500_000
        )
        lat = await loadgen.drive_load(rig.client, bodies, lat_plan)
        lat_ms = [to_ms(x) for x in lat.latencies_s()]
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
            await warm_up_run(rig, bodies, n)
            fresh, fresh_lat = await measure(rig, bodies, 0)
            fill: list[tuple[int, MemberResult]] = []
            fill_start = time.perf_counter()
            await send_many(rig, bodies, [(2_000_000 + i, 0) for i in range(retained)], fill)
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
