"""The ``step`` benchmark preset: one RL step against a capacity-limited judge, per schedule.

An RL step starts K groups of N rollouts together. Each rollout's generation time is drawn
from a lognormal distribution (median and spread are parameters; seeded, so every run of a
sweep replays the same arrival trace), and each finished rollout is sent to ``/verify`` at once.
The judge is the mock judge with ``--capacity C`` and a fixed latency; the server's
``judge_max_concurrency`` is set to the same C, so the queue of judge work forms in the server,
where its order is decided.

For every judge capacity of the sweep, both schedules (``wait_for_all``, ``eager``) run side by
side on the same trace, each in fresh processes, and the run reports:

- makespan: first request sent to last answer received;
- last arrival -> rewards per group (p50, p99 over the K groups);
- judge utilisation: the mock judge's busy seconds over ``C * makespan``, and its in-flight
  calls over time (sampled);
- comparisons wasted on cohorts that failed (the server's ``genrm_comparisons_wasted_total``);
- the lower bound: the later of (last arrival + one judge call) and (first pair ready + total
  judge work / C), from the run's own send times;
- whether every member's reward equals the other schedule's.

::

    step_cases(params)                     one bench Case per capacity
      +-- case.run(ctx, "ours", tag)       for each schedule (and judge order):
            +-- rig._rig(...)              mock judge + server processes, ended after the run
            +-- _run_step(rig, ...)        K cohort tasks (loadgen.run_cohort with the trace's
                                           delays) and a sampler task, in one nursery

The pure part (trace, demand, bounds, the ideal queue) has no I/O and is tested directly.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import trio

from genrm_trio import scoring
from genrm_trio.bench import loadgen
from genrm_trio.bench.loadgen import BodyFactory, CohortResult, CohortSpec, percentile
from genrm_trio.bench.records import (
    BenchContext,
    Case,
    JudgeSettings,
    RunRecord,
    ServerSettings,
    apply_overrides,
)
from genrm_trio.bench.rig import _rig

SCHEDULES = ("wait_for_all", "eager")
SAMPLE_INTERVAL_S = 0.01


@dataclass(frozen=True)
class StepParams:
    """One step's shape. Times are scaled down (see the README: 1 s here stands for a minute
    of a real step when ``median_gen_s`` is 1). ``capacities`` empty: a sweep chosen from the
    trace's peak demand. ``orders``: the judge orders to run (``judge_order`` values; the
    server's default when empty)."""

    n: int = 8
    k: int = 16
    strategy: str = "circular"
    median_gen_s: float = 1.0
    sigma: float = 0.8
    judge_ms: float = 500.0
    capacities: tuple[int, ...] = ()
    orders: tuple[str, ...] = ()
    seed: int = 1
    collection_timeout_s: float = 1800.0

    @property
    def judge_s(self) -> float:
        return self.judge_ms / 1000.0

    def label(self) -> str:
        return (f"n{self.n}-k{self.k}-{self.strategy}-judge{self.judge_ms:g}ms"
                f"-gen{self.median_gen_s:g}s-sigma{self.sigma:g}")


def parse_overrides(items: Iterable[str], base: StepParams | None = None) -> StepParams:
    """``KEY=VALUE`` strings (``capacities=4,8,16``) over ``base``. Raises ``ValueError``
    naming the key for an unknown key or a bad value."""

    def convert(key: str, value: str) -> Any:
        if key == "capacities":
            return tuple(int(v) for v in value.split(",") if v.strip())
        if key == "orders":
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if key == "strategy":
            if value not in ("circular", "all_pairs"):
                raise ValueError("circular or all_pairs")
            return value
        if key in ("n", "k", "seed"):
            return int(value)
        return float(value)

    out = apply_overrides("--step", items, base or StepParams(), convert)
    if out.n < 2 or out.k < 1 or out.median_gen_s <= 0 or out.sigma < 0 or out.judge_ms < 0:
        raise ValueError("--step: need n >= 2, k >= 1, median_gen_s > 0, sigma >= 0, "
                         "judge_ms >= 0")
    if any(c < 1 for c in out.capacities):
        raise ValueError("--step capacities: each must be >= 1")
    return out


# -- the pure model ------------------------------------------------------------------------------


def arrival_trace(params: StepParams) -> list[list[float]]:
    """Generation time of every rollout, ``trace[group][slot]`` seconds after the step starts.
    Lognormal with the given median and spread, cut at 20 medians; same seed, same trace."""
    rng = random.Random(params.seed)
    mu = math.log(params.median_gen_s)
    cap = 20.0 * params.median_gen_s
    return [[min(cap, rng.lognormvariate(mu, params.sigma)) for _ in range(params.n)]
            for _ in range(params.k)]


