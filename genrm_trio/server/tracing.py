"""Cohort-level traces with OpenTelemetry (issue 20): the only module of the server process
that imports it. Its other half, server/trace_export.py, is the span export process (a child
of the server, the one other place ``opentelemetry`` is imported, and the only one that builds
the OTLP exporter).

Off by default, and then free: :data:`NO_TRACER` and the span objects it hands out are
stateless no-ops shared by every request (no allocation, no import of ``opentelemetry``). With
``tracing.enabled`` (and the ``[otel]`` extra), :func:`open_tracer` builds :class:`_OtelTracer`
and the rest of the server talks to it through the same small interface:

- the app: one SERVER span per HTTP request (:meth:`Tracer.request`), continuing the caller's
  ``traceparent``; ``/verify`` adds the member's coordinates and its outcome;
- the cohort registry: one ``genrm.cohort`` span per cohort (:meth:`Tracer.cohort`), the root of
  a trace of its own, linked to each member's span as it joins (the member's span carries the
  cohort's trace id and a link back), with events for collected, evaluation started, published
  or failed; the registry's shutdown is one short span with its counts (no span per waiter);
- the judge: one CLIENT span per comparison (:meth:`JudgeParent.judge_call`), started from its
  cohort's span (or the ``/compare`` request's) explicitly, never from the ambient context
  (trio copies the spawning request's context into the cohort's tasks); a retried call has an
  event per attempt and backoff (one attempt: the span's own attributes say it all), the GenAI
  attributes are set when it ends, and its ``traceparent`` goes into the judge's HTTP request.

Cost (issue 20's goal: 0.85x of off at sample ratio 1.0, 0.97x at 0.1): the sampler decides
first, so an unsampled request or cohort builds nothing; a recorded span is a plain record
(:class:`_OtelSpan`), without the SDK span's per-attribute checks and locks, and when it ends
it becomes one tuple of ints, strings and the attribute dict (no SDK object) queued in the
SDK's batch processor. Its export thread encodes each batch with msgspec (in C) and writes it
to the export process, which rebuilds the SDK's spans and does the OTLP encoding and the
HTTP export there, off this process's GIL. What the encoding costs grows with the number of
spans, events, links and attributes (so nothing is exported twice).

No prompt or answer text, no judge error text and no secret goes into any attribute: only ids,
coordinates, counts, labels from fixed sets, and the judge's model name and finish reasons.

Export: the SDK's batch processor exports from its own thread, through the export process
(its queue bound, drops and batching are the SDK's, ``OTEL_BSP_*``); :func:`close_tracer`
flushes and shuts it down through ``trio.to_thread`` under a bound, within which the export
process is closed, killed if late, and reaped. A failed export (the collector unreachable or
refusing, or the export process lost) costs a counter (``genrm_trace_export_failures_total``)
and one rate-limited log line; the OTLP exporter's own per-failure lines are dropped in the
export process. A lost export process is replaced (server/trace_export.py says when).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import trio

from genrm_trio.config import Config
from genrm_trio.errors import ConfigError, ExportStartError
from genrm_trio.logs import RateLimitedNote

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanContext, SpanKind

    from genrm_trio.server.trace_export import ExportProcess
    from genrm_trio.wire import VerifyMember

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e '.[otel]'"
SERVICE_NAME = "genrm-trio"
SCOPE_NAME = "genrm_trio"
#: How long closing the tracer (flushing what is queued) may take at exit, at most.
FLUSH_BOUND_S = 2.0
#: Of a close's bound, this much (at most a quarter) is kept for killing and reaping a late
#: export process.
KILL_MARGIN_S = 0.1
#: At most one log line per this many seconds about failed exports.
EXPORT_NOTE_INTERVAL_S = 60.0
#: Requests to these paths get no span (probes and scrapes: noise, and they come often).
UNTRACED_PATHS = frozenset({"/", "/health", "/healthz", "/livez", "/readyz", "/metrics"})
#: Caller-supplied ids in attributes are cut to this many characters.
MAX_ID_CHARS = 256
_EMPTY: tuple[tuple[str, str], ...] = ()
_LOW64 = 2**64 - 1
_NO_ATTRIBUTES: Mapping[str, Any] = MappingProxyType({})


# --------------------------------------------------------------------------- the interface


class JudgeSpan:
    """One judge comparison's span (no-op base). Owned by the judge's retry loop, which ends
    it. ``recording`` says whether anything is kept (callers may skip work when not)."""

    __slots__ = ()
    recording = False

    def headers(self) -> Sequence[tuple[str, str]]:
        """Headers for the judge's HTTP request: ``traceparent`` (and ``tracestate``)."""
        return _EMPTY

    def endpoint(self, display: str) -> None:
        """The endpoint the next attempt goes to (its display URL, no user info)."""

    def answer(self, body: Any) -> None:
        """One decoded judge answer: its model, finish reason and cached tokens."""

    def attempt(self, number: int, reason: str | None, seconds: float) -> None:
        """Attempt ``number`` (0-based) ended: ``reason`` None for an answer, else the label of
        its failure (``http_503``, ``transport``, ``timeout``, ``truncated``, ``parse``...)."""

    def backoff(self, number: int, seconds: float) -> None:
        """Sleeping ``seconds`` before attempt ``number``."""

    def end(self, outcome: str, error_type: str | None, input_tokens: int,
            output_tokens: int) -> None:
        """``outcome``: ``verdict``, ``default``, ``failed`` or ``cancelled``."""


