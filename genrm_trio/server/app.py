"""HTTP routes: decode, call the registry, encode. Errors become JSON statuses.

``POST /verify``, the hot path, is a plain ASGI handler (:class:`VerifyEndpoint`) placed in front
of the quart-trio app by :func:`with_verify_fast_path`; every other route is a quart-trio route.
Every route reads the whole request body before answering (an unread body can hang the next
keep-alive request on the same connection; a body refused as too large closes the connection
instead), and every documented condition is a JSON answer with ``detail`` and ``failure_kind``;
an unexpected exception is the only way to a 500.

Every route also answers under NeMo Gym's rollout prefix, ``/ng-rollout/<rollout_id>/<path>``
(what its client sends with ``observability_enabled``): :func:`with_verify_fast_path` strips it
before anything else looks at the path, keeps the id (``/verify`` members carry it), and answers
404 for an id that breaks NeMo Gym's rule, as NeMo Gym does.

With ``auth_token_env`` set, :func:`with_verify_fast_path` checks the bearer token of every HTTP
request but the probes (``/``, ``/health``, ``/healthz``, ``/livez``, ``/readyz``) before any
route runs (server/auth.py) and answers 401 ``unauthorized``. A refused request's body is still
read (up to :data:`UNAUTHORIZED_DRAIN_BYTES` and ``request_read_timeout_s``; past either the
answer carries ``Connection: close``) for the keep-alive reason above. Client disconnects,
429s and 401s are logged at most once per :data:`NOTE_INTERVAL_S` each, with a count.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Generator
from functools import partial
from typing import Any, TypeVar, cast

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from genrm_trio import metrics as metrics_mod
from genrm_trio import scoring, wire
from genrm_trio.config import Config, config_summary, drain_bound_s
from genrm_trio.errors import JudgeFailed, TooLarge, UnsupportedMediaType, WireError
from genrm_trio.logs import RateLimitedNote
from genrm_trio.server.auth import UNAUTHORIZED_DETAIL, BearerAuth
from genrm_trio.server.cohort import (
    BODY_RESERVE_FACTOR,
    BODY_ROOM_WAIT_S,
    REFUSABLE_BODY_BYTES,
    CohortRegistry,
    Failure,
    Outcome,
    Rewarded,
)
from genrm_trio.server.drain import DrainMode
from genrm_trio.server.judge import Judge, JudgeRequest
from genrm_trio.server.judge.h11_pool import MAX_IDLE_PER_ORIGIN
from genrm_trio.server.process_memory import ProcessMemory
from genrm_trio.server.prometheus import ServerMetrics
from genrm_trio.server.shutdown import ShutdownDeadline
from genrm_trio.server.tracing import NO_REQUEST_SPAN, NO_TRACER, RequestSpan, Tracer

logger = logging.getLogger(__name__)

JSON = "application/json"
UNAUTHORIZED_DRAIN_BYTES = 64 * 1024
"""A refused request's body is read up to this size, and the connection kept; a longer one is
answered at once, discarded (:func:`answer_then_discard`) and the connection closed."""
DISCARD_BYTES = 64 * 2**20
"""After an answer that closes the connection before the body was read (413, a refused large
body), at most this much more of the body is read and discarded, so a client that writes its
whole body before reading finds the answer instead of a reset."""
DISCARD_S = 10.0
"""... and for at most this long."""
NOTE_INTERVAL_S = 10.0
"""At most one log line per this many seconds for disconnects, 429s and 401s each."""
TRACE_SCOPE_KEY = "genrm_trio.trace"
"""Where a traced request's span sits in its ASGI scope, for the quart routes (``/compare``)."""
STEPPED_BYTES = 16 * 1024
"""A body (or an answer that holds one) of more than this many bytes is decoded, checked,
weighed and encoded in steps, the event loop running other tasks between them
(:func:`run_stepped`); a smaller one at once, in a few milliseconds at most."""

_T = TypeVar("_T")


async def run_stepped(steps: Generator[None, None, _T], size: int) -> _T:
    """The result of ``steps`` (a ``wire.*_steps`` generator, for a body of ``size`` bytes).
    Past :data:`STEPPED_BYTES`, a checkpoint after each step, so the loop is held at most for
    the longest one: one C call (a count over the bytes, msgspec's decode or encode, part of
    the weighing walk), which ``max_json_values`` bounds to about 40 ms (issue 26). Not a
    worker thread: msgspec and every ``bytes`` method hold the GIL for a whole call, and a
    thread busy with them makes each of the loop's system calls wait for the GIL again (probe
    steps of 250 ms were measured that way, against the 40 ms of the longest call). A
    cancellation (the client left, shutdown) stops the work at the next checkpoint."""
    if size <= STEPPED_BYTES:
        return wire.run_steps(steps)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(_T, done.value)
        await trio.lowlevel.checkpoint()


class StepLane:
    """The stepped work of large bodies (:func:`run_stepped`), one body's run at a time, in
    arrival order (a ``trio.Lock`` is fair). Stepping bounds how long one step holds the
    event loop, but trio runs every ready task once per pass: with eight 8 MB bodies being
    decoded or answered at once, each pass held the loop for eight steps, and a probe (a few
    passes) waited for all of them (probe p99 140-214 ms with 100 slow readers of 8 MB
    answers, the bench's ``slow_readers`` preset). Through the lane, a pass holds at most
    one large body's step, the bodies waiting their turn are not even scheduled, and fewer
    large bodies are decoded at once (less memory in flight). Bodies of at most
    :data:`STEPPED_BYTES` do not use it: their work is one short step anyway. Owned by the
    endpoint that uses it (no module state); the work inside never waits for anything but
    the loop (no I/O, no other lock)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def run(self, steps: Generator[None, None, _T], size: int) -> _T:
        """:func:`run_stepped` of ``steps``, past :data:`STEPPED_BYTES` in the lane."""
        if size <= STEPPED_BYTES:
            return wire.run_steps(steps)
        async with self._lock:
            return await run_stepped(steps, size)

    def busy(self) -> bool:
        """Whether a large body's work holds the lane now."""
        return self._lock.locked()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(wire.JSON_ENCODER.encode(obj), status=status, content_type=JSON,
                    headers=headers)


