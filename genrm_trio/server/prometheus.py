"""``GET /metrics``: the Prometheus exposition, built with ``prometheus_client``.

The only module that imports ``prometheus_client``. :class:`ServerMetrics` owns its own
``CollectorRegistry`` (never the library's process-global one, so two servers in one process,
as in the tests, never share a series). Two kinds of metric live in it:

- **Histograms** fed by hooks as things happen: ``/verify`` latency (the app), cohort collection
  and evaluation time (the cohort registry calls :meth:`ServerMetrics.cohort_done`), judge call
  latency per endpoint (the judge calls :meth:`ServerMetrics.judge_call`), and the 401 counter.
- **Read at scrape time** (:class:`_SnapshotCollector`): the registry's gauges and counters and
  the judge's stats and endpoint table, so the code that owns those numbers keeps plain ints and
  needs no knowledge of Prometheus.

Names: counters end in ``_total``, durations are ``*_seconds``; values are written by the library
(full precision, no ``%g``). Label values are bounded: outcomes and failure kinds come from fixed
sets, judge endpoints from the configuration (``judge.base_urls``, shown without credentials),
attempt-failure reasons from a fixed set plus ``http_<status>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from genrm_trio.server.cohort import CohortRegistry
    from genrm_trio.server.judge import Judge
    from genrm_trio.server.tracing import Tracer

# Members of a cohort: every small size, then powers of two (num_rollouts_per_prompt is
# usually 4..64).
MEMBERS_BUCKETS: tuple[float, ...] = (
    2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0, 256.0,
    float("inf"),
)

# From a loopback millisecond to past the 1800 s default deadlines.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, float("inf"),
)


class ServerMetrics:
    """One server's metrics. Created by ``serve`` before the judge and the registry (they get
    its hooks), then pointed at them with :meth:`read_from`. Hooks are plain synchronous calls,
    cheap enough for the ``/verify`` hot path; nothing here blocks or starts a task."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._verify = Histogram(
            "genrm_verify_duration_seconds",
            "Time from a /verify request's start to its answer, by outcome (rewarded, masked, "
            "a failure kind, or disconnected).",
            ["outcome"], registry=self.registry, buckets=DURATION_BUCKETS_S)
        self._collection = Histogram(
            "genrm_cohort_collection_seconds",
            "Time from a cohort's first member to its last (outcome complete), to the deadline "
            "that judged it over the members present (partial), or to its failure while "
            "collecting (outcome: the failure kind).",
            ["outcome"], registry=self.registry, buckets=DURATION_BUCKETS_S)
        self._evaluation = Histogram(
            "genrm_cohort_evaluation_seconds",
            "Time from a full (or partial) cohort to its outcome (completed, partial, or the "
            "failure kind).",
            ["outcome"], registry=self.registry, buckets=DURATION_BUCKETS_S)
        self._members_scored = Histogram(
            "genrm_cohort_members_scored",
            "Members judged per published cohort: N for a full one, fewer for a partial one "
            "(incomplete_cohort_policy: judge_present; counted in genrm_cohorts_partial_total).",
            registry=self.registry, buckets=MEMBERS_BUCKETS)
        self._judge_call = Histogram(
            "genrm_judge_call_duration_seconds",
            "One judge attempt (HTTP request, plugin or built-in call), by endpoint and result "
            "(ok or error).",
            ["endpoint", "result"], registry=self.registry, buckets=DURATION_BUCKETS_S)
        self._unauthorized = Counter(
            "genrm_http_unauthorized", "Requests refused with 401 unauthorized.",
            registry=self.registry)
        self._snapshot = _SnapshotCollector()
        self.registry.register(self._snapshot)
        # Labelled children, looked up once: ``labels()`` takes a lock and builds a tuple, half
        # the cost of an observation on the /verify hot path. Keys are the bounded label sets.
        self._verify_children: dict[str, Any] = {}
        self._collection_children: dict[str, Any] = {}
        self._evaluation_children: dict[str, Any] = {}
        self._judge_children: dict[tuple[str, bool], Any] = {}

    def read_from(self, registry: CohortRegistry, judge: Judge,
                  tracer: Tracer | None = None) -> None:
        """Read ``registry``, ``judge`` and, with tracing on, ``tracer`` at every scrape from
        now on (they outlive this)."""
        self._snapshot.registry = registry
        self._snapshot.judge = judge
        self._snapshot.tracer = tracer

    # ---------------------------------------------------------------- hooks

    def observe_verify(self, outcome: str, seconds: float) -> None:
        _child(self._verify, self._verify_children, outcome).observe(seconds)

    def cohort_done(self, kind: str, collection_s: float, evaluation_s: float | None,
                    partial: bool = False) -> None:
        """A cohort reached its disposition ``kind`` (``completed``, ``partial`` or a failure
        kind). ``evaluation_s`` is None when it never left collecting; ``partial``: its
        collection ended at the deadline, judged over the members present."""
        if partial:
            outcome = "partial"
        else:
            outcome = "complete" if evaluation_s is not None else kind
        _child(self._collection, self._collection_children, outcome).observe(collection_s)
        if evaluation_s is not None:
            _child(self._evaluation, self._evaluation_children, kind).observe(evaluation_s)

    def cohort_scored(self, expected: int, scored: int) -> None:
        """A cohort was published with ``scored`` of its ``expected`` members rewarded."""
        self._members_scored.observe(scored)

    def judge_call(self, endpoint: str, ok: bool, seconds: float) -> None:
        child = self._judge_children.get((endpoint, ok))
        if child is None:
            child = self._judge_children[(endpoint, ok)] = self._judge_call.labels(
                endpoint, "ok" if ok else "error")
        child.observe(seconds)

    def unauthorized(self) -> None:
        self._unauthorized.inc()

    def series(self) -> int:
        """Labelled children held by the histograms (``/status``): bounded, as every label
        value comes from a fixed set or the configuration."""
        return (len(self._verify_children) + len(self._collection_children)
                + len(self._evaluation_children) + len(self._judge_children))

    # ---------------------------------------------------------------- exposition

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _child(histogram: Histogram, children: dict[str, Any], label: str) -> Any:
    child = children.get(label)
    if child is None:
        child = children[label] = histogram.labels(label)
    return child


