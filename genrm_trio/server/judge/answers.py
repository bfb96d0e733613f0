"""Answer parsing: the verdict text out of a judge's JSON answer, per API.

Pure functions; an answer that cannot be a verdict raises :class:`~.attempt.AttemptFailed`
(``unusable``), which the retry loop retries within the comparison's budget.
"""

from __future__ import annotations

from typing import Any

from genrm_trio.server.judge.attempt import AttemptFailed


def responses_answer(body: Any) -> str:
    """Answer text of a Responses API body; raises :class:`AttemptFailed` when unusable."""
    if not isinstance(body, dict):
        raise AttemptFailed("unusable", "unusable answer: body is not a JSON object")
    status = body.get("status")
    if status is not None and status != "completed":
        raise AttemptFailed("unusable", f"unusable answer: status {str(status)[:40]!r}")
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
    status = body.get("status")
    if status is not None and status != "completed":
        raise AttemptFailed("unusable", f"unusable answer: status {str(status)[:40]!r}")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise AttemptFailed("unusable", "unusable answer: no choices")
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        content = "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return non_blank(content if isinstance(content, str) else "")


def non_blank(text: str) -> str:
    """``text`` itself; raises :class:`AttemptFailed` when it is blank."""
    if not text.strip():
        raise AttemptFailed("unusable", "unusable answer: blank answer text")
    return text