def error_response(status: int, detail: str, failure_kind: str | None,
                   headers: dict[str, str] | None = None) -> Response:
    return json_response(wire.error_body(detail, failure_kind), status, headers)


def content_type_problem(value: str | None) -> str | None:
    """Why a request's ``Content-Type`` is refused (415), or None. Absent is accepted (bodies
    are JSON by contract); present, it must be JSON (``application/json`` or ``*/*+json``,
    parameters allowed, charset utf-8 when given)."""
    if value is None or not value.strip():
        return None
    media, _, params = value.partition(";")
    media = media.strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        return f"Content-Type must be application/json, got {wire.bound_text(value, 100)!r}"
    for param in params.split(";"):
        name, _, arg = param.partition("=")
        if name.strip().lower() == "charset" and arg.strip().strip('"').lower() not in (
                "utf-8", "utf8"):
            return f"Content-Type charset must be utf-8, got {wire.bound_text(arg, 40)!r}"
    return None


async def _read_body() -> bytes:
    """The whole body, or :class:`TooLarge` past ``max_request_bytes``; a body whose
    Content-Type is not JSON is refused (:class:`UnsupportedMediaType`) once read."""
    problem = content_type_problem(request.headers.get("content-type"))
    try:
        data = await request.get_data(cache=False, as_text=False)
        assert isinstance(data, bytes)
        if problem is not None:
            raise UnsupportedMediaType(problem)
        return data
    except RequestEntityTooLarge as exc:
        raise TooLarge(
            f"request body exceeds max_request_bytes ({request.max_content_length} bytes)"
        ) from exc


