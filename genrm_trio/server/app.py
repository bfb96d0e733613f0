"""HTTP routes (quart-trio): decode, call the registry, encode. Errors become JSON statuses.

Every route reads the whole request body before answering (an unread body can hang the next
keep-alive request on the same connection), and every documented condition is a JSON answer with
``detail`` and ``failure_kind``; an unexpected exception is the only way to a 500.
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
from genrm_trio.server.cohort import CohortRegistry, Failure, Rewarded
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
    app.config["BODY_TIMEOUT"] = None
    started_wall = time.time()

    @app.errorhandler(WireError)
    async def _wire_error(exc: WireError) -> Response:
        headers = {"Connection": "close"} if isinstance(exc, TooLarge) else None
        return error_response(exc.status, exc.detail, exc.failure_kind, headers)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        kind = "too_large" if status == 413 else ("bad_request" if status < 500 else None)
        headers = {"Connection": "close"} if status == 413 else None
        return error_response(status, exc.description or exc.name, kind, headers)

    @app.post("/verify")
    async def verify() -> Response:
        raw = await _read_body()
        member = wire.decode_verify(raw, cfg.num_rollouts_per_prompt)
        if cfg.num_rollouts_per_prompt <= 1:
            return json_response(wire.success_body(member, cfg.default_score))
        outcome = await registry.verify(member)
        if isinstance(outcome, Rewarded):
            return json_response(wire.success_body(member, outcome.reward))
        return failure_response(member, outcome)

    @app.post("/compare")
    async def compare() -> Response:
        body = wire.decode_compare(await _read_body())
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


def failure_response(member: wire.VerifyMember, failure: Failure) -> Response:
    if failure.masked:
        return json_response(wire.masked_body(member, failure.detail))
    headers = None
    if failure.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, round(failure.retry_after_s)))}
    return error_response(failure.status, failure.detail, failure.kind, headers)


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

    async def one(index: int, i: int, j: int, cancel: trio.CancelScope) -> None:
        req = JudgeRequest(history=history, response_1=answers[i], response_2=answers[j],
                           principle=principle)
        try:
            verdicts[index] = await judge.judge_pair(req)
        except JudgeFailed as exc:
            if not failure:
                failure.append(str(exc))
            cancel.cancel()

    with trio.move_on_after(cfg.cohort_evaluation_timeout_s) as deadline:
        async with trio.open_nursery() as nursery:
            for index, (i, j, _k) in enumerate(pairs):
                nursery.start_soon(one, index, i, j, nursery.cancel_scope)
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