class JudgeParent:
    """What a judge call's span is started from: a cohort's span, or a ``/compare`` request's
    (no-op base)."""

    __slots__ = ()

    def judge_call(self, judge_idx: int) -> JudgeSpan:
        return NO_JUDGE_SPAN


class RequestSpan(JudgeParent):
    """One HTTP request's SERVER span (no-op base). Owned by the app's request handler."""

    __slots__ = ()
    recording = False

    def member(self, member: VerifyMember) -> None:
        """The ``/verify`` member's coordinates."""

    def outcome(self, label: str, masked: bool = False, detail: str | None = None) -> None:
        """How the request ended: ``rewarded``, ``masked`` or a failure kind (``detail`` is
        used only for an admission refusal's event, whose text is the server's own)."""

    def end(self, status: int | None) -> None:
        """The answer's HTTP status (None: the client left unanswered)."""


class CohortTrace(JudgeParent):
    """One cohort's ``genrm.cohort`` span (no-op base). Owned by the registry, ended at the
    cohort's terminal transition."""

    __slots__ = ()

    def joined(self, request: RequestSpan, slot: int, duplicate: bool) -> None:
        """A member's request joined (a new member, or another waiter on one)."""

    def collected(self) -> None:
        """The last member arrived."""

    def evaluation_started(self, comparisons: int) -> None:
        """The evaluation deadline started; the remaining comparisons are issued."""

    def disposed(self, kind: str, fields: Mapping[str, Any]) -> None:
        """Completed (``kind`` ``completed``, or ``partial``: judged over the members present)
        or failed with ``kind``; ``fields`` are the disposition log line's. Ends the span."""


class Tracer:
    """Hands out spans (no-op base: :data:`NO_TRACER`). Owned by ``serve``."""

    __slots__ = ()
    enabled = False

    def request(self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]],
                rollout_id: str | None) -> RequestSpan:
        return NO_REQUEST_SPAN

    def cohort(self, key: str, group_id: str | None, attempt: int, size: int) -> CohortTrace:
        return NO_COHORT_TRACE

    def shutdown_began(self, active_cohorts: int, waiters: int) -> None:
        """The registry began its shutdown (one event for the process, not one per waiter)."""

    @property
    def export_failures(self) -> int:
        """Spans whose export failed (the collector unreachable or refusing them, or the
        export process lost)."""
        return 0

    @property
    def export_pid(self) -> int | None:
        """The span export process's pid, while one runs."""
        return None

    def close(self, timeout_s: float) -> None:
        """Flush and shut down the exporter within ``timeout_s``. Blocks (a thread's work:
        :func:`close_tracer`)."""


NO_JUDGE_SPAN = JudgeSpan()
NO_REQUEST_SPAN = RequestSpan()
NO_COHORT_TRACE = CohortTrace()
NO_TRACER = Tracer()


def open_tracer(cfg: Config, *, exporter: SpanExporter | None = None,
                synchronous: bool = False) -> Tracer:
    """The tracer ``cfg`` asks for: :data:`NO_TRACER` unless ``tracing.enabled``.

    With tracing on, starts the span export process (server/trace_export.py) and waits
    until it is ready: blocks for as long as the child takes to import the SDK (about half
    a second; at most ``STARTUP_BOUND_S``), so call it from a thread in async code.
    ``exporter`` (tests) replaces the export process with an exporter in this process;
    ``synchronous`` exports each span as it ends (tests) instead of from the batch
    processor's thread. ``OTEL_SDK_DISABLED=true`` in the environment gives
    :data:`NO_TRACER` too (with one warning line). Raises :class:`ConfigError` (key
    ``tracing.enabled``) when the ``[otel]`` extra is not installed or the export process
    cannot start. The caller owns the tracer (and so the export process) and closes it
    (:func:`close_tracer`)."""
    if not cfg.tracing.enabled:
        return NO_TRACER
    check_available(cfg)
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        # The standard switch (the SDK's own TracerProvider would hand out no-op spans).
        logger.warning("tracing: OTEL_SDK_DISABLED=true, so no spans are recorded")
        return NO_TRACER
    return _OtelTracer(cfg, exporter, synchronous)


