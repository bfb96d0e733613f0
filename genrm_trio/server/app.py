"""HTTP routes: decode, call the registry, encode. Errors become JSON statuses.

``POST /verify``, the hot path, is a plain ASGI handler (:class:`VerifyEndpoint`) placed in front
of the quart-trio app by :func:`with_verify_fast_path`; every other route is a quart-trio route.
Every route reads the whole request body before answering (an unread body can hang the next
keep-alive request on the same connection; a body refused as too large closes the connection
instead), and every documented condition is a JSON answer with ``detail`` and ``failure_kind``;
an unexpected exception is the only way to a 500.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from genrm_trio import metrics as metrics_mod
from genrm_trio import scoring, wire
from genrm_trio.config import Config, config_summary
from genrm_trio.errors import JudgeFailed, TooLarge, WireError
from genrm_trio.server.cohort import CohortRegistry, Outcome, Rewarded
from genrm_trio.server.judge import Judge, JudgeRequest
from genrm_trio.server.prometheus import render_metrics

logger = logging.getLogger(__name__)

JSON = "application/json"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(wire.JSON_ENCODER.encode(obj), status=status, content_type=JSON,
                    headers=headers)


def error_response(status: int, detail: str, failure_kind: str | None,
                   headers: dict[str, str] | None = None) -> Response:
    return json_response(wire.error_body(detail, failure_kind), status, headers)


async def _read_body() -> bytes:
    """The whole body, or :class:`TooLarge` past ``max_request_bytes``."""
    try:
        data = await request.get_data(cache=False, as_text=False)
        assert isinstance(data, bytes)
        return data
    except RequestEntityTooLarge as exc:
        raise TooLarge(
            f"request body exceeds max_request_bytes ({request.max_content_length} bytes)"
        ) from exc


def create_app(cfg: Config, registry: CohortRegistry, judge: Judge) -> QuartTrio:
    """Build the quart-trio app. The registry and judge are owned by ``serve``; the app only
    borrows them, so it starts no task of its own."""
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_request_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    # Quart's own body deadline: a client that trickles its body gets a 408 (RequestTimeout).
    app.config["BODY_TIMEOUT"] = cfg.request_read_timeout_s
    started_wall = time.time()

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
        body = wire.decode_compare(await _read_body(), cfg.max_compare_responses)
        return await _compare(cfg, judge, body)

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> Response:
        await request.get_data()
        return json_response({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        await request.get_data()
        if registry.shutting_down:
            return error_response(503, "the server is shutting down", "shutdown")
        return json_response({"status": "ready"})

    @app.get("/reverify_mode")
    async def reverify_mode() -> Response:
        await request.get_data()
        return json_response("unsupported")

    @app.post("/seed_session")
    @app.post("/close_session")
    async def session_hook() -> Response:
        body = wire.decode_object(await _read_body() or b"{}")
        if "resources_session_id" in body:
            return json_response({"resources_session_id": body["resources_session_id"]})
        return json_response({})

    @app.post("/aggregate_metrics")
    async def aggregate_metrics() -> Response:
        body = wire.decode_aggregate(await _read_body())
        metrics = metrics_mod.aggregate_metrics(body.verify_responses)
        # The same canonical bytes `collect` and `aggregate` write to disk.
        return Response(metrics_mod.encode_metrics(metrics), status=200, content_type=JSON)

    @app.get("/status")
    async def status() -> Response:
        await request.get_data()
        return json_response({
            "uptime_s": round(time.time() - started_wall, 3),
            "shutting_down": registry.shutting_down,
            "cohorts": registry.snapshot(),
            "journal": registry.journal.status() if registry.journal is not None else None,
            "judge": judge.status(),
            "config": config_summary(cfg),
        })

    @app.get("/openapi.json")
    async def openapi() -> Response:
        await request.get_data()
        from genrm_trio.server.openapi import build_openapi

        return json_response(build_openapi())

    @app.get("/metrics")
    async def prometheus() -> Response:
        await request.get_data()
        text = render_metrics(registry, judge)
        return Response(text, status=200, content_type="text/plain; version=0.0.4")

    return app


def verify_answer(member: wire.VerifyMember, outcome: Outcome) -> tuple[int, Any, list[
        tuple[bytes, bytes]]]:
    """The HTTP answer for one member's outcome: status, JSON-able body, extra headers."""
    if isinstance(outcome, Rewarded):
        return 200, wire.success_body(member, outcome.reward), []
    if outcome.masked:
        return 200, wire.masked_body(member, outcome.detail), []
    headers = []
    if outcome.retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, round(outcome.retry_after_s))).encode()))
    return outcome.status, wire.error_body(outcome.detail, outcome.kind), headers