def pairs_of(params: StepParams) -> list[tuple[int, int]]:
    return [(i, j) for i, j, _ in scoring.comparison_pairs(params.n, params.strategy, 1)]


def ready_times(arrivals: Sequence[Sequence[float]], pairs: Sequence[tuple[int, int]],
                schedule: str) -> list[float]:
    """When each comparison of the step may start: eager, when both of its members are there;
    wait_for_all, when its whole group is."""
    out: list[float] = []
    for group in arrivals:
        last = max(group)
        for i, j in pairs:
            out.append(max(group[i], group[j]) if schedule == "eager" else last)
    return out


def peak_demand(ready: Sequence[float], judge_s: float) -> int:
    """The most comparisons in flight at once with an unlimited judge (each starts when ready
    and takes ``judge_s``)."""
    events = sorted([(t, 1) for t in ready] + [(t + judge_s, -1) for t in ready],
                    key=lambda e: (e[0], e[1]))
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def lower_bound(arrivals: Sequence[Sequence[float]], pairs: Sequence[tuple[int, int]],
                judge_s: float, capacity: int) -> float:
    """No schedule finishes the step sooner: the later of (last arrival + one judge call) and
    (first pair ready + all judge work / capacity), measured from the first arrival."""
    first = min(min(g) for g in arrivals)
    last = max(max(g) for g in arrivals)
    first_pair = min(ready_times(arrivals, pairs, "eager"))
    work = len(arrivals) * len(pairs) * judge_s
    return max(last + judge_s, first_pair + work / capacity) - first


def ideal_makespan(ready: Sequence[float], judge_s: float, capacity: int,
                   first: float) -> float:
    """The makespan of a perfect work-conserving judge of ``capacity`` slots fed at ``ready``
    (no server, no network): what the schedule itself allows."""
    free = [first] * capacity
    end = first
    for t in sorted(ready):
        start = max(t, heapq.heappop(free))
        heapq.heappush(free, start + judge_s)
        end = max(end, start + judge_s)
    return end - first


def smallest_capacity(arrivals: Sequence[Sequence[float]], pairs: Sequence[tuple[int, int]],
                      judge_s: float, schedule: str, slack: float = 0.1) -> int | None:
    """The smallest capacity with which a perfect judge fed by ``schedule`` finishes the step
    within ``slack`` of its last arrival (both from the first arrival); ``None`` when even an
    unlimited judge cannot (one judge call is longer than the slack)."""
    first = min(min(g) for g in arrivals)
    target = (1.0 + slack) * (max(max(g) for g in arrivals) - first)
    ready = ready_times(arrivals, pairs, schedule)
    lo, hi = 1, max(1, len(ready))
    if ideal_makespan(ready, judge_s, hi, first) > target:
        return None
    while lo < hi:  # more slots never finish later
        mid = (lo + hi) // 2
        if ideal_makespan(ready, judge_s, mid, first) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def mean_demand(params: StepParams) -> float:
    """Judge calls in flight on average if all the step's judge work were spread evenly from
    the first pair ready to the last arrival: the capacity below which the judge, not the
    stragglers, sets the makespan."""
    arrivals = arrival_trace(params)
    pairs = pairs_of(params)
    span = max(max(g) for g in arrivals) - min(ready_times(arrivals, pairs, "eager"))
    work = len(arrivals) * len(pairs) * params.judge_s
    return work / span if span > 0 else math.inf


def default_capacities(params: StepParams) -> tuple[int, ...]:
    """The sweep: half, one and two times the mean demand, then eager's peak demand (what the
    arrivals themselves ask for) and wait_for_all's (its bursts), so capacities below and above
    the step's peak are measured."""
    arrivals = arrival_trace(params)
    pairs = pairs_of(params)
    eager_peak = peak_demand(ready_times(arrivals, pairs, "eager"), params.judge_s)
    wait_peak = peak_demand(ready_times(arrivals, pairs, "wait_for_all"), params.judge_s)
    mean = mean_demand(params)
    grid = {max(1, math.ceil(mean * f)) for f in (0.5, 1.0, 2.0)}
    grid |= {max(1, eager_peak), max(1, wait_peak)}
    return tuple(sorted(grid))


# -- one measured run ----------------------------------------------------------------------------


class _JudgeStats(msgspec.Struct):
    calls: int
    in_flight: int
    busy_s: float = 0.0


_stats_decoder = msgspec.json.Decoder(_JudgeStats)


async def _judge_stats(client: loadgen.H11Client) -> _JudgeStats:
    answer = await client.get("/admin/stats")
    return _stats_decoder.decode(answer.body)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return math.nan