def check_available(cfg: Config) -> None:
    """Raise :class:`ConfigError` if ``tracing.enabled`` is set without the ``[otel]`` extra.
    The OTLP exporter is only looked for, not imported: the span export process imports it
    (and says so when it cannot, as the tracer opens)."""
    if not cfg.tracing.enabled:
        return
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        found = importlib.util.find_spec(
            "opentelemetry.exporter.otlp.proto.http.trace_exporter") is not None
    except ImportError as exc:
        raise ConfigError(
            "tracing.enabled",
            f"needs the OpenTelemetry extra ({exc.name or 'opentelemetry'} is missing): "
            f"{INSTALL_HINT}") from None
    if not found:
        raise ConfigError(
            "tracing.enabled",
            "needs the OpenTelemetry extra (opentelemetry-exporter-otlp-proto-http is "
            f"missing): {INSTALL_HINT}")


async def close_tracer(tracer: Tracer, bound_s: float = FLUSH_BOUND_S) -> None:
    """Flush and shut ``tracer`` down in a worker thread, waiting at most ``bound_s``
    (shielded: this runs in cleanup). The tracer's own bound is a little shorter, so its
    export process is killed (if late) and reaped within ``bound_s``; should the thread still
    outlast it, it is abandoned (a daemon, it ends with the process). Never raises."""
    if not tracer.enabled:
        return
    inner_s = max(0.0, bound_s - min(KILL_MARGIN_S, bound_s / 4))
    with trio.move_on_after(bound_s, shield=True) as scope:
        try:
            await trio.to_thread.run_sync(tracer.close, inner_s, abandon_on_cancel=True)
        except Exception:  # the exporter's own failure must not fail the shutdown
            logger.exception("tracing: closing the exporter failed")
    if scope.cancelled_caught:
        logger.warning("tracing: flushing spans took over %g s; the rest are dropped", bound_s)


# --------------------------------------------------------------------------- OpenTelemetry


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ID_CHARS else text[:MAX_ID_CHARS]


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53:
        return value
    return None


def _finish_reason(body: Mapping[str, Any]) -> str | None:
    """chat: ``choices[0].finish_reason``; responses: ``status`` (``incomplete`` with its
    reason). Only short labels: a value that is not a short string is dropped."""
    reason: Any = None
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
    if reason is None:
        status = body.get("status")
        details = body.get("incomplete_details")
        if status == "incomplete" and isinstance(details, dict):
            reason = details.get("reason") or status
        else:
            reason = status
    return reason if isinstance(reason, str) and len(reason) <= 64 else None


def _cached_tokens(body: Mapping[str, Any]) -> int | None:
    """Prompt tokens served from the judge's cache, where it reports them: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` (or ``input_tokens_details`` for
    responses), llama.cpp's ``timings.cache_n``."""
    usage = body.get("usage")
    if isinstance(usage, dict):
        for name in ("prompt_tokens_details", "input_tokens_details"):
            details = usage.get(name)
            if isinstance(details, dict):
                found = _count(details.get("cached_tokens"))
                if found is not None:
                    return found
    timings = body.get("timings")
    if isinstance(timings, dict):
        return _count(timings.get("cache_n"))
    return None


#: At most this many links and events per span (the SDK's own default limits): a cohort's
#: links grow with retried requests on its slots, a judge span's events with its retry budget.
MAX_LINKS = 128
MAX_EVENTS = 128


