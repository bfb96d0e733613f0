"""Request bodies: what is sent to the judge, per API (``responses``, ``chat``) and prompt
format (``genrm_roles``, ``plain``), with the structured-output option and the sampling seed.

Pure functions of the configuration and one :class:`~.attempt.JudgeRequest`; no I/O.

=================  ===========================================  ===============================
                   ``genrm_roles`` (GenRM chat templates)       ``plain`` (any instruct model)
=================  ===========================================  ===============================
``responses``      ``input`` = history; answers and principle   ``input`` = system + user
                   in ``metadata`` (NeMo Gym ``genrm_model``)   messages from the template
``chat``           ``messages`` = history, ``principle``,       ``messages`` = system + user
                   ``response_1``, ``response_2`` roles         messages from the template
=================  ===========================================  ===============================

``judge.structured_output`` adds the verdict's JSON schema as the API's own option:
``json_schema`` is OpenAI's form (chat: ``response_format: {type: json_schema, json_schema:
{name, schema, strict}}``; responses: ``text: {format: {type: json_schema, name, schema,
strict}}``); ``json_object`` is the older form (chat: ``response_format: {type: json_object,
schema}``, which llama-cpp-python's server turns into a grammar; responses: ``text: {format:
{type: json_object}}``, OpenAI's shape, which carries no schema).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgspec

from genrm_trio import judge_prompt
from genrm_trio.config import Config
from genrm_trio.server.judge.attempt import JudgeRequest

_SEED_MASK = 0x7FFF_FFFF  # 31 bits: every server's seed type holds it (llama.cpp: uint32)


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


def plain_messages(
    cfg: Config, request: JudgeRequest, prompt: judge_prompt.PlainPrompt
) -> list[dict[str, str]]:
    """The ``plain`` prompt's system and user messages. Without ``use_principle`` the judging
    instruction is ``default_principle``: a plain model has none of its own."""
    principle = resolved_principle(cfg, request) or cfg.default_principle
    return prompt.render(request.history, request.response_1, request.response_2, principle)


def responses_body(
    cfg: Config, params: Mapping[str, Any], request: JudgeRequest,
    prompt: judge_prompt.PlainPrompt | None = None,
) -> dict[str, Any]:
    """JSON body of ``POST /v1/responses``: NeMo Gym ``genrm_model`` shape, or with ``prompt``
    the plain messages (and no ``metadata``)."""
    body = dict(params)
    if prompt is not None:
        body["input"] = [
            {"role": m["role"], "content": m["content"], "type": "message"}
            for m in plain_messages(cfg, request, prompt)
        ]
        return body
    metadata = {"response_1": request.response_1, "response_2": request.response_2}
    principle = resolved_principle(cfg, request)
    if principle is not None:
        metadata["principle"] = principle
    body["input"] = [
        {"role": m.get("role", "user"), "content": m.get("content", ""), "type": "message"}
        for m in request.history
    ]
    body["metadata"] = metadata
    return body


def chat_body(
    cfg: Config, params: Mapping[str, Any], request: JudgeRequest,
    prompt: judge_prompt.PlainPrompt | None = None,
) -> dict[str, Any]:
    """JSON body of ``POST /v1/chat/completions``: GenRM roles, or with ``prompt`` the plain
    messages. ``max_output_tokens`` becomes ``max_tokens``."""
    if prompt is not None:
        messages = plain_messages(cfg, request, prompt)
    else:
        messages = [
            {"role": m.get("role", "user"), "content": m.get("content", "")}
            for m in request.history
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


def structured_output(api: str, kind: str) -> tuple[str, dict[str, Any]] | None:
    """The body key and value asking ``api`` for a schema-shaped verdict (None for ``none``)."""
    if kind == "none":
        return None
    schema = judge_prompt.verdict_schema()
    name = judge_prompt.VERDICT_SCHEMA_NAME
    if api == "chat":
        if kind == "json_schema":
            return "response_format", {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": True},
            }
        return "response_format", {"type": "json_object", "schema": schema}
    if kind == "json_schema":
        return "text", {
            "format": {"type": "json_schema", "name": name, "schema": schema, "strict": True}
        }
    return "text", {"format": {"type": "json_object"}}


def content_seed(cfg: Config, request: JudgeRequest, attempt: int) -> int:
    """A sampling seed from what is judged: the conversation, the principle sent, both answers,
    which judge pass this is, and the attempt number. The same pair judged again asks for the
    same samples; a retry asks for a different one (a seeded server would otherwise repeat an
    unparseable answer)."""
    material = msgspec.json.encode([
        request.history, resolved_principle(cfg, request), request.response_1,
        request.response_2, request.judge_idx, attempt,
    ])
    return int.from_bytes(hashlib.sha256(material).digest()[:4], "big") & _SEED_MASK


class BodyBuilder:
    """Builds every attempt's body for one configuration (chosen once, at open)."""

    def __init__(self, cfg: Config, prompt: judge_prompt.PlainPrompt | None) -> None:
        self._cfg = cfg
        self._params = base_params(cfg)
        self._prompt = prompt if cfg.judge.prompt == "plain" else None
        self._build = responses_body if cfg.judge.api == "responses" else chat_body
        self._structured = structured_output(cfg.judge.api, cfg.judge.structured_output)

    def build(self, request: JudgeRequest, attempt: int) -> dict[str, Any]:
        """The JSON body of attempt ``attempt`` (0-based) of ``request``."""
        body = self._build(self._cfg, self._params, request, self._prompt)
        if self._structured is not None:
            key, value = self._structured
            body[key] = value
        if self._cfg.judge.seed == "content":
            body["seed"] = content_seed(self._cfg, request, attempt)
        return body
