"""The judge client: protocols, retry budget, deadlines, endpoints, limiter, plugins.

All HTTP goes through ``httpx2.MockTransport``; all time is trio's autojump clock, so every
elapsed time below is virtual and asserted exactly.
"""

from __future__ import annotations

import json
import random
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from genrm_trio import scoring
from genrm_trio.config import Config, JudgeConfig
from genrm_trio.errors import ConfigError, JudgeFailed
from genrm_trio.judge_prompt import verdict_schema
from genrm_trio.server.judge import (
    CLOSE_BOUND_S,
    MAX_HINT_S,
    Judge,
    JudgeRequest,
    chat_body,
    open_judge,
    parse_retry_after,
    responses_body,
)
from genrm_trio.server.judge.answers import cached_of, usage_of

VERDICT_TEXT = 'thinking...\n```json\n{"score_1": 4, "score_2": 2, "ranking": 2}\n```'
VERDICT = scoring.Verdict(4.0, 2.0, 2.0)
DEFAULT_VERDICT = scoring.Verdict(3.0, 3.0, 3.5, defaulted=True)
URL_A = "http://judge-a.test"
URL_B = "http://judge-b.test"
HISTORY = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "2+2?"}]
REQUEST = JudgeRequest(history=HISTORY, response_1="4", response_2="five", principle=None)

Handler = Callable[[httpx2.Request], Coroutine[None, None, httpx2.Response]]


class MaxRng(random.Random):
    """Full jitter always drawing its upper bound, so backoff times are exact."""

    def uniform(self, a: float, b: float) -> float:
        return b


def make_cfg(judge: dict[str, Any] | None = None, **top: Any) -> Config:
    judge_kw: dict[str, Any] = {"base_urls": (URL_A,)}
    judge_kw.update(judge or {})
    return Config(judge=JudgeConfig(**judge_kw), **top)


def responses_ok(text: str = VERDICT_TEXT, status: str | None = "completed") -> httpx2.Response:
    body: dict[str, Any] = {
        "id": "resp_1",
        "object": "response",
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text[:5]}]
                + [{"type": "output_text", "text": text[5:]}],
            },
        ],
    }
    if status is not None:
        body["status"] = status
    return httpx2.Response(200, json=body)


def chat_ok(text: str = VERDICT_TEXT, finish_reason: str | None = "stop") -> httpx2.Response:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    if finish_reason is not None:
        choice["finish_reason"] = finish_reason
    return httpx2.Response(200, json={"choices": [choice]})


class Script:
    """A mock judge playing a list of steps, one per call, recording what it was sent."""

    def __init__(self, *steps: Any) -> None:
        self.steps = list(steps)
        self.requests: list[httpx2.Request] = []
        self.times: list[float] = []

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        self.times.append(trio.current_time())
        step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        if isinstance(step, Exception):
            raise step
        if callable(step):
            result: httpx2.Response = await step(request)
            return result
        assert isinstance(step, httpx2.Response)
        # A Response object can only be read once; hand out a fresh copy every call.
        return httpx2.Response(step.status_code, headers=step.headers, content=step.content)

    @property
    def calls(self) -> int:
        return len(self.requests)

    def json(self, i: int = 0) -> Any:
        return json.loads(self.requests[i].content)


class CloseCounting(httpx2.MockTransport):
    def __init__(self, handler: Handler) -> None:
        super().__init__(handler)
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


