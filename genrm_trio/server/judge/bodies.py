"""Request bodies: what is sent to the judge, per API (``responses`` or ``chat``).

Pure functions of the configuration and one :class:`~.attempt.JudgeRequest`; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from genrm_trio.config import Config
from genrm_trio.server.judge.attempt import JudgeRequest


def resolved_principle(cfg: Config, request: JudgeRequest) -> str | None:
    """The principle sent to the judge: the request's, else the default; None when disabled."""
    if not cfg.use_principle:
        return None
    return request.principle or cfg.default_principle


def base_params(cfg: Config) -> dict[str, Any]:
    """The create params every judge request starts from: the configured ones plus the model."""
    params = dict(cfg.genrm_responses_create_params)
    if cfg.judge.model:
        params["model"] = cfg.judge.model
    return params


def responses_body(cfg: Config, params: Mapping[str, Any], request: JudgeRequest) -> dict[str, Any]:
    """JSON body of ``POST /v1/responses`` (NeMo Gym ``genrm_model`` shape)."""
    metadata = {"response_1": request.response_1, "response_2": request.response_2}
    principle = resolved_principle(cfg, request)
    if principle is not None:
        metadata["principle"] = principle
    body = dict(params)
    body["input"] = [
        {"role": m.get("role", "user"), "content": m.get("content", ""), "type": "message"}
        for m in request.history
    ]
    body["metadata"] = metadata
    return body


def chat_body(cfg: Config, params: Mapping[str, Any], request: JudgeRequest) -> dict[str, Any]:
    """JSON body of ``POST /v1/chat/completions`` for a GenRM chat template."""
    messages = [
        {"role": m.get("role", "user"), "content": m.get("content", "")} for m in request.history
    ]
    principle = resolved_principle(cfg, request)
    if principle is not None:
        messages.append({"role": "principle", "content": principle})
    messages.append({"role": "response_1", "content": request.response_1})
    messages.append({"role": "response_2", "content": request.response_2})
    body = dict(params)
    if "max_output_tokens" in body:
        body["max_tokens"] = body.pop("max_output_tokens")
    body["messages"] = messages
    return body