def create_app(cfg: Config, registry: CohortRegistry, judge: Judge,
               metrics: ServerMetrics | None = None,
               memory: ProcessMemory | None = None,
               drain_mode: DrainMode | None = None) -> QuartTrio:
    """Build the quart-trio app. The registry, judge, metrics and memory are owned by
    ``serve``; the app only borrows them, so it starts no task of its own. Without ``metrics``
    (tests), a :class:`ServerMetrics` reading ``registry`` and ``judge`` is made here; without
    ``memory``, a :class:`ProcessMemory` that never trims; without ``drain_mode`` (owned by
    ``serve``, whose task ends a drain), one whose drain only refuses new cohorts."""
    if metrics is None:
        metrics = ServerMetrics()
        metrics.read_from(registry, judge)
    exposition = metrics
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    # Quart's own body deadline: a client that trickles its body gets a 408 (RequestTimeout).
    app.config["BODY_TIMEOUT"] = cfg.request_read_timeout_s
    started_wall = time.time()
    process_memory = memory if memory is not None else ProcessMemory.open()
    if drain_mode is None:
        drain_mode = DrainMode(drain_bound_s(cfg))
        drain_mode.attach(registry)
    mode = drain_mode

    @app.errorhandler(WireError)
    async def _wire_error(exc: WireError) -> Response:
        headers = {"Connection": "close"} if isinstance(exc, TooLarge) else None
        return error_response(exc.status, exc.detail, exc.failure_kind, headers)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if status == 408:
            return error_response(408, _read_timeout_detail(cfg), "request_timeout",
                                  {"Connection": "close"})
        kind = "too_large" if status == 413 else ("bad_request" if status < 500 else None)
        headers = {"Connection": "close"} if status == 413 else None
        return error_response(status, exc.description or exc.name, kind, headers)

    @app.post("/compare")
    async def compare() -> Response:
        raw = await _read_body()
        body = await run_stepped(wire.decode_compare_steps(
            raw, cfg.max_compare_responses, cfg.max_json_values), len(raw))
        span = cast(RequestSpan, request.scope.get(TRACE_SCOPE_KEY, NO_REQUEST_SPAN))
        return await _compare(cfg, judge, body, span)

    @app.post("/get_reward")
    async def get_reward() -> Response:
        raw = await _read_body()
        body = await run_stepped(wire.decode_get_reward_steps(raw, cfg.max_json_values),
                                 len(raw))
        return await _get_reward(cfg, registry, body)

    @app.get("/")
    @app.get("/health")
    @app.get("/healthz")
    @app.get("/livez")
    async def health() -> Response:
        await request.get_data()
        return json_response({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        await request.get_data()
        if registry.shutting_down:
            return error_response(503, "the server is shutting down", "shutdown")
        return json_response({"status": "ready"})

    # Drain (server/drain.py, README "Rolling restart"). Only with inbound auth: the fast path
    # answers 403 when auth_token_env is not set.
    @app.post("/admin/drain")
    async def admin_drain() -> Response:
        await request.get_data()
        if not mode.request():
            return error_response(409, "the server is shutting down: there is nothing left to "
                                  "drain", "shutdown")
        return json_response(mode.status())

    @app.post("/admin/ready")
    async def admin_ready() -> Response:
        await request.get_data()
        if not mode.take_back():
            return error_response(409, "too late to take the drain back: the server is "
                                  "shutting down", "shutdown")
        return json_response(mode.status())

    @app.get("/reverify_mode")
    async def reverify_mode() -> Response:
        await request.get_data()
        return json_response("unsupported")

    @app.post("/seed_session")
    @app.post("/close_session")
    async def session_hook() -> Response:
        raw = await _read_body() or b"{}"
        body = await run_stepped(wire.decode_object_steps(raw, cfg.max_json_values), len(raw))
        if "resources_session_id" in body:
            return json_response({"resources_session_id": body["resources_session_id"]})
        return json_response({})

    @app.post("/aggregate_metrics")
    async def aggregate_metrics() -> Response:
        raw = await _read_body()
        body = await run_stepped(wire.decode_aggregate_steps(raw, cfg.max_json_values),
                                 len(raw))
        metrics = metrics_mod.aggregate_metrics(body.verify_responses)
        # The same canonical bytes `collect` and `aggregate` write to disk.
        return Response(metrics_mod.encode_metrics(metrics), status=200, content_type=JSON)

    @app.get("/status")
    async def status() -> Response:
        await request.get_data()
        judge_status = judge.status()
        return json_response({
            "uptime_s": round(time.time() - started_wall, 3),
            "shutting_down": registry.shutting_down,
            "drain": mode.status(),
            "cohorts": registry.snapshot(),
            "journal": registry.journal.status() if registry.journal is not None else None,
            "verdict_reuse": registry.verdict_status(),
            "judge": judge_status,
            "memory": {**process_memory.status(), "structures": {
                **registry.retention(), **_judge_structures(cfg, judge_status),
                "metrics_series": {"count": exposition.series(), "cap": None, "ttl_s": None}}},
            "config": config_summary(cfg),
        })

    @app.get("/debug/memory")
    async def debug_memory() -> Response:
        # The diagnostic of bench/README.md's soak: tracemalloc's top growers by traceback
        # since a baseline (the first call, or one with ?reset=1), only when the process
        # started with PYTHONTRACEMALLOC; otherwise just {"tracing": false}.
        await request.get_data()
        top = min(200, max(1, request.args.get("top", 20, type=int) or 20))
        reset = request.args.get("reset", "") in ("1", "true")
        return json_response(await process_memory.trace.report(top=top, reset=reset))

    @app.get("/openapi.json")
    async def openapi() -> Response:
        await request.get_data()
        from genrm_trio.server.openapi import build_openapi

        return json_response(build_openapi())

    @app.get("/metrics")
    async def prometheus() -> Response:
        await request.get_data()
        text, content_type = exposition.render()
        return Response(text, status=200, content_type=content_type)

    return app


def _judge_structures(cfg: Config, status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The judge's structures that grow with requests, from its ``/status`` block: its pooled
    connections (idle ones up to the pool's cap per endpoint, busy ones up to the limiter's
    capacity) and the calls queued at its limiter (at most the comparisons of the active
    cohorts)."""
    endpoints = status.get("endpoints", [])
    limiter = status.get("limiter", {})
    return {
        "judge_connections": {
            "count": sum(int(e.get("clients") or 0) for e in endpoints),
            "cap": len(endpoints) * MAX_IDLE_PER_ORIGIN + cfg.judge_max_concurrency, "ttl_s": None},
        "judge_limiter_waiting": {"count": int(limiter.get("waiting") or 0), "cap": None,
                                  "ttl_s": cfg.cohort_evaluation_timeout_s},
    }


Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]
"""An encoded HTTP answer: status, JSON body, extra headers."""


def verify_answer(member: wire.VerifyMember, outcome: Outcome) -> Answer:
    """The HTTP answer for one member's outcome: status, encoded JSON body, extra headers.
    Encoded here, so the decoded body built for it is gone before the caller awaits the send
    (thousands of waiters may be released at once, to clients that read slowly)."""
    return wire.run_steps(verify_answer_steps(member, outcome))


def verify_answer_steps(member: wire.VerifyMember, outcome: Outcome) -> wire.Steps[Answer]:
    """:func:`verify_answer` in two steps: the body decoded again (with its answer's keys),
    then encoded."""
    encode = wire.encode_answer
    if isinstance(outcome, Rewarded):
        body = wire.success_body(
            member, outcome.reward, outcome.defaulted_comparisons,
            cohort_expected=outcome.cohort_expected, cohort_scored=outcome.cohort_scored,
            reused_comparisons=outcome.reused_comparisons, assigned_slot=outcome.slot)
        yield
        return 200, encode(body), []
    if outcome.masked:
        body = wire.masked_body(member, outcome.detail)
        yield
        return 200, encode(body), []
    headers = []
    if outcome.retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, round(outcome.retry_after_s))).encode()))
    return outcome.status, encode(wire.error_body(outcome.detail, outcome.kind)), headers


def _encoded_success(member: wire.VerifyMember, reward: float) -> wire.Steps[bytes]:
    body = wire.success_body(member, reward)
    yield
    return wire.encode_answer(body)


class VerifyEndpoint:
    """``POST /verify`` as a plain ASGI handler in front of the quart-trio app.

    Why not a Quart route: this is the one hot path (every rollout passes here, and a waiter can
    sit here for the whole collection deadline); Quart's request context, werkzeug headers and
    two helper tasks per request cost about a fifth of the server's CPU. Here: the body's share
    of ``max_active_bytes`` is reserved (:class:`_BodyReservation`; a large body past the budget
    waits for room, then gets 429 before it is read), the body is read
    whole (or refused past ``max_request_bytes`` with ``Connection: close``), decoded (a big one
    in steps, :func:`run_stepped`, as its answer is built), handed to the registry, and the
    answer sent. While it waits, the handler's own task reads the connection
    (:meth:`CohortRegistry.verify_unless_gone`): the client's ``http.disconnect`` removes only its
    own waiter, and the cohort's resolution interrupts the read. No task is started per request,
    and the answer's two ASGI messages are sent under one shielded, bounded scope.
    """

    def __init__(self, cfg: Config, registry: CohortRegistry,
                 metrics: ServerMetrics | None = None) -> None:
        self._cfg = cfg
        self._registry = registry
        self._metrics = metrics
        self._lane = StepLane()
        self._disconnects = RateLimitedNote(
            logger, "client went away before its /verify answer (its waiter removed)",
            NOTE_INTERVAL_S)
        self._overloaded = RateLimitedNote(
            logger, "/verify refused a new cohort: 429 overloaded", NOTE_INTERVAL_S)

    async def __call__(self, scope: Any, receive: Any, send: Any,
                       rollout_id: str | None = None,
                       span: RequestSpan = NO_REQUEST_SPAN) -> None:
        """Read, decode, register, wait, answer; the outcome's label goes to the metrics and
        to the request's ``span`` (server/tracing.py), the member's coordinates too. While
        the member waits this is one coroutine frame above the registry's (thousands of members
        may wait at once: each frame costs a few hundred bytes per waiter, issue 21)."""
        started = trio.current_time()
        reservation = _BodyReservation(self._registry)
        try:
            member = await self._read_member(scope, receive, send, rollout_id, reservation)
            detail = None
            if isinstance(member, str):  # answered already, or the client left
                label = member
            elif self._cfg.num_rollouts_per_prompt <= 1:
                span.member(member)
                payload = await self._lane.run(
                    _encoded_success(member, self._cfg.default_score), len(member.raw))
                del member
                reservation.release()
                await _send_payload(send, 200, payload)
                label = "rewarded"
            else:
                span.member(member)
                outcome = await self._registry.verify_unless_gone(
                    member, partial(_until_disconnect, receive), span, reservation.release)
                answer = (await self._lane.run(verify_answer_steps(member, outcome),
                                               len(member.raw))
                          if outcome is not None else None)
                # The body is not held while its answer waits for a client that reads slowly:
                # the answer alone counts towards max_active_bytes then (_ShieldedSend).
                del member
                reservation.release()
                label = await self._send_outcome(send, answer, outcome)
                detail = outcome.detail if isinstance(outcome, Failure) else None
        finally:
            reservation.release()
        span.outcome(label, label == "masked", detail)
        if self._metrics is not None:
            self._metrics.observe_verify(label, trio.current_time() - started)

    async def _read_member(self, scope: Any, receive: Any, send: Any, rollout_id: str | None,
                           reservation: _BodyReservation) -> wire.VerifyMember | str:
        """The request's validated member, or the label of what happened instead once it has
        been answered (or the client left). Its body's bytes are reserved in ``reservation``
        as they arrive (the caller releases them)."""
        raw = await self._read_body(scope, receive, send, reservation)
        if isinstance(raw, str):
            return raw
        content_type = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), None)
        problem = content_type_problem(content_type)
        if problem is not None:
            await _send_json(send, 415, wire.error_body(problem, "bad_request"))
            return "bad_request"
        try:
            cfg = self._cfg
            return await self._lane.run(wire.decode_verify_steps(
                raw, cfg.num_rollouts_per_prompt, rollout_id,
                arrival_slots=cfg.legacy_slots == "arrival", max_values=cfg.max_json_values),
                len(raw))
        except WireError as exc:
            await _send_json(send, exc.status, wire.error_body(exc.detail, exc.failure_kind))
            return exc.failure_kind or "bad_request"

    async def _send_outcome(self, send: Any, answer: Answer | None,
                            outcome: Outcome | None) -> str:
        """Send a waiter's ``answer`` (:func:`verify_answer` of its ``outcome``; None: the
        client went away, nobody to answer); returns its label."""
        if outcome is None or answer is None:
            self._disconnects.note()
            return "disconnected"
        status, payload, headers = answer
        del answer
        await _send_payload(send, status, payload, headers)
        if isinstance(outcome, Rewarded):
            return "rewarded"
        if outcome.kind == "overloaded":
            self._overloaded.note()
        return "masked" if outcome.masked else outcome.kind

    async def _read_body(self, scope: Any, receive: Any, send: Any,
                         reservation: _BodyReservation) -> bytes | str:
        """The whole body, or the label of what happened instead once it has been answered
        (``too_large``, ``request_timeout``, ``overloaded``) or the client left
        (``disconnected``). Reading is bounded by ``request_read_timeout_s``: a client that
        trickles its body holds a handler and its buffer no longer than that. The body's
        share of ``max_active_bytes`` is reserved before it is read (its ``Content-Length``)
        or as it arrives (chunked). A large body with no room waits for it, unread, up to
        :data:`BODY_ROOM_WAIT_S` (chunked: not at all); refused, the client gets 429
        ``overloaded``, the rest of its body is discarded and the connection closed
        (:func:`answer_then_discard`). A member that waits in its cohort releases the
        reservation there (its bytes are the cohort's from then on)."""
        limit = self._cfg.max_request_bytes
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            await self._too_large(receive, send)
            return "too_large"
        read_timeout = self._cfg.request_read_timeout_s
        if declared is not None and not await reservation.add_declared(
                declared, trio.current_time() + min(BODY_ROOM_WAIT_S, read_timeout)):
            await self._refuse_body(receive, send, reservation)
            return "overloaded"
        with trio.move_on_after(read_timeout):
            body = await read_body_within(
                receive, limit, reservation.add if declared is None else None)
            if body is None:
                return "disconnected"
            if body is TOO_LARGE:
                await self._too_large(receive, send)
                return "too_large"
            if body is OVER_BUDGET:
                await self._refuse_body(receive, send, reservation)
                return "overloaded"
            assert isinstance(body, bytes)
            return body
        # The rest of the body stays unread, so the connection must not be reused.
        await _send_json(send, 408, wire.error_body(_read_timeout_detail(self._cfg),
                                                    "request_timeout"),
                         [(b"connection", b"close")])
        return "request_timeout"

    async def _too_large(self, receive: Any, send: Any) -> None:
        await answer_too_large(self._cfg, receive, send)

    async def _refuse_body(self, receive: Any, send: Any,
                           reservation: _BodyReservation) -> None:
        """429 ``overloaded`` for a body whose reservation was refused; what it had reserved
        is released before the rest of it is discarded."""
        refusal = reservation.refusal
        assert refusal is not None
        reservation.release()
        self._overloaded.note()
        await answer_then_discard(
            receive, send, refusal.status, wire.error_body(refusal.detail, refusal.kind),
            [(b"retry-after", str(max(1, round(refusal.retry_after_s or 1))).encode())])


class _BodyReservation:
    """One ``/verify`` request's share of ``max_active_bytes`` for its body
    (:data:`BODY_RESERVE_FACTOR` times the bytes read or declared), reserved from the registry
    and released once (:meth:`release` is idempotent). A body counts as refusable from its
    first reservation past :data:`REFUSABLE_BODY_BYTES` (its ``Content-Length``, or the
    bytes that arrived so far). ``refusal``: the 429 of the last :meth:`add` that the
    registry refused."""

    __slots__ = ("_registry", "_small", "_large", "refusal")

    def __init__(self, registry: CohortRegistry) -> None:
        self._registry = registry
        self._small = 0  # reserved as a small body (never refused)
        self._large = 0  # reserved as a large one (refusable)
        self.refusal: Failure | None = None

    def add(self, size: int, total: int) -> bool:
        """Reserve for ``size`` more body bytes (``total`` so far, these included); False
        (nothing more reserved) when the registry refuses."""
        share = BODY_RESERVE_FACTOR * size
        if total <= REFUSABLE_BODY_BYTES:
            self.refusal = self._registry.reserve_body(share, refusable=False)
            assert self.refusal is None
            self._small += share
            return True
        if self._large == 0 and self._small:  # the body grew past the line: one reservation
            self._registry.release_body(self._small, refusable=False)
            share, self._small = share + self._small, 0
        self.refusal = self._registry.reserve_body(share, more=self._large > 0)
        if self.refusal is not None:
            return False
        self._large += share
        return True

    async def add_declared(self, size: int, deadline: float) -> bool:
        """Reserve for a whole body of ``size`` declared bytes; one over
        :data:`REFUSABLE_BODY_BYTES` waits for room until ``deadline``
        (:meth:`CohortRegistry.reserve_body_within`). False when refused."""
        if size <= REFUSABLE_BODY_BYTES:
            return self.add(size, size)
        share = BODY_RESERVE_FACTOR * size
        self.refusal = await self._registry.reserve_body_within(share, deadline)
        if self.refusal is not None:
            return False
        self._large = share
        return True

    def release(self) -> None:
        if self._small:
            self._registry.release_body(self._small, refusable=False)
            self._small = 0
        if self._large:
            self._registry.release_body(self._large)
            self._large = 0


TOO_LARGE = object()
"""What :func:`read_body_within` returns for a body over its limit."""
OVER_BUDGET = object()
"""What :func:`read_body_within` returns for a body whose ``reserve`` refused its bytes."""


async def answer_too_large(cfg: Config, receive: Any, send: Any) -> None:
    """413 ``too_large`` for a body over ``max_request_bytes``, then the rest of the body
    discarded (:func:`answer_then_discard`) and the connection closed."""
    detail = f"request body exceeds max_request_bytes ({cfg.max_request_bytes} bytes)"
    await answer_then_discard(receive, send, 413, wire.error_body(detail, "too_large"), [])


async def answer_then_discard(receive: Any, send: Any, status: int, body: Any,
                              headers: list[tuple[bytes, bytes]]) -> None:
    """Answer with ``Connection: close`` while the client may still be sending its body, then
    read and discard what it sends (at most :data:`DISCARD_BYTES` and :data:`DISCARD_S`), then
    end the answer, which is when Hypercorn closes the connection (RFC 9112, 9.6). Closing with
    the body unread would make the kernel reset the connection, and a client that writes its
    whole body before reading (curl, urllib, requests) would see a broken pipe, never the
    answer. The answer's bytes go out first, so a client that reads while it sends stops at
    once. Returns early when the client goes away."""
    payload = wire.JSON_ENCODER.encode(body)
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()), *headers,
                    (b"connection", b"close")],
    })
    await send({"type": "http.response.body", "body": payload, "more_body": True})
    with trio.move_on_after(DISCARD_S):
        discarded = 0
        while discarded <= DISCARD_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
            discarded += len(message.get("body", b""))
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_body_within(
    receive: Any, limit: int, reserve: Callable[[int, int], bool] | None = None,
) -> bytes | object | None:
    """Read an ASGI request body: the bytes, :data:`TOO_LARGE` as soon as more than ``limit``
    bytes arrived (the rest is left unread: answer with ``Connection: close``), or None when the
    client went away first. With ``reserve``, each chunk's size (and the total so far) is
    passed to it first; once it returns False, :data:`OVER_BUDGET` (the rest left unread as
    well). The caller bounds the time."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return TOO_LARGE
        if reserve is not None and chunk and not reserve(len(chunk), size):
            return OVER_BUDGET
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _declared_length(scope: Any) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def _read_timeout_detail(cfg: Config) -> str:
    return (f"request body not received within request_read_timeout_s "
            f"({cfg.request_read_timeout_s:g} s)")


async def _until_disconnect(receive: Any) -> None:
    """Returns when the client has gone away (``http.disconnect``). The body was read whole
    before, so nothing else arrives meanwhile."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send: Any, status: int, body: Any,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await _send_payload(send, status, wire.JSON_ENCODER.encode(body), headers)


