"""Answer parsing: the verdict text out of a judge's JSON answer, per API.

Pure functions; an answer that cannot be a verdict raises :class:`~.attempt.AttemptFailed`,
which the retry loop retries within the comparison's budget: ``truncated`` for an answer cut
by the output budget (chat ``finish_reason: length``, responses ``status: incomplete``; such
an answer is never parsed, whatever it holds), ``unusable`` for the rest.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from genrm_trio.server.judge.attempt import AttemptFailed

#: Longest snippet of a judge's error body carried into failure reasons.
ERROR_SNIPPET_CHARS = 200

_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def _truncated(detail: str) -> AttemptFailed:
    return AttemptFailed("truncated", f"output budget exhausted ({detail})")


def _responses_status(body: dict[str, Any]) -> None:
    status = body.get("status")
    if status is None or status == "completed":
        return
    if status == "incomplete":
        details = body.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        if reason in (None, "max_output_tokens", "max_tokens", "length"):
            raise _truncated("status incomplete" + (f": {reason}" if reason else ""))
        raise AttemptFailed("unusable", f"unusable answer: status incomplete: {str(reason)[:40]!r}")
    raise AttemptFailed("unusable", f"unusable answer: status {str(status)[:40]!r}")


def responses_answer(body: Any) -> str:
    """Answer text of a Responses API body; raises :class:`AttemptFailed` when unusable."""
    if not isinstance(body, dict):
        raise AttemptFailed("unusable", "unusable answer: body is not a JSON object")
    _responses_status(body)
    parts: list[str] = []
    output = body.get("output")
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        content = item.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "output_text":
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
    return non_blank("".join(parts))


def chat_answer(body: Any) -> str:
    """Answer text of a chat completions body; raises :class:`AttemptFailed` when unusable."""
    if not isinstance(body, dict):
        raise AttemptFailed("unusable", "unusable answer: body is not a JSON object")
    _responses_status(body)  # not OpenAI's chat shape, but some servers add it
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise AttemptFailed("unusable", "unusable answer: no choices")
    if choices[0].get("finish_reason") == "length":
        raise _truncated("finish_reason length")
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        content = "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return non_blank(content if isinstance(content, str) else "")


_MAX_TOKENS = 2**53  # a count beyond this is not a count


def _count(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_TOKENS:
        return value
    return 0


def usage_of(body: Any) -> tuple[int, int]:
    """``(input, output)`` tokens of an answer's ``usage`` (Responses: ``input_tokens`` and
    ``output_tokens``; chat: ``prompt_tokens`` and ``completion_tokens``); 0 for what is missing
    or not a plain non-negative integer. Never raises."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    if "input_tokens" in usage or "output_tokens" in usage:
        return _count(usage.get("input_tokens")), _count(usage.get("output_tokens"))
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def cached_of(body: Any) -> tuple[int, int]:
    """``(cached, prompt)`` tokens of an answer as the judge server reports them: cached from
    ``usage.prompt_tokens_details.cached_tokens`` (chat: OpenAI, vLLM with
    ``--enable-prompt-tokens-details``, SGLang with ``--enable-cache-report``) or
    ``usage.input_tokens_details.cached_tokens`` (Responses), else llama.cpp server's
    ``timings.cache_n``; prompt from llama.cpp's ``timings`` (``cache_n + prompt_n``: computed
    plus reused), 0 without them. 0 for what is missing or not a count. Never raises."""
    cached = 0
    usage = body.get("usage") if isinstance(body, dict) else None
    if isinstance(usage, dict):
        for key in ("prompt_tokens_details", "input_tokens_details"):
            details = usage.get(key)
            if isinstance(details, dict) and "cached_tokens" in details:
                cached = _count(details.get("cached_tokens"))
                break
    timings = body.get("timings") if isinstance(body, dict) else None
    prompt = 0
    if isinstance(timings, dict):
        cache_n = _count(timings.get("cache_n"))
        prompt = cache_n + _count(timings.get("prompt_n"))
        cached = cached or cache_n
    return cached, prompt


def engine_of(body: Any) -> str | None:
    """The ``judge.engine`` an answer shows its server to be, None when it does not tell:
    ``llama_cpp`` for llama.cpp's server, the one OpenAI-compatible server that puts its own
    ``timings`` object (``prompt_n``, ``prompt_ms``, ``predicted_n``, ... and ``cache_n``)
    beside ``usage`` in every answer. vLLM and SGLang answer in OpenAI's shape alone, and
    ``unknown`` already follows the rule that suits them until an endpoint is shown not to
    share (endpoints.py), so nothing is read for them. Never raises."""
    timings = body.get("timings") if isinstance(body, dict) else None
    if isinstance(timings, dict) and "prompt_n" in timings:
        return "llama_cpp"
    return None


def non_blank(text: str) -> str:
    """``text`` itself; raises :class:`AttemptFailed` when it is blank."""
    if not text.strip():
        raise AttemptFailed("unusable", "unusable answer: blank answer text")
    return text


def error_snippet(content: bytes, limit: int = ERROR_SNIPPET_CHARS) -> str:
    """A short, single-line excerpt of a judge's error body, for failure reasons.

    The OpenAI-style ``{"error": {"message": ...}}`` (or ``{"detail": ...}``, ``{"message":
    ...}``) message when the body has one, else the body's text; control characters become
    spaces; at most ``limit`` characters. The caller still redacts secrets. Never raises.
    """
    head = content[: limit * 8]
    text: str | None = None
    try:
        decoded = msgspec.json.decode(head)
    except msgspec.DecodeError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
        for candidate in (
            error.get("message") if isinstance(error, dict) else error,
            decoded.get("detail"),
            decoded.get("message"),
        ):
            if isinstance(candidate, str) and candidate.strip():
                text = candidate
                break
    if text is None:
        text = head.decode("utf-8", "replace")
    text = _CONTROL.sub(" ", text).strip()
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text
