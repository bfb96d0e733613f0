"""What a judge call asks, read from a Responses or Chat Completions body: the comparison, the
model, the output budget and the structured-output format; the GenRM roles or a plain prompt."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from genrm_trio import scoring
from genrm_trio.mock.prefix_cache import render_prompt
from genrm_trio.mock.settings import MockJudgeSettings


class BadJudgeRequest(Exception):
    """The judge request body is not what either API expects (answered with ``status``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        self.status = status
        super().__init__(message)


class JudgeInput(msgspec.Struct, frozen=True):
    """What a judge call asks: the comparison, the model, the output budget (tokens, None:
    unlimited) and the structured-output format (None: free text). ``prompt``: the prompt as
    the engine would tokenize it (:func:`~genrm_trio.mock.prefix_cache.render_prompt`)."""

    history: list[dict[str, str]]
    response_1: str
    response_2: str
    principle: str | None
    model: str
    max_tokens: int | None = None
    output_format: dict[str, Any] | None = None
    plain_prompt: str | None = None  # a request without GenRM roles: its whole prompt text
    prompt: bytes = b""


_STANDARD_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
_GENRM_ROLES = ("principle", "response_1", "response_2")
_PLAIN_SECTION = re.compile(r"<(response_1|response_2|conversation)>\n?(.*?)\n?</\1>", re.DOTALL)


def _text_of(content: Any) -> str:
    """Message content as text: a string, or the concatenated text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) and model else "mock-genrm"


def _max_tokens(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadJudgeRequest(f"{key} must be a positive integer")
    return value


def _format_spec(fmt: Any, where: str, settings: MockJudgeSettings) -> dict[str, Any] | None:
    """Check a structured-output request; return ``{"type": ..., "schema": ...|None}`` or None
    for free text. ``where`` names the field in errors."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadJudgeRequest(f"{where} must be an object with a type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise BadJudgeRequest(f"{where}.schema must be an object")
        return {"type": kind, "schema": schema}
    if kind == "json_schema":
        if not settings.accept_json_schema:
            raise BadJudgeRequest(
                f"{where}.type: input should be 'text' or 'json_object'", status=500)
        # chat nests {name, schema} under json_schema; responses puts them beside type
        spec = fmt.get("json_schema") if where == "response_format" else fmt
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise BadJudgeRequest(f"{where} of type json_schema needs a name")
        if not isinstance(spec.get("schema"), dict):
            raise BadJudgeRequest(f"{where} of type json_schema needs a schema object")
        return {"type": kind, "schema": spec["schema"]}
    raise BadJudgeRequest(f"{where}.type {kind!r} is not supported")


def _refuse_roles(roles: list[str]) -> None:
    raise BadJudgeRequest(
        f"Invalid role(s) in messages: {', '.join(sorted(set(roles)))}; expected one of "
        "system, user, assistant, developer, tool", status=500)


def _plain_input(messages: list[dict[str, str]], body: dict[str, Any],
                 max_tokens: int | None, output_format: dict[str, Any] | None) -> JudgeInput:
    """A plain prompt: the answers from its tagged sections when it has them."""
    text = "\n".join(m["content"] for m in messages)
    sections = {m.group(1): m.group(2) for m in _PLAIN_SECTION.finditer(text)}
    conversation = sections.get("conversation", text)
    return JudgeInput(
        [{"role": "user", "content": conversation}], sections.get("response_1", ""),
        sections.get("response_2", ""), None, _model_of(body), max_tokens, output_format,
        plain_prompt=None if "response_1" in sections and "response_2" in sections else text,
        prompt=render_prompt((m["role"], m["content"]) for m in messages),
    )


def responses_input(body: Any, settings: MockJudgeSettings) -> JudgeInput:
    if not isinstance(body, dict):
        raise BadJudgeRequest("body must be a JSON object")
    max_tokens = _max_tokens(body, "max_output_tokens")
    text_field = body.get("text")
    if text_field is not None and not isinstance(text_field, dict):
        raise BadJudgeRequest("text must be an object")
    output_format = _format_spec((text_field or {}).get("format"), "text.format", settings)
    raw_input = body.get("input")
    items = raw_input if isinstance(raw_input, list) else []
    roles = [str(i.get("role")) for i in items if isinstance(i, dict) and "role" in i]
    metadata = body.get("metadata")
    genrm = isinstance(metadata, dict) and (
        "response_1" in metadata or "response_2" in metadata)
    if settings.roles == "standard":
        bad = [r for r in roles if r not in _STANDARD_ROLES]
        if genrm:
            bad += ["response_1", "response_2"]  # what a model server would turn them into
        if bad:
            _refuse_roles(bad)
    if not genrm:
        if metadata is not None and not isinstance(metadata, dict):
            raise BadJudgeRequest("metadata must be an object")
        messages = scoring.conversation_history(raw_input)
        if not messages:
            raise BadJudgeRequest("input must hold the prompt's messages")
        return _plain_input(messages, body, max_tokens, output_format)
    assert isinstance(metadata, dict)
    r1, r2 = metadata.get("response_1"), metadata.get("response_2")
    if not isinstance(r1, str) or not isinstance(r2, str):
        raise BadJudgeRequest("metadata.response_1 and metadata.response_2 must be strings")
    principle = metadata.get("principle")
    if principle is not None and not isinstance(principle, str):
        raise BadJudgeRequest("metadata.principle must be a string")
    history = scoring.conversation_history(raw_input)
    tail = [("principle", principle)] if principle is not None else []
    tail += [("response_1", r1), ("response_2", r2)]
    rendered = render_prompt([*((m["role"], m["content"]) for m in history), *tail])
    return JudgeInput(history, r1, r2, principle, _model_of(body), max_tokens, output_format,
                      prompt=rendered)


def chat_input(body: Any, settings: MockJudgeSettings) -> JudgeInput:
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise BadJudgeRequest("body must be a JSON object with a messages list")
    max_tokens = _max_tokens(body, "max_tokens")
    output_format = _format_spec(body.get("response_format"), "response_format", settings)
    history: list[dict[str, str]] = []
    special: dict[str, str] = {}
    roles: list[str] = []
    in_order: list[tuple[str, str]] = []
    for message in body["messages"]:
        if not isinstance(message, dict):
            raise BadJudgeRequest("every message must be an object")
        role = message.get("role")
        role = role if isinstance(role, str) else "user"
        roles.append(role)
        text = _text_of(message.get("content"))
        in_order.append((role, text))
        if role in _GENRM_ROLES:
            special[role] = text
        else:
            history.append({"role": role, "content": text})
    if settings.roles == "standard":
        bad = [r for r in roles if r not in _STANDARD_ROLES]
        if bad:
            _refuse_roles(bad)
    if not special:
        if not history:
            raise BadJudgeRequest("messages must not be empty")
        return _plain_input(history, body, max_tokens, output_format)
    if "response_1" not in special or "response_2" not in special:
        raise BadJudgeRequest("messages need a response_1 and a response_2 role")
    return JudgeInput(
        history,
        special["response_1"],
        special["response_2"],
        special.get("principle"),
        _model_of(body),
        max_tokens,
        output_format,
        prompt=render_prompt(in_order),
    )