async def _send_payload(send: Any, status: int, payload: bytes,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class _ShieldedSend:
    """One request's ASGI ``send``, shielded and bounded (:func:`with_verify_fast_path`), its
    body bytes counted towards ``max_active_bytes`` until the connection has written them
    (:meth:`CohortRegistry.answer_sending`): a client that reads slowly, or not at all, holds
    its answer in this process until then (server/connections.py ends a send that makes no
    progress for ``send_timeout_s``).

    Hypercorn closes a ``Connection: close`` socket inside the app's last send(); quart-trio
    cancels its request nursery as soon as hypercorn reports the stream done, which cancelled
    that close half-way and left the client hanging. So each send is shielded, so the close
    always completes, bounded by the grace and by the shutdown deadline: one for all sends, not
    a fresh grace for each. The response's start is held back and sent with its first body
    message, under the same one scope. An object of its own rather than a closure: it lives as
    long as its request, and thousands of requests may wait at once (issue 21)."""

    __slots__ = ("_send", "_shutdown", "_grace_s", "_registry", "_start", "status")

    def __init__(self, send: Any, shutdown: ShutdownDeadline, grace_s: float,
                 registry: CohortRegistry) -> None:
        self._send = send
        self._shutdown = shutdown
        self._grace_s = grace_s
        self._registry = registry
        self._start: Any = None
        self.status: int | None = None  # the answer's, once started (for the request's span)

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            self.status = message["status"]
            return
        size = len(message.get("body", b""))
        self._registry.answer_sending(size)
        with self._shutdown.scope(bound_s=self._grace_s, shield=True):
            try:
                if self._start is not None:
                    first, self._start = self._start, None
                    await self._send(first)
                await self._send(message)
            except trio.BusyResourceError:
                # Hypercorn shuts the socket's sending side down (its connection close, when
                # the client hangs up) without its send lock, so the last send of an answer
                # can meet it: the connection is going away, nobody is left to answer. Seen
                # with 413s to clients that close at once (bench soak).
                pass
            finally:
                self._registry.answer_sent(size)


def with_verify_fast_path(app: QuartTrio, cfg: Config, registry: CohortRegistry,
                          shutdown: ShutdownDeadline, *, auth: BearerAuth | None = None,
                          metrics: ServerMetrics | None = None,
                          tracer: Tracer = NO_TRACER) -> Any:
    """The ASGI application served: ``POST /verify`` goes to :class:`VerifyEndpoint`,
    everything else (other routes, lifespan) to the quart-trio app. With ``auth``, an HTTP
    request without the bearer token is answered 401 here, before either sees it. Every send
    is bounded by ``shutdown_grace_s`` and, once shutdown has begun, by its one deadline.
    With tracing on, each request but the probes and ``/metrics`` has a SERVER span
    (``tracer.request``), ended with the answer's status when the request is done."""
    verify = VerifyEndpoint(cfg, registry, metrics)
    grace_s = cfg.shutdown_grace_s
    refused = RateLimitedNote(logger, "request refused: 401 unauthorized", NOTE_INTERVAL_S)

    async def application(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        shielded_send = _ShieldedSend(send, shutdown, grace_s, registry)

        routed = wire.strip_rollout_prefix(scope["path"])
        if routed is None:
            await _not_found(cfg, scope, receive, shielded_send)
            return
        path, rollout_id = routed
        if rollout_id is not None:
            scope = {**scope, "path": path, "raw_path": path.encode("utf-8", "surrogateescape"),
                     wire.ROLLOUT_ID_SCOPE_KEY: rollout_id}
        # No span (a shared no-op) unless tracing is on: the untraced path allocates nothing.
        span = tracer.request(scope["method"], path, scope["headers"], rollout_id)
        if span.recording:
            scope = {**scope, TRACE_SCOPE_KEY: span}
        try:
            if auth is None and path.startswith(ADMIN_PREFIX):
                await _drain_then_answer(cfg, scope, receive, shielded_send, 403,
                                         wire.error_body(ADMIN_NEEDS_AUTH, "forbidden"), [])
            elif auth is not None and not auth.allows(path, scope["headers"]):
                # Never log what the client sent: it may be a near-miss of the real token.
                refused.note({"path": path[:100]})
                if metrics is not None:
                    metrics.unauthorized()
                await _unauthorized(cfg, scope, receive, shielded_send)
            elif path != "/verify":
                declared = _declared_length(scope)
                if declared is not None and declared > cfg.max_request_bytes:
                    await answer_too_large(cfg, receive, shielded_send)
                else:
                    await app(scope, receive, shielded_send)
            elif scope["method"] == "POST":
                await verify(scope, receive, shielded_send, rollout_id, span)
            else:
                await _send_json(
                    shielded_send, 405,
                    wire.error_body(f"method {scope['method']} not allowed on /verify; use POST",
                                    "bad_request"),
                    [(b"allow", b"POST")],
                )
        finally:
            span.end(shielded_send.status)

    return application


ADMIN_PREFIX = "/admin/"
ADMIN_NEEDS_AUTH = (
    "the /admin routes need inbound auth: set auth_token_env (and send its bearer token); "
    "without it, SIGUSR1 drains the server"
)


async def _not_found(cfg: Config, scope: Any, receive: Any, send: Any) -> None:
    """404 for a path under ``/ng-rollout/`` whose rollout id is malformed. The body is
    drained like a refused one (:func:`_drain_then_answer`)."""
    detail = (f"no route for this path: the rollout id of /ng-rollout/<rollout_id>/<path> must "
              f"match {wire.ROLLOUT_ID_PATTERN} and be at most {wire.MAX_ROLLOUT_ID_CHARS} "
              "characters")
    await _drain_then_answer(cfg, scope, receive, send, 404,
                             wire.error_body(detail, "bad_request"), [])


async def _unauthorized(cfg: Config, scope: Any, receive: Any, send: Any) -> None:
    """401 ``unauthorized``; the body is drained first (keep-alive stays usable) unless it is
    over :data:`UNAUTHORIZED_DRAIN_BYTES` or slower than ``request_read_timeout_s``, when the
    connection is closed instead."""
    await _drain_then_answer(cfg, scope, receive, send, 401,
                             wire.error_body(UNAUTHORIZED_DETAIL, "unauthorized"),
                             [(b"www-authenticate", b'Bearer realm="genrm-trio"')])


async def _drain_then_answer(cfg: Config, scope: Any, receive: Any, send: Any, status: int,
                             body: Any, headers: list[tuple[bytes, bytes]]) -> None:
    """Answer a request refused before any route ran. Its body is read first (keep-alive stays
    usable) unless it is over :data:`UNAUTHORIZED_DRAIN_BYTES` or slower than
    ``request_read_timeout_s``; then the answer goes out at once, the rest of the body is
    discarded and the connection closed (:func:`answer_then_discard`)."""
    declared = _declared_length(scope)
    if declared is None or declared <= UNAUTHORIZED_DRAIN_BYTES:
        with trio.move_on_after(cfg.request_read_timeout_s):
            received = await read_body_within(receive, UNAUTHORIZED_DRAIN_BYTES)
            if received is None:
                return
            if received is not TOO_LARGE:
                await _send_json(send, status, body, headers)
                return
    await answer_then_discard(receive, send, status, body, headers)


async def _compare(cfg: Config, judge: Judge, body: wire.CompareRequest,
                   span: RequestSpan = NO_REQUEST_SPAN) -> Response:
    """Judge the given responses now (stateless). A judge failure cancels the sibling
    comparisons and answers 503 with the error as ``detail``. Each comparison's span is a
    child of the request's ``span``."""
    n = len(body.response_objs)
    if n < 2:
        return json_response({
            "rewards": [cfg.default_score] * n, "comparison_results": None, "metrics": None,
        })
    history = [
        {"role": str(m.get("role", "user")), "content": _content_text(m.get("content", ""))}
        for m in body.conversation_history
    ]
    principle = (body.principle or cfg.default_principle) if cfg.use_principle else None
    answers = [scoring.final_answer(r) for r in body.response_objs]
    pairs = scoring.comparison_pairs(n, cfg.comparison_strategy, cfg.num_judges_per_comparison)
    verdicts: dict[int, scoring.Verdict] = {}
    failure: list[str] = []

    async def one(index: int, i: int, j: int, k: int, cancel: trio.CancelScope) -> None:
        req = JudgeRequest(history=history, response_1=answers[i], response_2=answers[j],
                           principle=principle, judge_idx=k)
        try:
            verdicts[index] = await judge.judge_pair(req, trace=span)
        except JudgeFailed as exc:
            if not failure:
                failure.append(str(exc))
            cancel.cancel()

    with trio.move_on_after(cfg.cohort_evaluation_timeout_s) as deadline:
        async with trio.open_nursery() as nursery:
            for index, (i, j, k) in enumerate(pairs):
                nursery.start_soon(one, index, i, j, k, nursery.cancel_scope)
    if failure:
        return error_response(503, wire.bound_text(failure[0]), "judge_failed")
    if deadline.cancelled_caught:
        return error_response(
            503, f"evaluation deadline of {cfg.cohort_evaluation_timeout_s:g} s exceeded",
            "judge_failed")
    comparisons = [
        scoring.Comparison(response_i=i, response_j=j, judge_idx=k, score_1=v.score_1,
                           score_2=v.score_2, ranking=v.ranking)
        for index, (i, j, k) in enumerate(pairs)
        for v in (verdicts[index],)
    ]
    try:
        rewards, metrics = scoring.aggregate(comparisons, body.response_objs, cfg)
    except Exception as exc:  # noqa: BLE001 - documented: evaluation_error, never a 500
        return error_response(503, f"reward aggregation failed: {exc}", "evaluation_error")
    return json_response({
        "rewards": rewards,
        "comparison_results": [
            {"response_i": c.response_i, "response_j": c.response_j, "judge_idx": c.judge_idx,
             "score_1": c.score_1, "score_2": c.score_2, "ranking": c.ranking}
            for c in comparisons
        ],
        "metrics": metrics,
    })


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
        )
    return str(content)


#: The ``extra_logs`` keys of every ``/get_reward`` answer, one number per sample (OpenRLHF
#: turns each value into a tensor: text there would crash its experience maker).
GET_REWARD_LOG_KEYS = ("genrm_masked", "genrm_failure_code", "genrm_cohort_expected",
                       "genrm_cohort_scored", "genrm_prompt_not_prefix")
#: ``genrm_failure_code`` by failure kind (0: rewarded; anything unlisted: 9).
GET_REWARD_FAILURE_CODES = {"judge_failed": 1, "cohort_incomplete": 2, "evaluation_error": 3,
                            "cohort_closed": 4, "cohort_full": 5, "cancelled": 6}
#: Failures answered with an HTTP error instead, so OpenRLHF's own retry loop re-sends.
_GET_REWARD_TRANSIENT = frozenset({"shutdown", "overloaded"})


def get_reward_member(prompt: str, query: str, label: Any) -> tuple[wire.VerifyMember, bool]:
    """The cohort member of one OpenRLHF sample, and whether its prompt was a prefix of its
    query. The response is the query with the prompt removed; when the prompt is not a prefix
    (OpenRLHF decodes the tokens it generated from, which need not give the prompt text back,
    and cuts over-long prompts from the left), the longest common prefix is removed instead.
    The cohort key is the prompt text and the label's digest."""
    prefix = query.startswith(prompt)
    if prefix:
        response_text = query[len(prompt):]
    else:
        common = 0
        for a, b in zip(prompt, query, strict=False):
            if a != b:
                break
            common += 1
        response_text = query[common:]
    body = {
        "responses_create_params": {"input": prompt},
        "response": {"object": "response", "output": [{
            "type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": response_text}]}]},
    }
    label_digest = hashlib.sha256(wire.JSON_ENCODER.encode(label)).hexdigest()[:32]
    member = wire.VerifyMember(
        raw=wire.JSON_ENCODER.encode(body), group_id=None, attempt=0, attempt_given=False,
        rollout_index=None, size_bytes=wire.decoded_size(body),
        key_scope=f"{wire.GET_REWARD_SCOPE}:{label_digest}")
    return member, prefix