@dataclass
class StepRun:
    """What one schedule did in one step: per-member send/answer times and rewards, the judge
    busy time and in-flight samples, and the server's wasted-comparison count."""

    schedule: str
    cohorts: list[CohortResult]
    busy_s: float
    judge_calls: int
    wasted: float
    samples_t: list[float]
    samples_in_flight: list[float]
    t0: float


async def run_step(server: loadgen.H11Client, judge: loadgen.H11Client, params: StepParams,
                   arrivals: Sequence[Sequence[float]], schedule: str) -> StepRun:
    """Send the step's K groups (member ``i`` of group ``g`` after ``arrivals[g][i]`` s) to
    ``server`` and wait for every answer, sampling the judge's in-flight calls meanwhile.

    Blocks until every member is answered. Cancellation propagates; nothing outlives the call.
    """
    bodies = BodyFactory(seed=11, run_tag=f"step{params.seed}")
    # One group sent at once first, unmeasured: connections to the judge are open after it.
    await loadgen.run_cohort(server, BodyFactory(seed=12, run_tag="warm"),
                             CohortSpec(10**6, params.n))
    before = await _judge_stats(judge)
    wasted_before = _metric((await server.get("/metrics")).body.decode(),
                            "genrm_comparisons_wasted_total")
    results: list[CohortResult] = []
    samples_t: list[float] = []
    samples_n: list[float] = []
    t0 = time.perf_counter()

    async def sampler() -> None:
        while True:
            stats = await _judge_stats(judge)
            samples_t.append(time.perf_counter() - t0)
            samples_n.append(float(stats.in_flight))
            await trio.sleep(SAMPLE_INTERVAL_S)

    async def group(g: int) -> None:
        spec = CohortSpec(g, params.n, tuple(arrivals[g]))
        results.append(await loadgen.run_cohort(server, bodies, spec))

    async with trio.open_nursery() as outer:
        outer.start_soon(sampler)
        async with trio.open_nursery() as groups:
            for g in range(params.k):
                groups.start_soon(group, g)
        outer.cancel_scope.cancel()
    after = await _judge_stats(judge)
    wasted_after = _metric((await server.get("/metrics")).body.decode(),
                           "genrm_comparisons_wasted_total")
    results.sort(key=lambda c: c.cohort)
    return StepRun(schedule, results, after.busy_s - before.busy_s, after.calls - before.calls,
                   wasted_after - wasted_before, samples_t, samples_n, t0)


def step_metrics(run: StepRun, params: StepParams, capacity: int) -> dict[str, float]:
    """The numbers of one run, all times in seconds from the run's first request."""
    sends = [[m.sent_at for m in c.members] for c in run.cohorts]
    first = min(min(s) for s in sends)
    last_done = max(m.done_at for c in run.cohorts for m in c.members)
    makespan = last_done - first
    arrivals = [[t - first for t in s] for s in sends]
    pairs = pairs_of(params)
    bound = lower_bound(arrivals, pairs, params.judge_s, capacity)
    group_lat = [max(m.done_at for m in c.members) - max(m.sent_at for m in c.members)
                 for c in run.cohorts]
    failed = sum(1 for c in run.cohorts if not c.ok)
    return {
        "makespan_s": makespan,
        "last_arrival_s": max(max(a) for a in arrivals),
        "lower_bound_s": bound,
        "over_bound": makespan / bound if bound > 0 else math.nan,
        "ideal_s": ideal_makespan(
            ready_times(arrivals, pairs, run.schedule), params.judge_s, capacity, 0.0),
        "group_p50_s": percentile(group_lat, 0.5),
        "group_p99_s": percentile(group_lat, 0.99),
        "utilisation": run.busy_s / (capacity * makespan) if makespan > 0 else math.nan,
        "judge_calls": float(run.judge_calls),
        "wasted": run.wasted,
        "failed_groups": float(failed),
    }


def rewards_of(run: StepRun) -> dict[tuple[int, int], float | None]:
    return {(c.cohort, m.index): m.reward for c in run.cohorts for m in c.members}


def run_key(schedule: str, order: str | None) -> str:
    return schedule if not order else f"{schedule}/{order}"


def judge_sets(params: StepParams, schedule: str, capacity: int,
               order: str | None) -> tuple[tuple[str, str], ...]:
    """The server's ``--set`` values for one run."""
    sets = [
        ("judge_schedule", schedule),
        ("comparison_strategy", params.strategy),
        ("judge_max_concurrency", str(capacity)),
    ]
    if order:
        sets.append(("judge_order", order))
    return tuple(sets)


