"""The load family: closed-loop cohorts at a fixed depth (``smoke``, ``throughput``,
``latency``, ``tail``) and staggered generation times (``staggered``)."""

from __future__ import annotations

import math
from typing import Any

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases.measure import judge_floor, load_metrics, measured_load, warm_up_run
from genrm_trio.bench.loadgen import BodyFactory, LoadPlan, percentile
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import _rig


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
                await warm_up_run(rig, bodies, n)
            floor = await judge_floor(rig, n) if k == 1 else []
            plan = LoadPlan(n=n, k=k, max_cohorts=max_cohorts, duration_s=duration_s)
            record = await measured_load(rig, bodies, plan, judge_ms)
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
            await warm_up_run(rig, bodies, n)
            plan = LoadPlan(n=n, k=k, max_cohorts=k, duration_s=600.0)
            before = rig.stats()
            result = await loadgen.drive_load(rig.client, bodies, plan, delays=delay, seed=5)
            after = rig.stats()
            metrics, samples, notes = load_metrics(
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