async def _get_reward(cfg: Config, registry: CohortRegistry,
                      body: wire.GetRewardRequest) -> Response:
    """OpenRLHF's remote reward protocol. Each sample is a member of the prompt-keyed cohort of
    its prompt text and label, slotted by arrival (a batch's samples wait together, in this
    request's own nursery: one task per sample of this request, none per waiter elsewhere).
    Rewards come back in the samples' order. A sample whose cohort failed (masked, incomplete,
    closed, full) gets reward 0.0 with ``genrm_masked`` 1: a masked cohort's members all get
    the same 0.0, which a group baseline (rloo, group_norm, reinforce_baseline, dr_grpo) turns
    into zero advantage; the reason goes into ``extra_logs`` as a number and into
    ``genrm_failure_reason``. Shutdown and overload are HTTP errors (OpenRLHF retries them)."""
    n = len(body.query)
    labels = body.labels if body.labels is not None else [None] * n
    if cfg.num_rollouts_per_prompt <= 1 or n == 0:
        rewards: list[float] = [cfg.default_score] * n
        return json_response({"rewards": rewards, "scores": rewards, "extra_logs": {
            "genrm_masked": [0.0] * n, "genrm_failure_code": [0.0] * n,
            "genrm_cohort_expected": [1.0] * n, "genrm_cohort_scored": [1.0] * n,
            "genrm_prompt_not_prefix": [0.0] * n}, "genrm_failure_reason": [None] * n})
    members = [get_reward_member(p, q, lab)
               for p, q, lab in zip(body.prompts, body.query, labels, strict=True)]
    outcomes: list[Outcome | None] = [None] * n

    async def one(i: int) -> None:
        outcomes[i] = await registry.verify(members[i][0])

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    for outcome in outcomes:
        if isinstance(outcome, Failure) and outcome.kind in _GET_REWARD_TRANSIENT:
            headers = ({"Retry-After": str(max(1, round(outcome.retry_after_s)))}
                       if outcome.retry_after_s is not None else None)
            return error_response(outcome.status, outcome.detail, outcome.kind, headers)
    rewards = []
    logs: dict[str, list[float]] = {key: [] for key in GET_REWARD_LOG_KEYS}
    reasons: list[str | None] = []
    for (_member, prefix), outcome in zip(members, outcomes, strict=True):
        assert outcome is not None
        logs["genrm_prompt_not_prefix"].append(0.0 if prefix else 1.0)
        logs["genrm_cohort_expected"].append(float(cfg.num_rollouts_per_prompt))
        if isinstance(outcome, Rewarded):
            rewards.append(outcome.reward)
            logs["genrm_masked"].append(0.0)
            logs["genrm_failure_code"].append(0.0)
            logs["genrm_cohort_scored"].append(float(outcome.cohort_scored or 0))
            reasons.append(None)
        else:
            rewards.append(0.0)
            logs["genrm_masked"].append(1.0)
            logs["genrm_failure_code"].append(float(GET_REWARD_FAILURE_CODES.get(outcome.kind, 9)))
            logs["genrm_cohort_scored"].append(0.0)
            reasons.append(f"{outcome.kind}: {wire.bound_text(outcome.detail, 500)}")
    return json_response({"rewards": rewards, "scores": rewards, "extra_logs": logs,
                          "genrm_failure_reason": reasons})
