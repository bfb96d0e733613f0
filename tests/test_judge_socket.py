"""The judge against poisoned answers over real loopback sockets: the mock judge, the server in
process, real HTTP in between. Each poison fails its own cohort with a reason that names the
cause, and the next cohort completes."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
import trio

from genrm_trio.config import Config, JudgeConfig
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.serve import run_server
from genrm_trio.torture.contract import verify_body

N = 2
EVALUATION_TIMEOUT_S = 5.0


@dataclass
class Stack:
    url: str
    state: MockJudgeState
    cfg: Config


async def start_stack(nursery: trio.Nursery, settings: MockJudgeSettings,
                      **cfg_kw: Any) -> Stack:
    state = MockJudgeState()
    judge_url = await nursery.start(functools.partial(run_mock_judge, settings, state=state))
    judge_kw = cfg_kw.pop("judge", {})
    cfg_kw.setdefault("num_rollouts_per_prompt", N)
    cfg_kw.setdefault("judge_request_timeout_s", 2.0)
    cfg = Config(
        port=0, cohort_collection_timeout_s=5.0,
        cohort_evaluation_timeout_s=EVALUATION_TIMEOUT_S,
        genrm_parse_retry_sleep_s=0.01, judge_retry_backoff_max_s=0.02, shutdown_grace_s=1.0,
        judge=JudgeConfig(base_urls=(judge_url,), **judge_kw), **cfg_kw,
    )
    url = await nursery.start(functools.partial(run_server, cfg))
    return Stack(url, state, cfg)


@pytest.fixture
async def server_nursery() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        yield nursery
        nursery.cancel_scope.cancel()


async def run_cohort(url: str, group_id: str, size: int = N) -> list[dict[str, Any]]:
    bodies = [verify_body(0, 0, slot, 0, 0, [group_id]) for slot in range(size)]
    answers: dict[int, httpx2.Response] = {}
    async with httpx2.AsyncClient(base_url=url, timeout=None) as client:

        async def send(slot: int) -> None:
            answers[slot] = await client.post("/verify", json=bodies[slot])

        with trio.fail_after(EVALUATION_TIMEOUT_S + 2.0):
            async with trio.open_nursery() as nursery:
                for slot in range(size):
                    nursery.start_soon(send, slot)
    assert all(answers[s].status_code == 200 for s in range(size))
    return [answers[s].json() for s in range(size)]


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_huge_retry_after_masks_only_its_cohort_at_once(
    server_nursery: trio.Nursery, api: str
) -> None:
    # The judge asks for a billion seconds' pause once; the cohort must not sleep out its
    # evaluation deadline and must say why it failed.
    settings = MockJudgeSettings(fault=Fault.HTTP_429, fault_count=1, retry_after_s=1e9)
    stack = await start_stack(server_nursery, settings, judge={"api": api})
    started = trio.current_time()
    masked = await run_cohort(stack.url, f"poison-{api}")
    assert trio.current_time() - started < EVALUATION_TIMEOUT_S / 2
    for out in masked:
        assert out["mask_sample"] is True and out["failure_kind"] == "judge_failed"
        assert "Retry-After" in out["failure_reason"]
        assert "1e+09 s" in out["failure_reason"]
        assert "deadline exceeded" not in out["failure_reason"]
    healthy = await run_cohort(stack.url, f"next-{api}")
    assert all(out["mask_sample"] is False for out in healthy)
    assert all(out["failure_kind"] is None for out in healthy)


async def test_unparseable_policy_mask_masks_the_cohort_naming_the_policy(
    server_nursery: trio.Nursery,
) -> None:
    settings = MockJudgeSettings(fault=Fault.GARBAGE, fault_count=2 * 4)  # both comparisons
    stack = await start_stack(server_nursery, settings, unparseable_verdict_policy="mask")
    masked = await run_cohort(stack.url, "garbage")
    for out in masked:
        assert out["mask_sample"] is True
        assert "unparseable_verdict_policy: mask" in out["failure_reason"]
    healthy = await run_cohort(stack.url, "next")
    assert all(out["mask_sample"] is False for out in healthy)


async def test_defaulted_comparisons_are_counted_in_every_answer(
    server_nursery: trio.Nursery, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="genrm_trio.server.cohort")
    settings = MockJudgeSettings(fault=Fault.GARBAGE, fault_count=2 * 4)  # both comparisons
    stack = await start_stack(server_nursery, settings)
    defaulted = await run_cohort(stack.url, "garbage")
    for out in defaulted:
        assert out["mask_sample"] is False
        assert out["reward"] == stack.cfg.default_score
        assert out["genrm_defaulted_comparisons"] == N  # circular: N comparisons, all defaulted
    replayed = await run_cohort(stack.url, "garbage")  # retained record, no judge call
    assert [out["genrm_defaulted_comparisons"] for out in replayed] == [N] * N
    healthy = await run_cohort(stack.url, "next")
    assert [out["genrm_defaulted_comparisons"] for out in healthy] == [0] * N
    # A full cohort says so: N expected, N scored (first answers and replays alike).
    for out in (*defaulted, *replayed, *healthy):
        assert (out["genrm_cohort_expected"], out["genrm_cohort_scored"]) == (N, N)
    lines = [r.getMessage() for r in caplog.records if "completed after" in r.getMessage()]
    assert len(lines) == 2
    assert f"{N} of {N} comparisons defaulted" in lines[0]
    assert "0 of 2 comparisons defaulted" in lines[1]
    # The mock judge reports usage; the disposition line sums it per cohort.
    tokens = [re.search(r"judge tokens (\d+) in, (\d+) out", line) for line in lines]
    assert all(m is not None and int(m[1]) > 0 and int(m[2]) > 0 for m in tokens)
    async with httpx2.AsyncClient(base_url=stack.url) as client:
        status = (await client.get("/status")).json()
        metrics = (await client.get("/metrics")).text
        openapi = (await client.get("/openapi.json")).json()
    answer_schema = openapi["components"]["schemas"]["VerifyAnswer"]["properties"]
    assert "genrm_defaulted_comparisons" in answer_schema
    assert {"genrm_cohort_expected", "genrm_cohort_scored"} <= set(answer_schema)
    endpoint = status["judge"]["endpoints"][0]
    assert endpoint["input_tokens"] > 0 and endpoint["output_tokens"] > 0
    assert endpoint["clients"] >= 1
    assert f'genrm_judge_endpoint_input_tokens_total{{endpoint="{endpoint["url"]}"}} ' \
           f'{float(endpoint["input_tokens"])}' in metrics
    assert "genrm_judge_output_tokens_total" in metrics


# -- against a stock OpenAI-compatible server (the mock as llama.cpp's server behaves) -------


async def test_genrm_roles_against_a_stock_server_mask_with_the_servers_reason(
    server_nursery: trio.Nursery,
) -> None:
    settings = MockJudgeSettings(roles="standard")
    stack = await start_stack(server_nursery, settings, judge={"api": "chat"})
    for out in await run_cohort(stack.url, "roles"):
        assert out["mask_sample"] is True
        assert "HTTP 500: bad judge request: Invalid role(s) in messages: response_1, " \
               "response_2" in out["failure_reason"]


@pytest.mark.parametrize(("api", "structured"), [
    ("chat", "json_object"), ("chat", "json_schema"), ("responses", "json_schema"),
    ("responses", "none"),
])
async def test_plain_prompt_with_a_one_at_a_time_server_rewards_everyone(
    server_nursery: trio.Nursery, api: str, structured: str,
) -> None:
    # The judge serves one call at a time (0.3 s each) and queues the rest; N=4 circular sends
    # 4 calls at once. Without max_concurrency_per_endpoint the queued ones would outlive the
    # 0.5 s per-request deadline and mask the cohort.
    settings = MockJudgeSettings(roles="standard", capacity=1, latency_s=0.3,
                                 accept_json_schema=(structured != "json_object"))
    stack = await start_stack(
        server_nursery, settings, num_rollouts_per_prompt=4, judge_request_timeout_s=0.5,
        judge={"api": api, "prompt": "plain", "structured_output": structured,
               "max_concurrency_per_endpoint": 1})
    outs = await run_cohort(stack.url, f"plain-{api}-{structured}", size=4)
    assert [out["mask_sample"] for out in outs] == [False] * 4, outs[0].get("failure_reason")
    assert [out["genrm_defaulted_comparisons"] for out in outs] == [0] * 4
    assert stack.state.max_in_flight == 1 and stack.state.calls == 4


# -- what the judge saved: cached prompt tokens (issue 18 item 4) ----------------------------


@pytest.mark.parametrize(("api", "report"), [
    ("chat", "usage"), ("responses", "usage"), ("chat", "timings"),
])
async def test_cached_prompt_tokens_are_summed_per_endpoint_and_cohort(
    server_nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, api: str, report: str,
) -> None:
    caplog.set_level(logging.INFO, logger="genrm_trio.server.cohort")
    settings = MockJudgeSettings(prefix_cache_tokens=16_384, cache_report=report)  # type: ignore[arg-type]
    stack = await start_stack(server_nursery, settings, judge={"api": api},
                              num_rollouts_per_prompt=4, judge_max_concurrency=1)
    await run_cohort(stack.url, f"cached-{api}-{report}", size=4)
    # one call at a time: every call after the first finds the shared history cached
    assert stack.state.cached_tokens > 0
    [line] = [r.getMessage() for r in caplog.records if "completed after" in r.getMessage()]
    match = re.search(r"judge tokens (\d+) in, (\d+) out, (\d+) cached", line)
    assert match is not None
    assert int(match[3]) == stack.state.cached_tokens
    assert int(match[1]) == stack.state.prompt_tokens
    async with httpx2.AsyncClient(base_url=stack.url) as client:
        status = (await client.get("/status")).json()
        metrics = (await client.get("/metrics")).text
    endpoint = status["judge"]["endpoints"][0]
    assert endpoint["cached_tokens"] == stack.state.cached_tokens
    assert f'genrm_judge_endpoint_cached_tokens_total{{endpoint="{endpoint["url"]}"}} ' \
           f'{float(stack.state.cached_tokens)}' in metrics
    assert f"genrm_judge_cached_tokens_total {float(stack.state.cached_tokens)}" in metrics
