"""The preset table: preset name -> its cases, and the metrics its table shows.

To add a preset: write its case builder in :mod:`genrm_trio.bench.cases` (one module per
family), add it to :data:`PRESETS` and its metrics to :data:`SHOWN`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from genrm_trio.bench.cases import step
from genrm_trio.bench.cases.admission import admission_case
from genrm_trio.bench.cases.economy import economy_cases
from genrm_trio.bench.cases.flood import flood_case
from genrm_trio.bench.cases.hostile_body import hostile_body_cases
from genrm_trio.bench.cases.judge_client import judge_client_case
from genrm_trio.bench.cases.load import load_case, staggered_case
from genrm_trio.bench.cases.release import release_case
from genrm_trio.bench.cases.rolling import rolling_case
from genrm_trio.bench.cases.scaleout import scaleout_case
from genrm_trio.bench.cases.slow_disk import slow_disk_cases
from genrm_trio.bench.cases.slow_readers import slow_readers_cases
from genrm_trio.bench.cases.soak import soak_case
from genrm_trio.bench.cases.steady_state import steady_state_case
from genrm_trio.bench.cases.step import step_cases
from genrm_trio.bench.cases.tracing import tracing_case
from genrm_trio.bench.records import Case


def soak_preset(**overrides: Any) -> Case:
    """The soak preset's one case; ``overrides`` are :func:`soak_case` keyword arguments
    (``genrm-trio bench --soak KEY=VALUE``)."""
    return soak_case(**overrides)


def _flood_cases() -> list[Case]:
    return [
        flood_case("auto-2GiB"),
        flood_case("auto-2GiB-deep-queue", sends_in_flight=128),  # about 1,100 queued
        flood_case("auto-2GiB-emoji", extra_char="\U0001F600"),
        flood_case("unlimited", max_active_bytes="null", rss_stop_bytes=3 * 2**30),
    ]


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
    "soak": lambda: [soak_preset()],
    "flood": _flood_cases,
    "economy": economy_cases,
    "tracing": lambda: [tracing_case()],
    "slow_disk": slow_disk_cases,
    "hostile_body": hostile_body_cases,
    "slow_readers": slow_readers_cases,
    "rolling": lambda: [rolling_case()],
})


"""Preset name -> its cases. ``all`` runs every preset but ``smoke``, ``soak``, ``flood``
(which fills the server's memory budget on purpose), ``tracing`` (which needs the ``[otel]``
extra), ``slow_disk`` (which needs ``cc`` for its LD_PRELOAD shim), ``hostile_body`` (which
sends 15 MB every second on purpose), ``slow_readers`` (which holds 800 MB of answers on
purpose) and ``rolling`` (a gate, like the soak: restarts its replicas under load), in order."""


NOT_IN_ALL = frozenset({"smoke", "soak", "flood", "tracing", "slow_disk", "hostile_body",
                        "slow_readers", "rolling"})


SHOWN: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "economy": tuple(
        f"{routing}:{name}" for name in ("makespan_s", "group_p50_s", "group_p99_s",
                                         "judge_calls", "computed_tokens", "over_minimum",
                                         "cached_fraction", "judge_busy_s",
                                         "load_max_over_mean")
        for routing in ("least_loaded", "cohort_affinity")
    ) + tuple(
        f"cohort_affinity:replace{k}:{name}" for k in (0, 1, 2)
        for name in ("judge_calls", "touching_calls", "computed_tokens", "minimum_tokens")
    ) + ("computed_ratio", "makespan_ratio", "rewards_equal",
         "cohort_affinity:replacements_equal_fresh", "least_loaded:replacements_equal_fresh"),
    "tracing": (
        "verifies_per_s_off",
        "verifies_per_s_on_1.0",
        "verifies_per_s_on_0.1",
        "verifies_per_s_off_no_otel",
        "ratio_on_1.0",
        "ratio_on_0.1",
        "ratio_off_over_no_otel",
        "cpu_ms_per_cohort_off",
        "cpu_ms_per_cohort_on_1.0",
        "cpu_ms_per_cohort_on_0.1",
        "cpu_ms_per_cohort_off_no_otel",
        "export_process_cpu_ms_per_cohort_on_1.0",
        "export_process_cpu_ms_per_cohort_on_0.1",
    ),
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
    "rolling": ("members_sent", "rewarded", "masked", "failed", "judged_twice", "judge_calls",
                "restarts", "clean_exits", "replays_sent", "replays_answered",
                "open_cohorts_at_drain_max", "refused_425_draining", "refused_425_rejoining",
                "drain_max_s", "exit_max_s",
                "drains_within_deadline", "restart_ready_max_s"),
    "slow_disk": ("rewarded", "cohorts", "rewarded_per_s", "cohort_p50_ms", "cohort_p99_ms",
                  "cohort_max_ms", "probe_p50_ms", "probe_p99_ms", "probe_max_ms",
                  "journal_commits", "journal_degraded"),
    "hostile_body": ("body_mb", "body_values", "hostile_413", "hostile_200", "hostile_timeouts",
                     "probe_p50_ms", "probe_p99_ms", "probe_max_ms", "rewarded", "cohorts",
                     "rewarded_within_1s", "cohort_p50_ms", "cohort_max_ms", "server_cpu_pct"),
    "slow_readers": ("budget_mb", "baseline_rss_mb", "peak_rss_mb", "end_rss_mb",
                     "peak_over_budget_mb", "unsent_peak_mb", "bodies_peak_mb",
                     "malloc_in_use_peak_mb", "send_timeouts", "ended_429",
                     "ended_reset", "ended_unfinished", "probe_p50_ms", "probe_p99_ms",
                     "probe_max_ms"),
    "staggered": ("makespan_s", "latency_p50_ms", "latency_p99_ms", "cpu_ms_per_cohort"),
    "flood": (
        "verifies_per_s",
        "refused_429",
        "budget_mb",
        "peak_rss_mb",
        "accept_queue_max",
        "main_healthz_p50_ms",
        "main_healthz_p99_ms",
        "main_readyz_p99_ms",
        "probe_healthz_p50_ms",
        "probe_healthz_p99_ms",
        "probe_healthz_max_ms",
        "probe_readyz_p99_ms",
        "probe_readyz_max_ms",
        "server_cpu_pct",
        "loadgen_cpu_pct",
    ),
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
