"""The mock judge's answers: a deterministic verdict (the heuristic judge, or a hash of a plain
prompt), shaped as the request asked (structured output, the token budget) and wrapped in the
API's response object."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from genrm_trio import scoring
from genrm_trio.mock.faults import GARBAGE_TEXT, NONFINITE_TEXT, POISON_TEXT, Fault
from genrm_trio.mock.http import RESPONSES_PATH, json_encode
from genrm_trio.mock.inputs import JudgeInput
from genrm_trio.openai_shapes import chat_completion, output_message, responses_object


def _hash_verdict(text: str) -> scoring.Verdict:
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return scoring.Verdict(1.0 + digest[0] % 5, 1.0 + digest[1] % 5, 1.0 + digest[2] % 6)


def _on_enum(value: float, prop: Any) -> float:
    """``value`` moved to the nearest member of the property's ``enum`` (ties: the lower)."""
    enum = prop.get("enum") if isinstance(prop, dict) else None
    choices = [v for v in enum if isinstance(v, int | float) and not isinstance(v, bool)] \
        if isinstance(enum, list) else []
    if not choices or value in choices:
        return value
    return float(min(choices, key=lambda c: (abs(c - value), c)))


def _structured_text(verdict: scoring.Verdict, output_format: dict[str, Any]) -> str:
    """The verdict as the bare JSON a constrained decoder would emit."""
    schema = output_format.get("schema")
    props = schema.get("properties") if isinstance(schema, dict) else None
    props = props if isinstance(props, dict) else {}
    values = {}
    for key in ("score_1", "score_2", "ranking"):
        value = _on_enum(getattr(verdict, key), props.get(key))
        values[key] = int(value) if float(value).is_integer() else value
    return json_encode(values).decode()


def _answer_text(fault: Fault, judged: JudgeInput) -> str:
    if fault is Fault.GARBAGE:
        return GARBAGE_TEXT
    if fault is Fault.EMPTY:
        return ""
    if fault is Fault.NONFINITE:
        return NONFINITE_TEXT
    if fault.value in POISON_TEXT:
        return POISON_TEXT[fault.value]
    if judged.plain_prompt is not None:
        verdict = _hash_verdict(judged.plain_prompt)
        text = ("```json\n" + json_encode({"score_1": int(verdict.score_1),
                "score_2": int(verdict.score_2), "ranking": int(verdict.ranking)}).decode()
                + "\n```")
    else:
        text = scoring.heuristic_judge_text(
            judged.history, judged.response_1, judged.response_2, judged.principle
        )
    if judged.output_format is not None:
        text = _structured_text(scoring.parse_judge_output(text, 3.0, 3.5), judged.output_format)
    if fault is Fault.INCOMPLETE:
        # Output cut by the token limit: the verdict never closes.
        return text[: max(1, len(text) // 3)]
    return text


def _tokens(text: str) -> int:
    return len(text) // 4 + 1


def answer_text(fault: Fault, judged: JudgeInput) -> tuple[str, bool]:
    """The answer's text and whether it stops short (``incomplete``): an ``incomplete`` fault,
    or an answer longer than the request's output budget, cut there as a server does."""
    text = _answer_text(fault, judged)
    incomplete = fault is Fault.INCOMPLETE
    if judged.max_tokens is not None and _tokens(text) > judged.max_tokens:
        # The output budget ran out: what fits, and the server says it stopped for length.
        text = text[: max(0, judged.max_tokens * 4 - 1)]
        incomplete = True
    return text, incomplete


def output_tokens(text: str) -> int:
    """Output tokens the mock charges for an answer text (4 characters a token, plus one)."""
    return _tokens(text)


def answer_body(
    path: str, answer: tuple[str, bool], judged: JudgeInput, call_no: int,
    prompt_tokens: int, cached_tokens: int = 0, cache_report: str = "usage",
) -> bytes:
    """The API's answer object for ``answer`` (from :func:`answer_text`), its ``usage`` saying
    ``prompt_tokens`` of which ``cached_tokens`` came from the prefix cache, reported as
    ``cache_report`` asks (``usage``, ``timings``, ``both``, ``none``)."""
    text, incomplete = answer
    status = "incomplete" if incomplete else "completed"
    out_tokens = _tokens(text)
    now = int(time.time())
    in_usage = cache_report in ("usage", "both")
    timings = None
    if cache_report in ("timings", "both"):
        # llama.cpp's server: prompt_n tokens computed, cache_n reused from its slot's cache.
        timings = {"cache_n": cached_tokens, "prompt_n": prompt_tokens - cached_tokens,
                   "predicted_n": out_tokens}
    if path == RESPONSES_PATH:
        body = responses_object(
            ident=f"resp_mock_{call_no:08d}", model=judged.model, created_at=now,
            status=status, output=[output_message(f"msg_mock_{call_no:08d}", text, status)],
            input_tokens=prompt_tokens, output_tokens=out_tokens,
            input_tokens_details={"cached_tokens": cached_tokens if in_usage else 0},
        )
    else:
        body = chat_completion(
            ident=f"chatcmpl-mock-{call_no:08d}", model=judged.model, created=now, text=text,
            finish_reason="length" if incomplete else "stop", prompt_tokens=prompt_tokens,
            completion_tokens=out_tokens,
        )
        if in_usage:
            body["usage"]["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if timings is not None:
        body["timings"] = timings
    return json_encode(body)