class _OtelSpan:
    """One recording span, kept as plain fields and handed to the batch processor when it
    ends (:meth:`_OtelTracer.finish`): as a row for the export process, or as the SDK's
    ``ReadableSpan`` for an exporter a test put in.

    Why not the SDK's own span: it checks every attribute's type under a lock, on each
    ``set_attribute`` and each event and link, which was most of tracing's CPU in the tracing
    bench. Ours are built here from fixed keys and values already of OTLP's types (caller ids
    clipped to :data:`MAX_ID_CHARS`, links and events bounded), so there is nothing to check;
    events are ``(name, time_ns, attributes)`` and links ``(context, attributes)`` tuples.
    Used from the trio thread only; once ended nothing changes it (the export thread reads
    it), and a late change is ignored."""

    __slots__ = ("_tracer", "_name", "_context", "_parent", "_kind", "_start_ns", "_attributes",
                 "_events", "_links", "_ended")

    def __init__(self, tracer: _OtelTracer, name: str, context: SpanContext,
                 parent: SpanContext | None, kind: SpanKind, attributes: dict[str, Any]) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._start_ns = time.time_ns()
        self._attributes = attributes
        self._events: list[tuple[str, int, dict[str, Any] | None]] = []
        self._links: list[tuple[SpanContext, dict[str, Any] | None]] = []
        self._ended = False

    def _event(self, name: str, attributes: dict[str, Any] | None = None,
               timestamp_ns: int | None = None) -> None:
        if not self._ended and len(self._events) < MAX_EVENTS:
            self._events.append((name, time.time_ns() if timestamp_ns is None else timestamp_ns,
                                 attributes))

    def _link(self, context: SpanContext, attributes: dict[str, Any] | None = None) -> None:
        if not self._ended and len(self._links) < MAX_LINKS:
            self._links.append((context, attributes))

    def _end(self, error: str | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._tracer.finish(self, error)
            # The exported dict is the export thread's now: late writes land in a new one.
            self._attributes = {}


class _OtelJudgeSpan(_OtelSpan, JudgeSpan):
    """A judge comparison's CLIENT span. One attempt (the common case) is told by the span's
    own attributes (``genrm.judge.attempts`` 1, its ``genrm.attempt.duration_s``: the call
    without the wait for a judge slot, and the outcome, ``error.type`` and endpoint); when
    there were more, each attempt and backoff is an event, stamped when it happened."""

    __slots__ = ("_headers", "_finish", "_cached", "_model", "_endpoint", "_attempts",
                 "_last_reason", "_steps")
    recording = True

    def __init__(self, tracer: _OtelTracer, name: str, context: SpanContext,
                 parent: SpanContext, attributes: dict[str, Any],
                 headers: Sequence[tuple[str, str]]) -> None:
        super().__init__(tracer, name, context, parent, tracer.client_kind, attributes)
        self._headers = headers
        self._finish: list[str] = []
        self._cached: int | None = None
        self._model: str | None = None
        self._endpoint: str | None = None
        self._attempts = 0
        self._last_reason: str | None = None
        # (time_ns, event name, attributes): events only if there is a second attempt.
        self._steps: list[tuple[int, str, dict[str, Any]]] = []

    def headers(self) -> Sequence[tuple[str, str]]:
        return self._headers

    def endpoint(self, display: str) -> None:
        self._endpoint = display

    def answer(self, body: Any) -> None:
        if not isinstance(body, dict):
            return
        reason = _finish_reason(body)
        if reason is not None:
            self._finish.append(reason)
        cached = _cached_tokens(body)
        if cached is not None:
            self._cached = (self._cached or 0) + cached
        model = body.get("model")
        if isinstance(model, str) and model:
            self._model = _clip(model)

    def attempt(self, number: int, reason: str | None, seconds: float) -> None:
        self._attempts = number + 1
        attributes: dict[str, Any] = {
            "genrm.attempt": number, "genrm.attempt.duration_s": round(seconds, 6),
            "genrm.attempt.outcome": "answer" if reason is None else reason,
        }
        if reason is not None:
            attributes["error.type"] = reason
            self._last_reason = reason
        if self._endpoint is not None:
            attributes["genrm.judge.endpoint"] = self._endpoint
        if len(self._steps) < MAX_EVENTS:
            self._steps.append((time.time_ns(), "genrm.judge.attempt", attributes))

    def backoff(self, number: int, seconds: float) -> None:
        if len(self._steps) < MAX_EVENTS:
            self._steps.append((time.time_ns(), "genrm.judge.backoff",
                                {"genrm.attempt": number, "genrm.backoff_s": round(seconds, 6)}))

    def end(self, outcome: str, error_type: str | None, input_tokens: int,
            output_tokens: int) -> None:
        attributes = self._attributes
        attributes["genrm.judge.outcome"] = outcome
        attributes["genrm.judge.attempts"] = self._attempts
        attributes["gen_ai.usage.input_tokens"] = input_tokens
        attributes["gen_ai.usage.output_tokens"] = output_tokens
        if self._finish:
            attributes["gen_ai.response.finish_reasons"] = self._finish[-8:]
        if self._cached is not None:
            attributes["gen_ai.usage.cache_read.input_tokens"] = self._cached
        if self._model is not None:
            attributes["gen_ai.response.model"] = self._model
        if self._endpoint is not None:
            attributes["genrm.judge.endpoint"] = self._endpoint
        steps = self._steps
        if self._attempts > 1:
            for timestamp_ns, name, step in steps:
                self._event(name, step, timestamp_ns)
        elif steps:  # one attempt: the span is the attempt (its outcome, error.type, endpoint)
            attributes["genrm.attempt.duration_s"] = steps[0][2]["genrm.attempt.duration_s"]
        error = None
        if outcome == "failed":
            error = error_type or self._last_reason or "judge_failed"
            attributes["error.type"] = error
        self._end(error)


class _OtelParent(_OtelSpan, JudgeParent):
    """A span judge calls are started from (the cohort's or a ``/compare`` request's)."""

    __slots__ = ()

    def judge_call(self, judge_idx: int) -> JudgeSpan:
        return self._tracer.judge_span(self, judge_idx)


class _OtelRequestSpan(_OtelParent, RequestSpan):
    __slots__ = ("_failed",)
    recording = True

    def __init__(self, tracer: _OtelTracer, name: str, context: SpanContext,
                 parent: SpanContext | None, attributes: dict[str, Any]) -> None:
        super().__init__(tracer, name, context, parent, tracer.server_kind, attributes)
        self._failed = False

    def member(self, member: VerifyMember) -> None:
        attributes = self._attributes
        attributes["genrm.group_attempt"] = member.attempt
        if member.group_id is not None:
            attributes["genrm.group_id"] = _clip(member.group_id)
        if member.rollout_index is not None:
            attributes["genrm.rollout_index"] = member.rollout_index

    def outcome(self, label: str, masked: bool = False, detail: str | None = None) -> None:
        attributes = self._attributes
        attributes["genrm.outcome"] = label
        attributes["genrm.mask_sample"] = masked
        if label not in ("rewarded", "masked", "disconnected"):
            attributes["genrm.failure_kind"] = label
        elif masked:
            attributes["genrm.failure_kind"] = "judge_failed"
        if label == "overloaded":
            self._event("genrm.admission.refused",
                        {"genrm.reason": (detail or "overloaded")[:200]})
        self._failed = masked

    def end(self, status: int | None) -> None:
        error = None
        if status is not None:
            self._attributes["http.response.status_code"] = status
            if status >= 500:
                error = str(status)
        if error is None and self._failed:
            error = "masked: judge_failed"
        self._end(error)

    def link_cohort(self, cohort: _OtelSpan) -> None:
        if not self._ended:
            context = cohort._context
            self._attributes["genrm.cohort.trace_id"] = f"{context.trace_id:032x}"
            self._link(context)


class _OtelCohortTrace(_OtelParent, CohortTrace):
    __slots__ = ()

    def joined(self, request: RequestSpan, slot: int, duplicate: bool) -> None:
        if not isinstance(request, _OtelRequestSpan):
            return
        # genrm.duplicate only on a retried request's link (a new member's is the rule).
        self._link(request._context, {"genrm.rollout_index": slot, "genrm.duplicate": True}
                   if duplicate else {"genrm.rollout_index": slot})
        request.link_cohort(self)

    def collected(self) -> None:
        self._event("genrm.cohort.collected")

    def evaluation_started(self, comparisons: int) -> None:
        self._event("genrm.cohort.evaluation_started", {"genrm.comparisons": comparisons})

    def disposed(self, kind: str, fields: Mapping[str, Any]) -> None:
        attributes = self._attributes
        for name in _COHORT_COUNTS:
            value = fields.get(name)
            if value is not None:
                attributes[_COHORT_COUNTS[name]] = value
        attributes["genrm.outcome"] = kind
        if kind in ("completed", "partial"):  # partial: judged over the members present
            self._event("genrm.cohort.published")
            self._end()
        else:
            attributes["genrm.failure_kind"] = kind
            self._event("genrm.cohort.failed", {"genrm.failure_kind": kind})
            self._end(kind)


#: The disposition line's fields a cohort span carries (as ``genrm.<name>``): counts only.
_COHORT_COUNTS = MappingProxyType({name: f"genrm.{name}" for name in (
    "members", "size", "collection_s", "evaluation_s", "judge_calls", "judge_results",
    "reused_comparisons", "defaulted_comparisons", "judge_input_tokens", "judge_output_tokens",
    "judge_cached_tokens", "scored",
)})


class _OtelTracer(Tracer):
    """The OpenTelemetry tracer: the SDK's parent-based ratio sampler, random ids, resource and
    batch processor (no ``TracerProvider``: never the process-global one, and our spans are
    :class:`_OtelSpan`), exporting through the span export process (server/trace_export.py),
    or to the exporter a test put in. The sampling decision comes first: an unsampled request
    or cohort builds nothing and gets the shared no-op."""

    __slots__ = ("_processor", "_sampler", "_ids", "_resource", "_scope", "_propagator",
                 "_empty", "_failures", "_judge_attrs", "_judge_name", "_root_flags",
                 "_random_flag", "_readable", "_event", "_link", "_status_error", "_unset",
                 "_span_context", "client_kind", "server_kind", "_internal_kind",
                 "_current_span", "_sampled", "_trace_flags", "_bound", "_id_mask", "_process")
    enabled = True

    def __init__(self, cfg: Config, exporter: SpanExporter | None, synchronous: bool) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event, ReadableSpan, sampling
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import (
            Link,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            get_current_span,
        )
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({})
        name = resource.attributes.get("service.name")
        if not isinstance(name, str) or name.startswith("unknown_service"):
            # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win; else ours.
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        self._resource = resource
        self._scope = InstrumentationScope(SCOPE_NAME)
        ratio = sampling.TraceIdRatioBased(cfg.tracing.sample_ratio)
        self._sampler = sampling.ParentBased(ratio)
        self._bound = ratio.bound
        self._id_mask = ratio.TRACE_ID_LIMIT
        self._ids = RandomIdGenerator()
        self._sampled = sampling.Decision.RECORD_AND_SAMPLE
        self._trace_flags = TraceFlags
        # W3C trace context level 2's "random trace id" flag, as the SDK sets it (newer APIs).
        self._random_flag = int(getattr(TraceFlags, "RANDOM_TRACE_ID", 0))
        self._root_flags = TraceFlags(TraceFlags.SAMPLED | self._random_flag)
        self._process: ExportProcess | None = None
        if exporter is None:
            self._process = _start_export_process(cfg, resource)
            exporter = _process_exporter(self._process)
        self._failures = _ExportFailures()
        counting = _counting_exporter(exporter, self._failures)
        self._processor = (SimpleSpanProcessor(counting) if synchronous
                           else BatchSpanProcessor(counting))
        self._propagator = TraceContextTextMapPropagator()
        self._empty = otel_context.Context()
        self._readable = ReadableSpan
        self._event = Event
        self._link = Link
        self._span_context = SpanContext
        self._current_span = get_current_span
        self._status_error = partial(Status, StatusCode.ERROR)
        self._unset = Status(StatusCode.UNSET)
        self.client_kind = SpanKind.CLIENT
        self.server_kind = SpanKind.SERVER
        self._internal_kind = SpanKind.INTERNAL
        judge = cfg.judge
        params = cfg.genrm_responses_create_params
        model = judge.model or params.get("model")
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "genrm.judge.api": judge.api,
        }
        if isinstance(model, str) and model:
            attrs["gen_ai.request.model"] = _clip(model)
        for key, attr in (("temperature", "gen_ai.request.temperature"),
                          ("top_p", "gen_ai.request.top_p"),
                          ("max_output_tokens", "gen_ai.request.max_tokens"),
                          ("max_tokens", "gen_ai.request.max_tokens")):
            value = params.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attrs[attr] = value
        self._judge_attrs = attrs
        self._judge_name = f"chat {attrs['gen_ai.request.model']}" if "gen_ai.request.model" \
            in attrs else "chat"
        if self._process is not None:
            logger.info("tracing: on, sample ratio %g, OTLP/HTTP to %s from the span export "
                        "process (pid %s)", cfg.tracing.sample_ratio,
                        cfg.tracing.otlp_endpoint or os.environ.get(
                            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
                            "OTEL_EXPORTER_OTLP_ENDPOINT") or "the OTEL_* default",
                        self._process.pid)

    @property
    def export_failures(self) -> int:
        return self._failures.spans

    @property
    def export_pid(self) -> int | None:
        """The span export process's pid (None: an exporter put in, or no child running)."""
        return None if self._process is None else self._process.pid

    def finish(self, span: _OtelSpan, error: str | None) -> None:
        """``span`` ended now: to the processor (the batch processor queues it for export):
        a row for the export process (:class:`~genrm_trio.server.trace_export.SpanRow`'s
        fields, in order: no SDK object), else the SDK's ``ReadableSpan``."""
        end_ns = time.time_ns()
        context = span._context
        if self._process is not None:
            parent = span._parent
            trace_id = context.trace_id
            state = context.trace_state
            # The processor reads only .context.trace_flags.sampled of what it queues.
            self._processor.on_end(_Ended(context, (  # type: ignore[arg-type]
                span._name, trace_id >> 64, trace_id & _LOW64, context.span_id,
                int(context.trace_flags), state.to_header() if state else "",
                None if parent is None else parent.span_id,
                parent is not None and parent.is_remote, span._kind.value, span._start_ns,
                end_ns, span._attributes, span._events,
                [(c.trace_id >> 64, c.trace_id & _LOW64, c.span_id, int(c.trace_flags),
                  c.is_remote, attributes) for c, attributes in span._links],
                0 if error is None else 2, error)))
            return
        event, link = self._event, self._link
        self._processor.on_end(self._readable(
            name=span._name, context=context, parent=span._parent,
            resource=self._resource, attributes=span._attributes,
            events=[event(name, _NO_ATTRIBUTES if attributes is None else attributes, ns)
                    for name, ns, attributes in span._events],
            links=[link(c, _NO_ATTRIBUTES if attributes is None else attributes)
                   for c, attributes in span._links],
            kind=span._kind,
            status=self._unset if error is None else self._status_error(error),
            start_time=span._start_ns, end_time=end_ns,
            instrumentation_scope=self._scope))

    def _root(self) -> SpanContext | None:
        """A new trace's root span context, or None when the ratio sampler drops it: the
        parent-based sampler's rule for a span without a parent, decided here on the trace id
        against the ratio sampler's own bound (no sampling result built for a dropped one)."""
        trace_id = self._ids.generate_trace_id()
        if trace_id & self._id_mask >= self._bound:
            return None
        return self._span_context(trace_id, self._ids.generate_span_id(), is_remote=False,
                                  trace_flags=self._root_flags)

    def _remote_child(self, context: Context, name: str) -> tuple[SpanContext | None,
                                                                   SpanContext | None]:
        """For a request with a ``traceparent``: its span's context (None when the sampler
        drops it: a caller's unsampled flag is followed) and its remote parent's (None if the
        header was not valid: then the span is a root)."""
        parent = self._current_span(context).get_span_context()
        if not parent.is_valid:
            return self._root(), None
        result = self._sampler.should_sample(context, parent.trace_id, name)
        if result.decision is not self._sampled:
            return None, parent
        flags = self._trace_flags((parent.trace_flags & self._random_flag) | 1)  # sampled
        return self._span_context(parent.trace_id, self._ids.generate_span_id(),
                                  is_remote=False, trace_flags=flags,
                                  trace_state=result.trace_state), parent

    def request(self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]],
                rollout_id: str | None) -> RequestSpan:
        if path in UNTRACED_PATHS:
            return NO_REQUEST_SPAN
        carrier: dict[str, str] | None = None
        for name, value in headers:
            if name == b"traceparent" or name == b"tracestate":
                if carrier is None:
                    carrier = {}
                carrier[name.decode("latin-1")] = value.decode("latin-1")
        span_name = f"{method} {path[:64]}"
        if carrier is None:
            context, parent = self._root(), None
        else:
            extracted = self._propagator.extract(carrier, context=self._empty)
            context, parent = self._remote_child(extracted, span_name)
        if context is None:
            return NO_REQUEST_SPAN
        attributes: dict[str, Any] = {"http.request.method": method, "http.route": path,
                                      "url.path": path[:MAX_ID_CHARS]}
        if rollout_id is not None:
            attributes["genrm.rollout_id"] = rollout_id
        return _OtelRequestSpan(self, span_name, context, parent, attributes)

    def cohort(self, key: str, group_id: str | None, attempt: int, size: int) -> CohortTrace:
        context = self._root()
        if context is None:
            return NO_COHORT_TRACE
        attributes: dict[str, Any] = {"genrm.cohort.key": key, "genrm.group_attempt": attempt,
                                      "genrm.size": size}
        if group_id is not None:
            attributes["genrm.group_id"] = _clip(group_id)
        return _OtelCohortTrace(self, "genrm.cohort", context, None, self._internal_kind,
                                attributes)

    def judge_span(self, parent: _OtelSpan, judge_idx: int) -> JudgeSpan:
        # A child of a recording span is recorded (the parent-based sampler's rule for a
        # sampled local parent): no sampler call.
        up = parent._context
        context = self._span_context(up.trace_id, self._ids.generate_span_id(), is_remote=False,
                                     trace_flags=up.trace_flags, trace_state=up.trace_state)
        # W3C trace context: version 00, trace id, parent (this span) id, flags.
        headers: tuple[tuple[str, str], ...] = (
            ("traceparent", f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                            f"{context.trace_flags:02x}"),)
        if context.trace_state:
            headers += (("tracestate", context.trace_state.to_header()),)
        attributes = {**self._judge_attrs, "genrm.judge.idx": judge_idx}
        return _OtelJudgeSpan(self, self._judge_name, context, up, attributes, headers)

    def shutdown_began(self, active_cohorts: int, waiters: int) -> None:
        context = self._root()
        if context is None:
            return
        span = _OtelSpan(self, "genrm.shutdown", context, None, self._internal_kind, {
            "genrm.active_cohorts": active_cohorts, "genrm.waiters": waiters})
        span._event("genrm.shutdown.began")
        span._end()

    def close(self, timeout_s: float) -> None:
        """Flush what is queued and shut the processor down, within ``timeout_s``: the export
        process's waits end by then (it is killed if late, and reaped); what is still queued
        then fails at once and is counted."""
        process = self._process
        if process is not None:
            process.begin_close(time.monotonic() + timeout_s)
        try:
            self._processor.force_flush(int(timeout_s * 1000))
            self._processor.shutdown()
        finally:
            if process is not None:
                process.close()