class _SnapshotCollector(Collector):
    """Builds families from the registry's and the judge's own counters at scrape time."""

    def __init__(self) -> None:
        self.registry: CohortRegistry | None = None
        self.judge: Judge | None = None
        self.tracer: Tracer | None = None

    def describe(self) -> list[Metric]:
        return []  # families depend on what the sources hold; no up-front description

    def collect(self) -> Iterator[Metric]:
        if self.registry is not None:
            yield from _registry_families(self.registry)
        if self.judge is not None:
            yield from _judge_families(self.judge)
        if self.tracer is not None and self.tracer.enabled:
            yield CounterMetricFamily(
                "genrm_trace_export_failures",
                "Spans whose export to the OTLP collector failed (unreachable or refusing).",
                value=self.tracer.export_failures)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _registry_families(registry: CohortRegistry) -> Iterator[Metric]:
    snap = registry.snapshot()
    active = GaugeMetricFamily("genrm_active_cohorts", "Active cohorts by phase.",
                               labels=["phase"])
    active.add_metric(["collecting"], snap["collecting"])
    active.add_metric(["evaluating"], snap["evaluating"])
    yield active
    yield _gauge("genrm_waiters", "Requests waiting on a cohort outcome.", snap["waiters"])
    yield _gauge("genrm_retained_records", "Terminal cohort records retained.",
                 snap["retained_records"])
    yield _gauge("genrm_watermarks", "Group attempt watermarks retained.", snap["watermarks"])
    yield _gauge("genrm_active_bytes", "Request bytes held by active cohorts.",
                 snap["active_bytes"])
    yield _gauge("genrm_unsent_answer_bytes", "Answer bytes not yet taken by their clients "
                 "(counted in max_active_bytes).", snap["unsent_answer_bytes"])
    yield _gauge("genrm_body_bytes", "max_active_bytes reserved for /verify bodies being read "
                 "and processed.", snap["body_bytes"])
    yield _gauge("genrm_bodies_waiting", "/verify bodies over 1 MiB waiting, unread, for room "
                 "in max_active_bytes.", snap["bodies_waiting"])
    yield CounterMetricFamily("genrm_body_refusals", "/verify bodies refused with 429 before "
                              "they were read: their reservation would pass max_active_bytes.",
                              value=snap["body_refusals"])
    yield CounterMetricFamily("genrm_send_timeouts", "Connections reset because their client "
                              "took none of an answer for send_timeout_s.",
                              value=snap["send_timeouts"])
    yield _gauge("genrm_shutting_down", "1 once shutdown has begun.",
                 1.0 if registry.shutting_down else 0.0)
    yield _gauge("genrm_draining", "1 while draining: new cohorts refused with 425, the open "
                 "ones finishing (README \"Rolling restart\").",
                 1.0 if registry.draining else 0.0)
    yield CounterMetricFamily("genrm_drain_refused", "Requests refused with 425 draining "
                              "(they would have opened a new cohort), draining or rejoining.",
                              value=registry.counters["drain_refused"])
    yield _gauge("genrm_rejoining_seconds", "Seconds left of the rejoin window after a "
                 "restart (rejoin_s): no cohort opens here meanwhile.", registry.rejoining_s)
    yield _gauge("genrm_groups_elsewhere", "Groups refused while rejoining, remembered as open "
                 "on another replica.", float(registry.groups_elsewhere))
    counters = registry.counters
    yield CounterMetricFamily("genrm_cohorts_opened", "Cohorts opened.",
                              value=counters["cohorts_opened"])
    yield CounterMetricFamily("genrm_cohorts_completed", "Cohorts completed (partial ones "
                              "included).", value=counters["cohorts_completed"])
    yield CounterMetricFamily(
        "genrm_cohorts_partial", "Cohorts judged over the members present at the collection "
        "deadline (incomplete_cohort_policy: judge_present).", value=counters["cohorts_partial"])
    failed = CounterMetricFamily("genrm_cohorts_failed", "Cohorts failed, by kind.",
                                 labels=["kind"])
    answers = CounterMetricFamily("genrm_verify_answers", "/verify answers from the registry, "
                                  "by outcome.", labels=["outcome"])
    for name, value in sorted(counters.items()):
        if name.startswith("cohorts_failed_"):
            failed.add_metric([name.removeprefix("cohorts_failed_")], value)
        elif name.startswith("verify_"):
            answers.add_metric([name.removeprefix("verify_")], value)
    yield failed
    yield answers
    yield CounterMetricFamily(
        "genrm_comparisons_started",
        "Pair comparisons started by cohorts (each one judge_pair, retries included).",
        value=counters["comparisons_started"])
    yield CounterMetricFamily(
        "genrm_comparisons_wasted",
        "Comparisons started by cohorts that then failed, or dropped when a partial cohort's "
        "comparisons were planned again (their verdicts discarded).",
        value=counters["comparisons_wasted"])
    yield CounterMetricFamily(
        "genrm_comparisons_judged",
        "Comparisons of cohorts whose verdict came from the judge (parsed or defaulted).",
        value=counters["comparisons_judged"])
    yield CounterMetricFamily(
        "genrm_comparisons_reused",
        "Comparisons of cohorts scored with a kept verdict instead of a judge call "
        "(verdict_reuse).", value=counters["comparisons_reused"])
    verdicts = registry.verdict_status()
    yield _gauge("genrm_verdict_cache_entries", "Verdicts kept for reuse.", verdicts["entries"])
    yield _gauge("genrm_verdict_cache_capacity",
                 "verdict_cache_max_entries (0 with verdict_reuse: off).", verdicts["cap"])
    journal = registry.journal
    if journal is not None:
        state = journal.status()
        yield _gauge("genrm_journal_degraded",
                     "1 once a state journal write failed (memory stays the truth).",
                     float(state["degraded"]))
        yield CounterMetricFamily("genrm_journal_write_failures", "State journal writes that "
                                  "failed.", value=state["failed_writes"])