class BrokenStream(httpx2.AsyncByteStream):
    """A body that delivers a first chunk, then the connection breaks."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'{"status": "compl'
        raise httpx2.ReadError("connection reset by peer")


class TricklingStream(httpx2.AsyncByteStream):
    """A body that never ends: one byte a second (each read is fast, the whole is endless)."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"{"
        while True:
            await trio.sleep(1.0)
            yield b" "


async def hang(request: httpx2.Request) -> httpx2.Response:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def broken_body(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(200, stream=BrokenStream())


async def trickling_body(request: httpx2.Request) -> httpx2.Response:
    return httpx2.Response(200, stream=TricklingStream())


def transport(handler: Handler) -> httpx2.MockTransport:
    return httpx2.MockTransport(handler)


# ---------------------------------------------------------------------------------------------
# Retry budget


TRANSIENT_STEPS = {
    "connect_error": httpx2.ConnectError("connection refused"),
    "truncated_body": httpx2.RemoteProtocolError("peer closed connection mid-body"),
    "interrupted_body": broken_body,
    "http_408": httpx2.Response(408),
    "http_429": httpx2.Response(429),
    "http_500": httpx2.Response(500),
    "http_502": httpx2.Response(502),
    "http_503": httpx2.Response(503),
    "http_504": httpx2.Response(504),
    "status_incomplete": responses_ok(status="incomplete"),
    "blank_answer": responses_ok(text="   "),
    "not_json": httpx2.Response(200, content=b"<html>oops</html>"),
}


@pytest.mark.parametrize("kind", sorted(TRANSIENT_STEPS))
async def test_transient_failure_is_retried_then_succeeds(
    kind: str, autojump_clock: trio.testing.MockClock
) -> None:
    script = Script(TRANSIENT_STEPS[kind], TRANSIENT_STEPS[kind], responses_ok())
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        start = trio.current_time()
        verdict = await judge.judge_pair(REQUEST)
        elapsed = trio.current_time() - start
    assert verdict == VERDICT
    assert script.calls == 3
    assert judge.stats.calls == 3
    assert judge.stats.retries == 2
    assert judge.stats.transient_errors == 2
    # Backoff 0.2 then 0.4 (full jitter at its upper bound).
    assert elapsed == pytest.approx(0.6, abs=1e-9)
    assert script.times == pytest.approx([start, start + 0.2, start + 0.6], abs=1e-9)


async def test_budget_exhausted_fails_with_last_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(httpx2.Response(503))
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
        assert trio.current_time() == pytest.approx(0.2 + 0.4 + 0.8, abs=1e-9)
    assert str(info.value) == (
        "no completed answer after 4 attempts: judge http://judge-a.test/v1/responses: HTTP 503"
    )
    assert script.calls == 4 == judge.stats.calls
    assert judge.stats.retries == 3
    assert judge.stats.failures_by_reason == {"http_503": 4}
    assert judge.stats.comparisons_failed == 1


async def test_budget_follows_genrm_parse_retries(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(httpx2.ConnectError("refused"))
    cfg = make_cfg(genrm_parse_retries=0)
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed, match="after 1 attempts: .*ConnectError: refused"):
            await judge.judge_pair(REQUEST)
    assert script.calls == 1


@pytest.mark.parametrize("code", [400, 401, 403, 404, 422])
async def test_other_4xx_is_not_retried(code: int, autojump_clock: trio.testing.MockClock) -> None:
    script = Script(httpx2.Response(code, text="model 'x' not found"), responses_ok())
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
        assert trio.current_time() == 0.0
    assert script.calls == 1
    assert str(info.value).startswith(f"judge http://judge-a.test/v1/responses: HTTP {code}")
    assert "model 'x' not found" in str(info.value)


async def test_unparseable_answers_give_default_verdict(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(responses_ok(text="I like the first one."))
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        verdict = await judge.judge_pair(REQUEST)
    assert verdict == DEFAULT_VERDICT
    assert script.calls == 4
    assert judge.stats.parse_failures == 4
    assert judge.stats.defaulted_comparisons == 1
    assert judge.stats.comparisons_failed == 0


async def test_unparseable_policy_mask_fails_instead_of_defaulting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(responses_ok(text="I like the first one."))
    cfg = make_cfg(unparseable_verdict_policy="mask")
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
    assert str(info.value) == (
        "no parseable verdict after 4 attempts (unparseable_verdict_policy: mask): "
        "unparseable answer: no JSON object in judge answer")
    assert script.calls == 4
    assert judge.stats.defaulted_comparisons == 0
    assert judge.stats.comparisons_failed == 1


async def test_one_usable_answer_among_failures_gives_default_verdict(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(
        httpx2.Response(503),
        responses_ok(text="no json here"),
        responses_ok(status="failed"),
        httpx2.ConnectError("refused"),
    )
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        assert await judge.judge_pair(REQUEST) == DEFAULT_VERDICT
    assert script.calls == 4


async def test_unusable_answers_only_fail(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(responses_ok(status="incomplete"), responses_ok(text=""))
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
    assert str(info.value) == (
        "no completed answer after 4 attempts (1 cut by the token limit: raise "
        "genrm_responses_create_params.max_output_tokens, now 16384): judge "
        "http://judge-a.test/v1/responses: unusable answer: blank answer text")
    assert script.calls == 4
    assert judge.stats.unusable_answers == 3
    assert judge.stats.truncated_answers == 1


async def test_parse_failure_then_success(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(responses_ok(text="{broken"), responses_ok())
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        assert await judge.judge_pair(REQUEST) == VERDICT
    assert script.calls == 2
    assert judge.stats.parse_failures == 1


# ---------------------------------------------------------------------------------------------
# Truncation and the judge's own error text


async def test_chat_answer_cut_by_the_token_limit_is_retried_never_parsed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A complete-looking verdict in a truncated answer is still no verdict.
    script = Script(chat_ok(text='{"score_1": 1, "score_2": 5, "ranking": 6}',
                            finish_reason="length"), chat_ok())
    async with open_judge(make_cfg({"api": "chat"}), transport=transport(script),
                          rng=MaxRng()) as judge:
        assert await judge.judge_pair(REQUEST) == VERDICT
    assert script.calls == 2
    assert judge.stats.truncated_answers == 1
    assert judge.stats.failures_by_reason == {"truncated": 1}


@pytest.mark.parametrize(("api", "answer", "params", "key"), [
    ("chat", chat_ok(finish_reason="length"), {"max_output_tokens": 64},
     "genrm_responses_create_params.max_output_tokens = 64"),
    ("chat", chat_ok(finish_reason="length"), {"max_tokens": 32},
     "genrm_responses_create_params.max_tokens = 32"),
    ("responses", responses_ok(status="incomplete"), {"max_output_tokens": 128},
     "genrm_responses_create_params.max_output_tokens = 128"),
])
async def test_budget_exhausted_by_truncation_says_so_and_names_the_key(
    api: str, answer: httpx2.Response, params: dict[str, Any], key: str,
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(answer)
    cfg = make_cfg({"api": api}, genrm_responses_create_params=params)
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
    message = str(info.value)
    assert message == (f"judge output budget exhausted: all 4 attempts were cut by the token "
                       f"limit ({key}); raise {key.split(' = ')[0]}")
    assert script.calls == 4
    assert judge.stats.defaulted_comparisons == 0


async def test_incomplete_for_another_reason_is_unusable_not_truncated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = responses_ok(status="incomplete").json()
    body["incomplete_details"] = {"reason": "content_filter"}
    script = Script(httpx2.Response(200, json=body))
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed, match="no completed answer after 4 attempts: .*"
                                              "content_filter"):
            await judge.judge_pair(REQUEST)
    assert judge.stats.truncated_answers == 0
    assert judge.stats.unusable_answers == 4


async def test_failure_reason_carries_the_judges_error_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    error = {"error": {"message": "Invalid role 'response_1': expected system, user or "
                                  "assistant", "type": "invalid_request_error", "code": 500}}
    script = Script(httpx2.Response(500, json=error))
    async with open_judge(make_cfg({"api": "chat"}), transport=transport(script),
                          rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
    assert str(info.value) == (
        "no completed answer after 4 attempts: judge http://judge-a.test/v1/chat/completions: "
        "HTTP 500: Invalid role 'response_1': expected system, user or assistant"
    )


async def test_error_snippet_is_bounded_single_line_and_secret_free(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    monkeypatch.setenv("GENRM_TEST_KEY", "sk-live-123456")
    text = ("upstream said:\n\tAuthorization: Bearer sk-other-token-99 api_key=abc123 "
            "key sk-live-123456 " + "x" * 5000)
    script = Script(httpx2.Response(502, text=text))
    cfg = make_cfg({"api_key_env": "GENRM_TEST_KEY"})
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
    message = str(info.value)
    assert "HTTP 502: upstream said: Authorization: Bearer *** api_key=*** key ***" in message
    for secret in ("sk-live-123456", "sk-other-token-99", "abc123", "\n", "\t"):
        assert secret not in message
    assert len(message) <= 600
    assert message.count("x") <= 200


# ---------------------------------------------------------------------------------------------
# Backoff and Retry-After


async def test_retry_after_seconds_is_honoured(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(httpx2.Response(429, headers={"Retry-After": "7"}), responses_ok())
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        assert await judge.judge_pair(REQUEST) == VERDICT
    assert script.times == [0.0, 7.0]


async def test_retry_after_below_backoff_does_not_shorten_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(httpx2.Response(503, headers={"Retry-After": "0"}), responses_ok())
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        await judge.judge_pair(REQUEST)
    assert script.times == pytest.approx([0.0, 0.2], abs=1e-9)


def test_parse_retry_after_forms() -> None:
    now = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT
    assert parse_retry_after("12", now) == 12.0
    assert parse_retry_after(" 12\t", now) == 12.0  # whitespace around a field value
    assert parse_retry_after("0", now) == 0.0
    assert parse_retry_after("007", now) == 7.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:50 GMT", now) == 30.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:00:00 GMT", now) == 0.0  # in the past
    assert parse_retry_after("Tuesday, 14-Nov-23 22:13:50 GMT", now) == 30.0  # RFC 850
    assert parse_retry_after("Tue Nov 14 22:13:50 2023", now) == 30.0  # asctime
    assert parse_retry_after("Tue Nov  7 22:13:20 2023", now) == 0.0
    assert parse_retry_after(None, now) is None


@pytest.mark.parametrize("value", [
    "1e3", "+5", "1_0", "-1", "-3", "1.5", " 1.5 ", "nan", "inf", "0x10", "soon", "", "1 2",
    "\u0661\u0662",  # Arabic-Indic digits: str.isdigit() says yes, RFC 9110 says DIGIT is ASCII
    "Tue, 14 Nov 2023 22:13:50 UTC", "Tue, 31 Feb 2023 22:13:50 GMT",
    "Tue, 14 Nov 2023 25:13:50 GMT", "Tue, 14 Nov 99999 22:13:50 GMT",
    "Tue Nov 14 22:13:50 0000", "Tue, 14 Nov 2023 22:13:50 +0000", "14 Nov 2023 22:13:50 GMT",
])
def test_parse_retry_after_rejects_what_rfc_9110_does_not_allow(value: str) -> None:
    assert parse_retry_after(value, 1_700_000_000.0) is None


def test_parse_retry_after_caps_huge_hints() -> None:
    assert parse_retry_after("9" * 5000, 0.0) == MAX_HINT_S
    assert parse_retry_after("1000000000000000", 0.0) == MAX_HINT_S
    assert parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", 0.0) == pytest.approx(253402300799)


@given(st.text(max_size=40))
def test_parse_retry_after_never_raises(value: str) -> None:
    result = parse_retry_after(value, 1_700_000_000.0)
    assert result is None or 0.0 <= result <= MAX_HINT_S


async def test_retry_after_beyond_the_enclosing_deadline_fails_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(httpx2.Response(429, headers={"Retry-After": "100"}), responses_ok())
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        with trio.move_on_after(30.0), pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
        assert trio.current_time() == 0.0
    assert script.calls == 1
    message = str(info.value)
    assert "Retry-After" in message and "100 s" in message and "30.0 s left" in message
    assert "HTTP 429" in message
    assert judge.stats.comparisons_failed == 1
    assert judge.stats.backoff_seconds_sum == 0.0


async def test_retry_after_within_the_deadline_is_waited_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(httpx2.Response(429, headers={"Retry-After": "29"}), responses_ok())
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        with trio.fail_after(30.0):
            assert await judge.judge_pair(REQUEST) == VERDICT
    assert script.times == [0.0, 29.0]
    assert judge.stats.backoff_seconds_sum == 29.0


async def test_backoff_metric_counts_only_completed_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(httpx2.Response(503))
    cfg = make_cfg(genrm_parse_retry_sleep_s=4.0)
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        with trio.move_on_after(6.0):  # waits of 4 s (completed) then 8 s (cut at 2 s)
            await judge.judge_pair(REQUEST)
    assert script.times == [0.0, 4.0]
    assert judge.stats.backoff_seconds_sum == 4.0


class HangingClose(httpx2.MockTransport):
    async def aclose(self) -> None:
        await trio.sleep_forever()


async def test_closing_the_judge_is_bounded_by_a_small_constant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(responses_ok())
    cfg = make_cfg(judge={"transport": "httpx"}, shutdown_grace_s=30.0)
    async with open_judge(cfg, transport=HangingClose(script), rng=MaxRng()) as judge:
        await judge.judge_pair(REQUEST)
        closing_from = trio.current_time()
    assert trio.current_time() - closing_from == CLOSE_BOUND_S == 0.5


async def test_backoff_is_capped(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(httpx2.Response(500))
    cfg = make_cfg(
        genrm_parse_retries=5, genrm_parse_retry_sleep_s=1.0, judge_retry_backoff_max_s=1.5
    )
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed):
            await judge.judge_pair(REQUEST)
    gaps = [b - a for a, b in zip(script.times, script.times[1:], strict=False)]
    assert gaps == [1.0, 1.5, 1.5, 1.5, 1.5]


async def test_backoff_is_jittered_within_bounds(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(httpx2.Response(500))
    cfg = make_cfg(
        genrm_parse_retries=6, genrm_parse_retry_sleep_s=1.0, judge_retry_backoff_max_s=4.0
    )
    async with open_judge(cfg, transport=transport(script), rng=random.Random(7)) as judge:
        with pytest.raises(JudgeFailed):
            await judge.judge_pair(REQUEST)
    gaps = [b - a for a, b in zip(script.times, script.times[1:], strict=False)]
    bounds = [1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert all(0.0 <= g <= b for g, b in zip(gaps, bounds, strict=True))
    assert len(set(gaps)) == len(gaps)  # jittered, not a fixed ladder


# ---------------------------------------------------------------------------------------------
# Deadlines and cancellation


@pytest.mark.parametrize("handler", [hang, trickling_body], ids=["hang", "trickle"])
async def test_per_request_deadline_fails_at_once(
    handler: Handler, autojump_clock: trio.testing.MockClock
) -> None:
    script = Script(handler)
    cfg = make_cfg(judge_request_timeout_s=2.0)
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
        assert trio.current_time() == 2.0
        assert judge.status()["endpoints"][0]["in_flight"] == 0
    assert str(info.value) == "judge request timed out after 2.0 s"
    assert script.calls == 1
    assert judge.stats.failures_by_reason == {"timeout": 1}


async def test_outer_cancel_aborts_call_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    aborted: list[float] = []

    async def slow(request: httpx2.Request) -> httpx2.Response:
        try:
            await trio.sleep_forever()
        finally:
            aborted.append(trio.current_time())
        raise AssertionError("unreachable")

    script = Script(slow)
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        with trio.move_on_after(0.5) as scope:
            await judge.judge_pair(REQUEST)
        assert scope.cancelled_caught
        assert aborted == [0.5]
        status = judge.status()
    assert status["endpoints"][0] == {
        "url": "http://judge-a.test/v1/responses",
        "in_flight": 0,
        "failures": 0,
        "consecutive_failures": 0,
        "cooling_down": False,
        "clients": 1,
        "waiting": 0,
        "max_concurrency": None,
        "input_tokens": 0,
        "output_tokens": 0,
        "cached_tokens": 0,
        "outstanding_tokens": 0,
        # the call was cancelled, never answered: nothing is known of the engine yet, so a
        # duplicate would wait there (judge/endpoints.py prefix_waits)
        "prefix_waits": True,
        "engine": "unknown",
    }
    assert status["limiter"] == {"in_use": 0, "total": 1024, "waiting": 0,
                                 "order": "complete_group"}


async def test_outer_cancel_cuts_backoff(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(httpx2.Response(503), responses_ok())
    cfg = make_cfg(genrm_parse_retry_sleep_s=100.0, judge_retry_backoff_max_s=100.0)
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        with trio.move_on_after(3.0):
            await judge.judge_pair(REQUEST)
        assert trio.current_time() == 3.0
    assert script.calls == 1


# ---------------------------------------------------------------------------------------------
# Request bodies


@pytest.mark.parametrize("use_principle", [False, True])
async def test_responses_request_body(
    use_principle: bool, autojump_clock: trio.testing.MockClock
) -> None:
    script = Script(responses_ok())
    cfg = make_cfg({"model": "genrm-7b"}, use_principle=use_principle)
    request = JudgeRequest(HISTORY, "4", "five", principle="Be correct.")
    async with open_judge(cfg, transport=transport(script)) as judge:
        await judge.judge_pair(request)
    sent = script.requests[0]
    assert sent.method == "POST"
    assert str(sent.url) == "http://judge-a.test/v1/responses"
    assert sent.headers["content-type"] == "application/json"
    assert "authorization" not in sent.headers
    expected: dict[str, Any] = {
        "max_output_tokens": 16384,
        "temperature": 0.6,
        "top_p": 0.95,
        "model": "genrm-7b",
        "input": [
            {"role": "system", "content": "be nice", "type": "message"},
            {"role": "user", "content": "2+2?", "type": "message"},
        ],
        "metadata": {"response_1": "4", "response_2": "five"},
    }
    if use_principle:
        expected["metadata"]["principle"] = "Be correct."
    assert script.json() == expected


async def test_principle_defaults_when_request_has_none() -> None:
    cfg = make_cfg(use_principle=True)
    body = responses_body(cfg, {}, REQUEST)
    assert body["metadata"]["principle"] == cfg.default_principle
    assert "principle" not in responses_body(make_cfg(), {}, REQUEST)["metadata"]


@pytest.mark.parametrize("use_principle", [False, True])
async def test_chat_request_body(
    use_principle: bool, autojump_clock: trio.testing.MockClock
) -> None:
    script = Script(chat_ok())
    cfg = make_cfg(
        {"api": "chat", "base_urls": ("http://vllm.test/",)}, use_principle=use_principle
    )
    request = JudgeRequest(HISTORY, "4", "five", principle="Be correct.")
    async with open_judge(cfg, transport=transport(script)) as judge:
        assert await judge.judge_pair(request) == VERDICT
    assert str(script.requests[0].url) == "http://vllm.test/v1/chat/completions"
    principle = [{"role": "principle", "content": "Be correct."}] if use_principle else []
    assert script.json() == {
        "max_tokens": 16384,
        "temperature": 0.6,
        "top_p": 0.95,
        "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": "2+2?"},
            *principle,
            {"role": "response_1", "content": "4"},
            {"role": "response_2", "content": "five"},
        ],
    }


STANDARD_ROLES = {"system", "user", "assistant"}


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("use_principle", [False, True])
async def test_plain_prompt_sends_only_standard_roles(
    api: str, use_principle: bool, autojump_clock: trio.testing.MockClock
) -> None:
    script = Script(chat_ok() if api == "chat" else responses_ok())
    cfg = make_cfg({"api": api, "prompt": "plain"}, use_principle=use_principle)
    request = JudgeRequest(HISTORY, "4", "five", principle="Be correct.")
    async with open_judge(cfg, transport=transport(script)) as judge:
        assert await judge.judge_pair(request) == VERDICT
    body = script.json()
    messages = body["messages"] if api == "chat" else body["input"]
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "metadata" not in body
    user = messages[1]["content"]
    assert "<response_1>\n4\n</response_1>" in user
    assert "<response_2>\nfive\n</response_2>" in user
    assert "[user]\n2+2?" in user
    # The judging instruction: the request's principle when enabled, else the default one.
    assert user.startswith("Be correct." if use_principle else cfg.default_principle)


async def test_plain_prompt_uses_the_template_file(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    template = tmp_path / "judge.txt"
    template.write_text("A=${response_1} B=${response_2} C=${conversation} P=${principle}",
                        encoding="utf-8")
    script = Script(chat_ok())
    cfg = make_cfg({"api": "chat", "prompt": "plain", "prompt_template_file": str(template)},
                   default_principle="Judge.")
    async with open_judge(cfg, transport=transport(script)) as judge:
        await judge.judge_pair(REQUEST)
    assert script.json()["messages"] == [{"role": "user", "content": (
        "A=4 B=five C=[system]\nbe nice\n\n[user]\n2+2? P=Judge.")}]


@pytest.mark.parametrize(("api", "kind", "key", "shape"), [
    ("chat", "json_schema", "response_format",
     {"type": "json_schema", "json_schema": {"name": "genrm_verdict", "schema": "S",
                                             "strict": True}}),
    ("chat", "json_object", "response_format", {"type": "json_object", "schema": "S"}),
    ("responses", "json_schema", "text",
     {"format": {"type": "json_schema", "name": "genrm_verdict", "schema": "S", "strict": True}}),
    ("responses", "json_object", "text", {"format": {"type": "json_object"}}),
])
async def test_structured_output_forms(
    api: str, kind: str, key: str, shape: dict[str, Any],
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = Script(chat_ok() if api == "chat" else responses_ok())
    cfg = make_cfg({"api": api, "prompt": "plain", "structured_output": kind})
    async with open_judge(cfg, transport=transport(script)) as judge:
        await judge.judge_pair(REQUEST)
    body = script.json()
    expected = json.loads(json.dumps(shape).replace('"S"', json.dumps(verdict_schema())))
    assert body[key] == expected
    other = "text" if key == "response_format" else "response_format"
    assert other not in body


async def test_no_structured_output_and_no_seed_by_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    for api in ("chat", "responses"):
        script = Script(chat_ok() if api == "chat" else responses_ok())
        async with open_judge(make_cfg({"api": api}), transport=transport(script)) as judge:
            await judge.judge_pair(REQUEST)
        assert not {"response_format", "text", "seed"} & set(script.json())


async def test_content_seed_is_stable_per_pair_and_varies_per_attempt_and_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def seeds(request: JudgeRequest, api: str = "chat") -> list[int]:
        ok = chat_ok() if api == "chat" else responses_ok()
        script = Script(httpx2.Response(503), ok)
        cfg = make_cfg({"api": api, "seed": "content"})
        async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
            await judge.judge_pair(request)
        return [script.json(i)["seed"] for i in range(2)]

    first = await seeds(REQUEST)
    assert first == await seeds(REQUEST)  # the same pair asks for the same samples
    assert first[0] != first[1]  # a retry asks for another sample
    assert all(isinstance(s, int) and 0 <= s < 2**31 for s in first)
    second_pass = JudgeRequest(HISTORY, "4", "five", judge_idx=1)
    assert (await seeds(second_pass))[0] != first[0]
    swapped = JudgeRequest(HISTORY, "five", "4")
    assert (await seeds(swapped))[0] != first[0]
    assert await seeds(REQUEST, "responses") == first  # depends on content, not the API


async def test_chat_unusable_answers(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(
        httpx2.Response(200, json={"choices": []}),
        httpx2.Response(200, json={"choices": [{"message": {"content": None}}]}),
        chat_ok(),
    )
    cfg = make_cfg({"api": "chat"})
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        assert await judge.judge_pair(REQUEST) == VERDICT
    assert judge.stats.unusable_answers == 2


def test_chat_body_passes_other_params_through() -> None:
    cfg = make_cfg({"api": "chat"}, genrm_responses_create_params={"temperature": 0.0, "seed": 3})
    assert chat_body(cfg, cfg.genrm_responses_create_params, REQUEST) == {
        "temperature": 0.0,
        "seed": 3,
        "messages": [
            *HISTORY,
            {"role": "response_1", "content": "4"},
            {"role": "response_2", "content": "five"},
        ],
    }


# ---------------------------------------------------------------------------------------------
# Secrets


async def test_api_key_sent_as_bearer_and_never_shown(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    monkeypatch.setenv("GENRM_TEST_KEY", "sk-very-secret")
    echo = httpx2.Response(401, text="bad key sk-very-secret for user")
    script = Script(echo)
    cfg = make_cfg({"api_key_env": "GENRM_TEST_KEY", "base_urls": ("http://u:pw@judge-a.test",)})
    async with open_judge(cfg, transport=transport(script)) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
        status = json.dumps(judge.status())
    assert script.requests[0].headers["authorization"] == "Bearer sk-very-secret"
    assert "sk-very-secret" not in str(info.value)
    assert "pw" not in str(info.value)
    assert "HTTP 401" in str(info.value)
    assert "sk-very-secret" not in status and "pw@" not in status
    assert "sk-very-secret" not in repr(judge.stats)


async def test_missing_api_key_variable_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GENRM_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="judge.api_key_env"):
        async with open_judge(make_cfg({"api_key_env": "GENRM_TEST_KEY"})):
            pass


# ---------------------------------------------------------------------------------------------
# Endpoints, shards, limiter


async def test_concurrent_calls_spread_over_endpoints(
    autojump_clock: trio.testing.MockClock,
) -> None:
    release = trio.Event()
    hosts: list[str] = []

    async def held(request: httpx2.Request) -> httpx2.Response:
        hosts.append(request.url.host)
        await release.wait()
        return responses_ok()

    cfg = make_cfg({"base_urls": (URL_A, URL_B)})
    async with open_judge(cfg, transport=transport(held)) as judge:
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(judge.judge_pair, REQUEST)
            await trio.testing.wait_all_tasks_blocked()
            in_flight = [e["in_flight"] for e in judge.status()["endpoints"]]
            release.set()
    assert in_flight == [3, 3]
    assert sorted(hosts) == ["judge-a.test"] * 3 + ["judge-b.test"] * 3


async def test_failing_endpoint_cools_down(autojump_clock: trio.testing.MockClock) -> None:
    hosts: list[str] = []

    async def a_is_down(request: httpx2.Request) -> httpx2.Response:
        hosts.append(request.url.host[:7])
        if request.url.host == "judge-a.test":
            raise httpx2.ConnectError("refused")
        return responses_ok()

    cfg = make_cfg(
        {"base_urls": (URL_A, URL_B), "endpoint_failure_threshold": 2, "endpoint_cooldown_s": 5.0},
        genrm_parse_retries=0,
    )
    async with open_judge(cfg, transport=transport(a_is_down)) as judge:

        async def one() -> str:
            try:
                await judge.judge_pair(REQUEST)
            except JudgeFailed:
                return "failed"
            return "ok"

        outcomes = [await one() for _ in range(6)]
        status = judge.status()["endpoints"]
        assert status[0]["cooling_down"] and status[0]["consecutive_failures"] == 2
        assert not status[1]["cooling_down"]
        await trio.sleep(5.0)
        assert not judge.status()["endpoints"][0]["cooling_down"]
        outcomes.append(await one())  # A is tried again after the cool-down, and fails
        assert judge.status()["endpoints"][0]["cooling_down"]
        outcomes.append(await one())
    assert hosts == [
        "judge-a",
        "judge-b",
        "judge-a",
        "judge-b",
        "judge-b",
        "judge-b",
        "judge-a",
        "judge-b",
    ]
    assert outcomes == ["failed", "ok", "failed", "ok", "ok", "ok", "failed", "ok"]


async def test_all_endpoints_cooling_uses_the_one_cooling_longest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hosts: list[str] = []

    async def all_down(request: httpx2.Request) -> httpx2.Response:
        hosts.append(request.url.host[:7])
        return httpx2.Response(502)

    cfg = make_cfg(
        {"base_urls": (URL_A, URL_B), "endpoint_failure_threshold": 1, "endpoint_cooldown_s": 60.0},
        genrm_parse_retries=3,
    )
    async with open_judge(cfg, transport=transport(all_down), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed):
            await judge.judge_pair(REQUEST)
        assert all(e["cooling_down"] for e in judge.status()["endpoints"])
    # A fails at 0 (cools), B at 0.2 (cools), then A has cooled longest, then A again.
    assert hosts == ["judge-a", "judge-b", "judge-a", "judge-b"]


async def test_success_resets_consecutive_failures(autojump_clock: trio.testing.MockClock) -> None:
    script = Script(httpx2.Response(503), httpx2.Response(503), responses_ok())
    cfg = make_cfg({"endpoint_failure_threshold": 3})
    async with open_judge(cfg, transport=transport(script), rng=MaxRng()) as judge:
        await judge.judge_pair(REQUEST)
        assert judge.status()["endpoints"][0]["consecutive_failures"] == 0


async def test_limiter_bounds_calls_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    in_flight = 0
    peak = 0

    async def slow(request: httpx2.Request) -> httpx2.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await trio.sleep(1.0)
        in_flight -= 1
        return responses_ok()

    cfg = make_cfg(judge_max_concurrency=3)
    async with open_judge(cfg, transport=transport(slow)) as judge:
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(judge.judge_pair, REQUEST)
            await trio.testing.wait_all_tasks_blocked()
            assert judge.status()["limiter"] == {"in_use": 3, "total": 3, "waiting": 7,
                                                 "order": "complete_group"}
        assert trio.current_time() == 4.0  # ceil(10 / 3) waves of 1 s
    assert peak == 3
    assert judge.stats.calls == 10


async def test_clients_are_sharded_lazily_and_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    release = trio.Event()

    async def held(request: httpx2.Request) -> httpx2.Response:
        await release.wait()
        return responses_ok()

    mock = CloseCounting(held)
    cfg = make_cfg({"max_connections_per_client": 2}, judge_max_concurrency=5)
    async with open_judge(cfg, transport=mock) as judge:
        assert judge.status()["endpoints"][0]["clients"] == 0
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(judge.judge_pair, REQUEST)
            await trio.testing.wait_all_tasks_blocked()
            assert judge.status()["endpoints"][0]["clients"] == 3  # ceil(5 / 2)
            release.set()
        assert mock.closed == 0
    assert mock.closed == 3


async def test_http_status_snapshot(autojump_clock: trio.testing.MockClock) -> None:
    cfg = make_cfg({"base_urls": (URL_A, URL_B)}, judge_max_concurrency=8)
    async with open_judge(cfg, transport=transport(Script(responses_ok()))) as judge:
        assert judge.kind == "http"
        assert judge.status() == {
            "kind": "http",
            "api": "responses",
            "limiter": {"in_use": 0, "total": 8, "waiting": 0, "order": "complete_group"},
            "endpoints": [
                {
                    "url": f"{u}/v1/responses",
                    "in_flight": 0,
                    "failures": 0,
                    "consecutive_failures": 0,
                    "cooling_down": False,
                    "clients": 0,
                    "waiting": 0,
                    "max_concurrency": None,
                    "input_tokens": 0,
                    "output_tokens": 0,
                    "cached_tokens": 0,
                    "outstanding_tokens": 0,
                    "prefix_waits": True,  # nothing answered there yet
                    "engine": "unknown",
                }
                for u in (URL_A, URL_B)
            ],
            "routing": "cohort_affinity",
        }


# ---------------------------------------------------------------------------------------------
# Per-endpoint concurrency


class OneAtATime:
    """A judge endpoint that serves one call at a time (the rest queue inside it), each taking
    ``service_s``."""

    def __init__(self, service_s: float) -> None:
        self.service_s = service_s
        self.lock = trio.Lock()
        self.started: list[float] = []

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        async with self.lock:
            self.started.append(trio.current_time())
            await trio.sleep(self.service_s)
        return chat_ok() if request.url.path.endswith("completions") else responses_ok()


async def judge_three(cfg: Config, handler: OneAtATime) -> list[Any]:
    results: list[Any] = []

    async def one() -> None:
        try:
            results.append(await judge.judge_pair(REQUEST))
        except JudgeFailed as exc:
            results.append(exc)

    async with open_judge(cfg, transport=transport(handler), rng=MaxRng()) as judge:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
            await trio.sleep(0.1)
            snapshot = judge.status()["endpoints"][0]
        results.append(snapshot)
    return results


async def test_calls_queue_on_our_side_when_the_endpoint_is_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler = OneAtATime(1.5)
    cfg = make_cfg({"max_concurrency_per_endpoint": 1}, judge_request_timeout_s=2.0,
                   genrm_parse_retries=0)
    *verdicts, snapshot = await judge_three(cfg, handler)
    assert verdicts == [VERDICT] * 3  # each call's deadline started when it was sent
    assert handler.started == [0.0, 1.5, 3.0]
    assert (snapshot["in_flight"], snapshot["waiting"], snapshot["max_concurrency"]) == (1, 2, 1)


async def test_without_the_limit_the_judges_own_queue_times_calls_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handler = OneAtATime(1.5)
    cfg = make_cfg(judge_request_timeout_s=2.0, genrm_parse_retries=0)
    *results, snapshot = await judge_three(cfg, handler)
    assert sum(isinstance(r, JudgeFailed) for r in results) == 2
    assert (snapshot["in_flight"], snapshot["waiting"], snapshot["max_concurrency"]) == (
        3, 0, None)


async def test_a_retry_prefers_another_endpoint(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[str] = []
    release = trio.Event()

    async def handler(request: httpx2.Request) -> httpx2.Response:
        host = request.url.host
        seen.append(host)
        if len(seen) == 1:
            await release.wait()  # the first call keeps judge-b busy
            return responses_ok()
        if host == "judge-a.test" and seen.count(host) == 1:
            return httpx2.Response(503)
        return responses_ok()

    cfg = make_cfg({"base_urls": (URL_B, URL_A)})
    async with open_judge(cfg, transport=transport(handler), rng=MaxRng()) as judge:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(judge.judge_pair, REQUEST)  # occupies judge-b (listed first)
            await trio.testing.wait_all_tasks_blocked()
            # Least loaded is judge-a; it answers 503. A least-loaded choice would pick judge-a
            # again (judge-b is still busy); the retry goes to judge-b instead.
            assert await judge.judge_pair(REQUEST) == VERDICT
            release.set()
    assert seen == ["judge-b.test", "judge-a.test", "judge-b.test"]


# ---------------------------------------------------------------------------------------------
# Token accounting


def chat_with_usage(prompt: int, completion: int, finish_reason: str = "stop") -> httpx2.Response:
    body = chat_ok(finish_reason=finish_reason).json()
    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion}
    return httpx2.Response(200, json=body)


async def test_usage_is_summed_over_attempts_per_comparison_and_endpoint(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A truncated answer costs its tokens too.
    script = Script(chat_with_usage(10, 100, "length"), chat_with_usage(11, 5))
    async with open_judge(make_cfg({"api": "chat"}), transport=transport(script),
                          rng=MaxRng()) as judge:
        verdict = await judge.judge_pair(REQUEST)
        endpoint = judge.status()["endpoints"][0]
    assert (verdict.input_tokens, verdict.output_tokens) == (21, 105)
    assert (verdict.score_1, verdict.score_2, verdict.ranking) == (4.0, 2.0, 2.0)
    assert (judge.stats.input_tokens, judge.stats.output_tokens) == (21, 105)
    assert (endpoint["input_tokens"], endpoint["output_tokens"]) == (21, 105)


async def test_usage_of_a_failed_comparison_travels_with_its_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = responses_ok(status="incomplete").json()
    body["usage"] = {"input_tokens": 7, "output_tokens": 64, "total_tokens": 71}
    script = Script(httpx2.Response(200, json=body))
    async with open_judge(make_cfg(), transport=transport(script), rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
    assert (info.value.input_tokens, info.value.output_tokens) == (28, 256)
    assert (judge.stats.input_tokens, judge.stats.output_tokens) == (28, 256)


@pytest.mark.parametrize(("usage", "expected"), [
    ({"input_tokens": 3, "output_tokens": 4}, (3, 4)),
    ({"prompt_tokens": 3, "completion_tokens": 4}, (3, 4)),
    ({"input_tokens": -1, "output_tokens": True}, (0, 0)),
    ({"input_tokens": 1.5, "output_tokens": "7"}, (0, 0)),
    ({"input_tokens": 2**60, "output_tokens": None}, (0, 0)),
    ([], (0, 0)),
    (None, (0, 0)),
])
def test_usage_fields_are_read_defensively(usage: Any, expected: tuple[int, int]) -> None:
    assert usage_of({"usage": usage}) == expected


@pytest.mark.parametrize(("body", "expected"), [
    ({"usage": {"prompt_tokens_details": {"cached_tokens": 96}}}, (96, 0)),  # vLLM, SGLang
    ({"usage": {"input_tokens_details": {"cached_tokens": 32}}}, (32, 0)),  # Responses
    ({"timings": {"cache_n": 80, "prompt_n": 20}}, (80, 100)),  # llama.cpp server
    ({"usage": {"prompt_tokens_details": {"cached_tokens": 5}},
      "timings": {"cache_n": 9, "prompt_n": 1}}, (5, 10)),
    ({"usage": {"prompt_tokens_details": None}}, (0, 0)),
    ({"usage": {"prompt_tokens_details": {"cached_tokens": -3}}}, (0, 0)),
    ({"timings": {"cache_n": "many", "prompt_n": True}}, (0, 0)),
    ({"timings": []}, (0, 0)),
    ([], (0, 0)),
])
def test_cached_tokens_are_read_from_each_servers_report(body: Any,
                                                         expected: tuple[int, int]) -> None:
    assert cached_of(body) == expected


async def test_cached_tokens_are_summed_over_attempts_and_travel_with_a_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def cached(n: int, finish: str = "stop") -> httpx2.Response:
        body = chat_with_usage(100, 5, finish).json()
        body["usage"]["prompt_tokens_details"] = {"cached_tokens": n}
        return httpx2.Response(200, json=body)

    script = Script(cached(64, "length"), cached(80))
    async with open_judge(make_cfg({"api": "chat"}), transport=transport(script),
                          rng=MaxRng()) as judge:
        verdict = await judge.judge_pair(REQUEST)
        endpoint = judge.status()["endpoints"][0]
    assert verdict.cached_tokens == 144
    assert judge.stats.cached_tokens == 144 and endpoint["cached_tokens"] == 144
    cut = Script(*[cached(16, "length")] * 4)
    async with open_judge(make_cfg({"api": "chat"}), transport=transport(cut),
                          rng=MaxRng()) as judge:
        with pytest.raises(JudgeFailed) as info:
            await judge.judge_pair(REQUEST)
    assert info.value.cached_tokens == 64


# ---------------------------------------------------------------------------------------------
# Built-in judge and plugins


async def test_builtin_judge(caplog: pytest.LogCaptureFixture) -> None:
    cfg = Config()
    async with open_judge(cfg) as judge:
        verdict = await judge.judge_pair(REQUEST)
        assert judge.status() == {
            "kind": "builtin",
            "api": None,
            "limiter": {"in_use": 0, "total": 1024, "waiting": 0, "order": "complete_group"},
            "endpoints": [],
        }
    expected = scoring.parse_judge_output(
        scoring.heuristic_judge_text(HISTORY, "4", "five", None), 3.0, 3.5
    )
    assert verdict == expected
    assert judge.stats.calls == 1
    assert any("synthetic" in r.getMessage() for r in caplog.records)


def write_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


async def test_trio_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    mod = write_plugin(
        tmp_path,
        monkeypatch,
        "genrm_test_trio_plugin",
        f"""
        import trio
        seen = []
        async def judge(request):
            seen.append(request)
            await trio.sleep(1.0)
            if len(seen) == 1:
                raise RuntimeError("judge backend hiccup")
            return {VERDICT_TEXT!r}
    """,
    )
    cfg = make_cfg({"base_urls": (), "plugin": f"{mod}:judge", "model": "m"}, use_principle=True)
    request = JudgeRequest(HISTORY, "4", "five", principle="P")
    async with open_judge(cfg, rng=MaxRng()) as judge:
        assert await judge.judge_pair(request) == VERDICT
        assert judge.status()["kind"] == "plugin"
    assert trio.current_time() == pytest.approx(2.2, abs=1e-9)
    seen = sys.modules[mod].seen
    assert len(seen) == 2
    assert seen[0] == {
        "history": HISTORY,
        "response_1": "4",
        "response_2": "five",
        "principle": "P",
        "params": {"max_output_tokens": 16384, "temperature": 0.6, "top_p": 0.95, "model": "m"},
    }
    assert judge.stats.failures_by_reason == {"plugin": 1}


async def test_trio_plugin_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    mod = write_plugin(
        tmp_path,
        monkeypatch,
        "genrm_test_slow_plugin",
        """
        import trio
        async def judge(request):
            await trio.sleep_forever()
    """,
    )
    cfg = make_cfg({"base_urls": (), "plugin": f"{mod}:judge"}, judge_request_timeout_s=3.0)
    async with open_judge(cfg) as judge:
        with pytest.raises(JudgeFailed, match=r"^judge request timed out after 3.0 s$"):
            await judge.judge_pair(REQUEST)
        assert trio.current_time() == 3.0


ASYNCIO_PLUGIN = f"""
    import asyncio
    events = []
    async def judge(request):
        asyncio.get_running_loop()  # really on an asyncio loop
        await asyncio.sleep(0.5)
        events.append("answered")
        return {VERDICT_TEXT!r}
    async def forever(request):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
    async def self_cancel(request):
        events.append("self_cancel")
        if events.count("self_cancel") == 1:
            raise asyncio.CancelledError()
        return {VERDICT_TEXT!r}
"""


async def test_asyncio_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    mod = write_plugin(tmp_path, monkeypatch, "genrm_test_aio_plugin_a", ASYNCIO_PLUGIN)
    cfg = make_cfg({"base_urls": (), "plugin": f"{mod}:judge", "plugin_flavor": "asyncio"})
    async with open_judge(cfg) as judge:
        assert await judge.judge_pair(REQUEST) == VERDICT
    assert sys.modules[mod].events == ["answered"]


async def test_asyncio_plugin_cancelled_from_trio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    mod = write_plugin(tmp_path, monkeypatch, "genrm_test_aio_plugin_b", ASYNCIO_PLUGIN)
    cfg = make_cfg({"base_urls": (), "plugin": f"{mod}:forever", "plugin_flavor": "asyncio"})
    async with open_judge(cfg) as judge:
        with trio.move_on_after(1.0) as scope:
            await judge.judge_pair(REQUEST)
        assert scope.cancelled_caught
        assert trio.current_time() == 1.0
        assert sys.modules[mod].events == ["cancelled"]
        assert judge.status()["limiter"]["in_use"] == 0


async def test_asyncio_plugin_request_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    mod = write_plugin(tmp_path, monkeypatch, "genrm_test_aio_plugin_c", ASYNCIO_PLUGIN)
    cfg = make_cfg(
        {"base_urls": (), "plugin": f"{mod}:forever", "plugin_flavor": "asyncio"},
        judge_request_timeout_s=2.0,
    )
    async with open_judge(cfg) as judge:
        with pytest.raises(JudgeFailed, match="timed out after 2.0 s"):
            await judge.judge_pair(REQUEST)
        assert trio.current_time() == 2.0
    assert sys.modules[mod].events == ["cancelled"]


async def test_asyncio_side_cancellation_is_a_transient_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    mod = write_plugin(tmp_path, monkeypatch, "genrm_test_aio_plugin_d", ASYNCIO_PLUGIN)
    cfg = make_cfg({"base_urls": (), "plugin": f"{mod}:self_cancel", "plugin_flavor": "asyncio"})
    async with open_judge(cfg, rng=MaxRng()) as judge:
        assert await judge.judge_pair(REQUEST) == VERDICT
    assert sys.modules[mod].events == ["self_cancel", "self_cancel"]
    assert judge.stats.failures_by_reason == {"plugin": 1}


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("genrm_no_such_module_xyz:judge", "cannot import module"),
        ("json:no_such_function", "no attribute 'no_such_function'"),
        ("json:dumps", "not an async function"),
    ],
)
async def test_bad_plugin_is_a_config_error(spec: str, problem: str) -> None:
    cfg = make_cfg({"base_urls": (), "plugin": spec})
    with pytest.raises(ConfigError, match=problem) as info:
        async with open_judge(cfg):
            pass
    assert info.value.key == "judge.plugin"


def test_judge_request_is_a_frozen_struct() -> None:
    assert msgspec.json.decode(msgspec.json.encode(REQUEST), type=JudgeRequest) == REQUEST
    with pytest.raises(AttributeError):
        REQUEST.response_1 = "x"  # type: ignore[misc]
    assert isinstance(Judge, type)


# ---------------------------------------------------------------------------------------------
# Real loopback sockets (no autojump clock): httpx2 under trio, end to end.


async def serve_one_shot_judge(
    nursery: trio.Nursery, answer_delay_s: float, hung_up: trio.Event
) -> int:
    """A tiny HTTP/1.1 judge on 127.0.0.1:0 answering one request per connection."""
    body = json.dumps(
        {
            "status": "completed",
            "output": [
                {"type": "message", "content": [{"type": "output_text", "text": VERDICT_TEXT}]}
            ],
        }
    ).encode()

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        with trio.move_on_after(answer_delay_s):
            # While "thinking", notice the client hanging up (the call was aborted).
            while await stream.receive_some(65536):
                pass
            hung_up.set()
            return
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
        await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def test_real_socket_round_trip_and_cancel(nursery: trio.Nursery) -> None:
    hung_up = trio.Event()
    port = await serve_one_shot_judge(nursery, 0.0, trio.Event())
    cfg = make_cfg({"base_urls": (f"http://127.0.0.1:{port}",)}, judge_request_timeout_s=5.0)
    async with open_judge(cfg) as judge:
        assert await judge.judge_pair(REQUEST) == VERDICT
    slow_port = await serve_one_shot_judge(nursery, 30.0, hung_up)
    cfg = make_cfg({"base_urls": (f"http://127.0.0.1:{slow_port}",)})
    async with open_judge(cfg) as judge:
        with trio.move_on_after(0.2) as scope:
            await judge.judge_pair(REQUEST)
        assert scope.cancelled_caught
        assert judge.status()["endpoints"][0]["in_flight"] == 0
        with trio.fail_after(5.0):
            await hung_up.wait()  # the judge sees the connection dropped


async def test_real_closed_port_fails_fast() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again when we leave: connections are refused
    cfg = make_cfg(
        {"base_urls": (f"http://127.0.0.1:{port}",)},
        genrm_parse_retry_sleep_s=0.0,
        judge_request_timeout_s=5.0,
    )
    async with open_judge(cfg) as judge:
        with trio.fail_after(5.0):
            with pytest.raises(JudgeFailed, match="after 4 attempts: .*ConnectError"):
                await judge.judge_pair(REQUEST)
    assert judge.stats.failures_by_reason == {"transport": 4}
