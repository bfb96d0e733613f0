"""The OpenAI answer objects the mock judge and the mock policy send: one Responses object and
one chat completion, built in one place so both mocks speak exactly the same dialect."""

from __future__ import annotations

from typing import Any


def output_message(ident: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A Responses ``message`` output item holding ``text`` as one ``output_text`` part."""
    return {
        "type": "message",
        "role": "assistant",
        "id": ident,
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def responses_object(
    *, ident: str, model: str, created_at: int, status: str, output: list[dict[str, Any]],
    input_tokens: int, output_tokens: int, **usage_extra: Any,
) -> dict[str, Any]:
    """A ``/v1/responses`` answer. ``status`` other than ``completed`` adds the
    ``incomplete_details`` a length cut-off reports. ``usage`` carries both token detail objects
    OpenAI's schema requires (clients that validate it, such as NeMo Gym's model servers, reject
    a usage without them); ``usage_extra`` overrides them."""
    return {
        "id": ident,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "incomplete_details": (
            None if status == "completed" else {"reason": "max_output_tokens"}
        ),
        "error": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
            **usage_extra,
        },
    }


def chat_completion(
    *, ident: str, model: str, created: int, text: str, finish_reason: str,
    prompt_tokens: int, completion_tokens: int,
) -> dict[str, Any]:
    """A ``/v1/chat/completions`` answer with one choice."""
    return {
        "id": ident,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