class _Ended:
    """A finished span on its way to the export process: the batch processor reads only its
    ``context`` (the sampled flag); ``row`` is what is sent."""

    __slots__ = ("context", "row")

    def __init__(self, context: SpanContext, row: tuple[Any, ...]) -> None:
        self.context = context
        self.row = row


def _start_export_process(cfg: Config, resource: Resource) -> ExportProcess:
    """The span export process, started and ready. Blocks while it starts (the SDK's
    import, at most ``STARTUP_BOUND_S``); raises :class:`ConfigError` (``tracing.enabled``)
    if it cannot, in one line."""
    from genrm_trio.server.trace_export import ExportProcess, Hello

    process = ExportProcess(Hello(
        endpoint=cfg.tracing.otlp_endpoint, resource_attributes=dict(resource.attributes),
        resource_schema_url=resource.schema_url, scope_name=SCOPE_NAME, scope_version=None,
        log_level=cfg.log_level, log_format=cfg.log_format))
    try:
        process.start()
    except ExportStartError as exc:
        process.close()
        raise ConfigError("tracing.enabled", f"the span export process did not start: {exc} "
                          f"(the [otel] extra: {INSTALL_HINT})") from exc
    return process


def _process_exporter(process: ExportProcess) -> SpanExporter:
    """The batch processor's exporter: each batch's rows to ``process``, its answer back as
    the result (a lost or failed child is a failure, never an exception)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class ProcessExporter(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            ok = process.export([span.row for span in spans])
            return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

        def shutdown(self) -> None:
            process.close()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return ProcessExporter()


class _ExportFailures:
    """Spans of failed exports, counted in the export thread (a lock guards the count) and
    logged at most once per :data:`EXPORT_NOTE_INTERVAL_S`; read by ``/metrics``."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()
        self._note = RateLimitedNote(
            logger, "tracing: span export failed (collector unreachable or refusing them; "
            "counted in genrm_trace_export_failures_total)", EXPORT_NOTE_INTERVAL_S,
            level=logging.WARNING)

    def add(self, spans: int) -> None:
        with self._lock:
            self.spans += spans
            self._note.note({"spans": spans})


def _counting_exporter(inner: SpanExporter, failures: _ExportFailures) -> SpanExporter:
    """``inner``, with the spans of every failed export counted in ``failures``. The class is
    made here so that the SDK is imported only when tracing is on."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class CountingExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            try:
                result = inner.export(spans)
            except Exception:  # an exporter bug must not end the export thread
                result = SpanExportResult.FAILURE
            if result is not SpanExportResult.SUCCESS:
                failures.add(len(spans))
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    return CountingExporter()


__all__ = [
    "INSTALL_HINT",
    "NO_COHORT_TRACE",
    "NO_JUDGE_SPAN",
    "NO_REQUEST_SPAN",
    "NO_TRACER",
    "CohortTrace",
    "JudgeParent",
    "JudgeSpan",
    "RequestSpan",
    "Tracer",
    "check_available",
    "close_tracer",
    "open_tracer",
]