class VerifyEndpoint:
    """``POST /verify`` as a plain ASGI handler in front of the quart-trio app.

    Why not a Quart route: this is the one hot path (every rollout passes here, and a waiter can
    sit here for the whole collection deadline); Quart's request context, werkzeug headers and
    two helper tasks per request cost about a fifth of the server's CPU. Here: the body is read
    whole (or refused past ``max_request_bytes`` with ``Connection: close``), decoded, handed to
    the registry, and the answer sent. One watcher task per waiting request turns the client's
    ``http.disconnect`` into a cancellation of this request's scope, which removes only its own
    waiter (the registry's ``finally``).
    """

    def __init__(self, cfg: Config, registry: CohortRegistry) -> None:
        self._cfg = cfg
        self._registry = registry

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = await self._read_body(scope, receive, send)
        if raw is None:
            return
        try:
            member = wire.decode_verify(raw, self._cfg.num_rollouts_per_prompt)
        except WireError as exc:
            await _send_json(send, exc.status, wire.error_body(exc.detail, exc.failure_kind))
            return
        del raw  # the decoded body is what waits; the bytes need not wait with it
        if self._cfg.num_rollouts_per_prompt <= 1:
            await _send_json(send, 200, wire.success_body(member, self._cfg.default_score))
            return
        outcome: Outcome | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            outcome = await self._registry.verify(member)
            nursery.cancel_scope.cancel()
        if outcome is None:  # the client went away; nobody to answer
            return
        status, body, headers = verify_answer(member, outcome)
        await _send_json(send, status, body, headers)

    async def _read_body(self, scope: Any, receive: Any, send: Any) -> bytes | None:
        """The whole body, or None once it has been answered (413, 408) or the client left.
        Reading is bounded by ``request_read_timeout_s``: a client that trickles its body
        holds a handler and its buffer no longer than that."""
        limit = self._cfg.max_request_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._too_large(send)
                return None
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self._cfg.request_read_timeout_s):
            while True:
                message = await receive()
                if message["type"] != "http.request":  # http.disconnect
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    await self._too_large(send)
                    return None
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        del chunks
        # The rest of the body stays unread, so the connection must not be reused.
        await _send_json(send, 408, wire.error_body(_read_timeout_detail(self._cfg),
                                                    "request_timeout"),
                         [(b"connection", b"close")])
        return None

    async def _too_large(self, send: Any) -> None:
        # The rest of the body stays unread, so the connection must not be reused.
        detail = f"request body exceeds max_request_bytes ({self._cfg.max_request_bytes} bytes)"
        await _send_json(send, 413, wire.error_body(detail, "too_large"),
                         [(b"connection", b"close")])


def _read_timeout_detail(cfg: Config) -> str:
    return (f"request body not received within request_read_timeout_s "
            f"({cfg.request_read_timeout_s:g} s)")


async def _cancel_on_disconnect(receive: Any, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _send_json(send: Any, status: int, body: Any,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = wire.JSON_ENCODER.encode(body)
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()), *(headers or [])],
    })
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def with_verify_fast_path(app: QuartTrio, cfg: Config, registry: CohortRegistry) -> Any:
    """The ASGI application served: ``POST /verify`` goes to :class:`VerifyEndpoint`,
    everything else (other routes, lifespan) to the quart-trio app."""
    verify = VerifyEndpoint(cfg, registry)
    grace_s = cfg.shutdown_grace_s

    async def application(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def shielded_send(message: Any) -> None:
            # Hypercorn closes a `Connection: close` socket inside the app's last send();
            # quart-trio cancels its request nursery as soon as hypercorn reports the stream
            # done, which cancelled that close half-way and left the client hanging. Shield the
            # send (bounded: answers are small JSON) so the close always completes.
            with trio.move_on_after(grace_s, shield=True):
                await send(message)

        if scope["path"] != "/verify":
            await app(scope, receive, shielded_send)
        elif scope["method"] == "POST":
            await verify(scope, receive, shielded_send)
        else:
            await _send_json(
                shielded_send, 405,
                wire.error_body(f"method {scope['method']} not allowed on /verify; use POST",
                                "bad_request"),
                [(b"allow", b"POST")],
            )

    return application


async def _compare(cfg: Config, judge: Judge, body: wire.CompareRequest) -> Response:
    """Judge the given responses now (stateless). A judge failure cancels the sibling
    comparisons and answers 503 with the error as ``detail``."""
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
            verdicts[index] = await judge.judge_pair(req)
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