def _judge_families(judge: Judge) -> Iterator[Metric]:
    fields: dict[str, Any] = dataclasses.asdict(judge.stats)
    for name, value in sorted(fields.items()):
        if isinstance(value, Mapping):
            # failures_by_reason counts failed attempts, not comparisons: say so in the name.
            base = "attempt_failures" if name == "failures_by_reason" else name.removesuffix(
                "_by_reason")
            family = CounterMetricFamily(
                f"genrm_judge_{base}",
                f"Judge {name.replace('_', ' ')}.", labels=["reason"])
            for reason, count in sorted(value.items()):
                family.add_metric([str(reason)[:64]], float(count))
            yield family
        elif isinstance(value, int | float) and not isinstance(value, bool):
            base = name.removesuffix("_sum")
            if name.endswith("in_flight"):
                yield _gauge(f"genrm_judge_{name}", f"Judge {name.replace('_', ' ')}.", value)
            else:
                yield CounterMetricFamily(f"genrm_judge_{base}",
                                          f"Judge {base.replace('_', ' ')} (monotonic).",
                                          value=float(value))
    status = judge.status()
    limiter = status.get("limiter") or {}
    yield _gauge("genrm_judge_limiter_in_use", "Judge calls holding a judge_max_concurrency "
                 "token.", float(limiter.get("in_use", 0)))
    yield _gauge("genrm_judge_limiter_capacity", "judge_max_concurrency.",
                 float(limiter.get("total", 0)))
    in_flight = GaugeMetricFamily("genrm_judge_endpoint_in_flight",
                                  "Judge calls in flight, by endpoint.", labels=["endpoint"])
    consecutive = GaugeMetricFamily("genrm_judge_endpoint_consecutive_failures",
                                    "Consecutive failed calls, by endpoint.", labels=["endpoint"])
    cooling = GaugeMetricFamily("genrm_judge_endpoint_cooling",
                                "1 while the endpoint is skipped for its cool-down.",
                                labels=["endpoint"])
    failures = CounterMetricFamily("genrm_judge_endpoint_failures",
                                   "Failed calls, by endpoint.", labels=["endpoint"])
    waiting = GaugeMetricFamily("genrm_judge_endpoint_waiting",
                                "Judge calls waiting for a judge.max_concurrency_per_endpoint "
                                "slot, by endpoint.", labels=["endpoint"])
    input_tokens = CounterMetricFamily("genrm_judge_endpoint_input_tokens",
                                       "Input (prompt) tokens the judge reported, by endpoint.",
                                       labels=["endpoint"])
    output_tokens = CounterMetricFamily("genrm_judge_endpoint_output_tokens",
                                        "Output (completion) tokens the judge reported, by "
                                        "endpoint.", labels=["endpoint"])
    cached_tokens = CounterMetricFamily("genrm_judge_endpoint_cached_tokens",
                                        "Prompt tokens the judge reported found in its prefix "
                                        "cache (cached_tokens, llama.cpp cache_n), by endpoint.",
                                        labels=["endpoint"])
    for endpoint in status.get("endpoints") or []:
        label = [str(endpoint.get("url", "?"))]
        in_flight.add_metric(label, float(endpoint.get("in_flight", 0)))
        consecutive.add_metric(label, float(endpoint.get("consecutive_failures", 0)))
        cooling.add_metric(label, 1.0 if endpoint.get("cooling_down") else 0.0)
        failures.add_metric(label, float(endpoint.get("failures", 0)))
        waiting.add_metric(label, float(endpoint.get("waiting", 0)))
        input_tokens.add_metric(label, float(endpoint.get("input_tokens", 0)))
        output_tokens.add_metric(label, float(endpoint.get("output_tokens", 0)))
        cached_tokens.add_metric(label, float(endpoint.get("cached_tokens", 0)))
    yield in_flight
    yield consecutive
    yield cooling
    yield failures
    yield waiting
    yield input_tokens
    yield output_tokens
    yield cached_tokens


__all__ = ["DURATION_BUCKETS_S", "ServerMetrics"]