def summary_rows(results: Sequence[Any]) -> list[dict[str, Any]]:
    """Per capacity and run key, the median metrics (``CaseResult``s of the step preset)."""
    rows: list[dict[str, Any]] = []
    for r in results:
        med: Mapping[str, float] = r.median.get("ours", {})
        for key in r.params["runs"]:
            rows.append({
                "capacity": int(r.params["capacity"]),
                "run": key,
                **{name.removeprefix(key + ":"): v for name, v in med.items()
                   if name.startswith(key + ":")},
            })
    return rows


def render_sweep(results: Sequence[Any]) -> str:
    """The sweep as markdown: makespan against capacity beside the lower bound, per run, and
    the smallest capacity that finishes within 10% of the last arrival."""
    step = [r for r in results if r.preset == "step"]
    if not step:
        return ""
    rows = summary_rows(step)
    lines = [
        "### step: makespan against judge capacity",
        "",
        f"{step[0].params['label']}; eager peak demand {step[0].params['eager_peak']}, "
        f"wait_for_all peak demand {step[0].params['wait_peak']} calls in flight",
        "",
        "| capacity | run | makespan s | lower bound s | / bound | ideal s | last arrival s "
        "| group p50 s | group p99 s | utilisation | wasted | rewards = wait_for_all |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(x: Any, digits: int = 3) -> str:
        return f"{x:.{digits}f}" if isinstance(x, float) and math.isfinite(x) else "-"

    for row in rows:
        same = row.get("rewards_equal")
        lines.append(
            f"| {row['capacity']} | {row['run']} | {f(row.get('makespan_s'))} "
            f"| {f(row.get('lower_bound_s'))} | {f(row.get('over_bound'))} "
            f"| {f(row.get('ideal_s'))} | {f(row.get('last_arrival_s'))} "
            f"| {f(row.get('group_p50_s'))} | {f(row.get('group_p99_s'))} "
            f"| {f(row.get('utilisation'), 2)} | {f(row.get('wasted'), 0)} "
            f"| {'-' if same is None else ('yes' if same == 1.0 else 'NO')} |")
    lines.append("")
    known = {f.name for f in fields(StepParams)} - {"capacities", "orders"}
    params = StepParams(**{k: v for k, v in step[0].params.items() if k in known})
    arrivals = arrival_trace(params)
    for key in dict.fromkeys(row["run"] for row in rows):
        fits = sorted(row["capacity"] for row in rows if row["run"] == key
                      and row.get("makespan_s", math.inf) <= 1.1 * row.get("last_arrival_s", 0))
        model = smallest_capacity(arrivals, pairs_of(params), params.judge_s,
                                  key.split("/", 1)[0])
        lines.append(f"- {key}: smallest judge capacity finishing within 10% of the last "
                     f"arrival: {fits[0] if fits else 'none in the sweep'} measured; "
                     f"{model if model is not None else 'none'} for a perfect judge on this "
                     "trace")
    return "\n".join(lines) + "\n"


def step_cases(params: StepParams) -> list[Case]:
    """The ``step`` preset: one case per judge capacity of the sweep. Each run measures every
    schedule (and judge order) on the same arrival trace, one after the other, each in fresh
    processes, and compares their rewards member by member (see :mod:`genrm_trio.bench.cases.step`).
    Our server only: NeMo Gym has no eager schedule."""
    arrivals = arrival_trace(params)
    pairs = pairs_of(params)
    eager_peak = peak_demand(ready_times(arrivals, pairs, "eager"), params.judge_s)
    wait_peak = peak_demand(ready_times(arrivals, pairs, "wait_for_all"),
                                 params.judge_s)
    capacities = params.capacities or default_capacities(params)
    orders: tuple[str | None, ...] = params.orders or (None,)
    runs = [(schedule, order) for schedule in SCHEDULES for order in orders]
    keys = [run_key(schedule, order) for schedule, order in runs]

    def make(capacity: int) -> Case:
        async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
            metrics: dict[str, float] = {}
            samples: dict[str, list[float]] = {}
            rewards: dict[str, dict[tuple[int, int], float | None]] = {}
            for (schedule, order), key in zip(runs, keys, strict=True):
                judge = JudgeSettings(latency_ms=params.judge_ms, capacity=capacity)
                server = ServerSettings(
                    n=params.n, collection_timeout_s=params.collection_timeout_s,
                    ours_extra=judge_sets(params, schedule, capacity, order))
                label = f"{tag}-{key.replace('/', '-')}"
                async with _rig(ctx, kind, judge, server, label) as rig:
                    done = await run_step(rig.client, rig.judge_client, params, arrivals,
                                               schedule)
                for name, value in step_metrics(done, params, capacity).items():
                    metrics[f"{key}:{name}"] = value
                rewards[key] = rewards_of(done)
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
