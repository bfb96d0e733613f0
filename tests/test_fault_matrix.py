"""The fault matrix over real loopback sockets: every mock-judge fault x {once, always} x
{responses, chat}. For each: how many judge calls the cohort costs, whether its members are
rewarded (with the reference rewards) or masked, and that no request outlives the deadlines."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2
import pytest
import trio

from genrm_trio.config import Config, JudgeConfig
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.serve import run_server
from genrm_trio.torture.contract import PROMPTS, answer_text, reference_rewards, verify_body

N = 2  # circular: comparisons (0, 1) and (1, 0)
COMPARISONS = 2
ATTEMPTS = 4  # genrm_parse_retries = 3
REQUEST_TIMEOUT_S = 0.3
EVALUATION_TIMEOUT_S = 5.0
COLLECTION_TIMEOUT_S = 5.0

#: Retryable within the comparison's budget: one faulty call costs one retry.
TRANSIENT = {Fault.HTTP_503, Fault.HTTP_429, Fault.HTTP_408, Fault.RESET, Fault.TRUNCATED,
             Fault.CUT_CHUNKED, Fault.EMPTY, Fault.INCOMPLETE}
#: The per-request deadline: not retried, the comparison (so the cohort) fails at once.
DEADLINE = {Fault.TRICKLE, Fault.HANG}
#: A usable answer without a parseable verdict: retried, then the default verdict.
UNPARSEABLE = {Fault.GARBAGE, Fault.NONFINITE, Fault.EXTREME, Fault.WRONG_TYPES,
               Fault.OUT_OF_RANGE}
assert TRANSIENT | DEADLINE | UNPARSEABLE | {Fault.NONE} == set(Fault)


@dataclass(frozen=True)
class Expected:
    masked: bool
    min_calls: int
    max_calls: int
    default_rewards: bool = False


def expected(fault: Fault, always: bool) -> Expected:
    if fault is Fault.NONE:
        return Expected(False, COMPARISONS, COMPARISONS)
    if fault in DEADLINE:
        # The faulty call times out (fatal); the sibling's call was already sent.
        return Expected(True, COMPARISONS, COMPARISONS)
    if not always:
        return Expected(False, COMPARISONS + 1, COMPARISONS + 1)
    if fault in UNPARSEABLE:
        return Expected(False, COMPARISONS * ATTEMPTS, COMPARISONS * ATTEMPTS,
                        default_rewards=True)
    # The first comparison to exhaust its budget fails the cohort and cancels its sibling,
    # which had made at least its first call.
    return Expected(True, ATTEMPTS + 1, COMPARISONS * ATTEMPTS)


@dataclass
class Stack:
    url: str
    state: MockJudgeState
    cfg: Config


@pytest.fixture(params=["responses", "chat"])
async def stack(request: pytest.FixtureRequest, nursery: trio.Nursery) -> AsyncIterator[Stack]:
    state = MockJudgeState()
    settings = MockJudgeSettings(retry_after_s=0.0, trickle_interval_s=0.05)
    judge_url = await nursery.start(functools.partial(run_mock_judge, settings, state=state))
    cfg = Config(
        num_rollouts_per_prompt=N, port=0,
        cohort_collection_timeout_s=COLLECTION_TIMEOUT_S,
        cohort_evaluation_timeout_s=EVALUATION_TIMEOUT_S,
        judge_request_timeout_s=REQUEST_TIMEOUT_S,
        genrm_parse_retries=ATTEMPTS - 1, genrm_parse_retry_sleep_s=0.01,
        judge_retry_backoff_max_s=0.02, shutdown_grace_s=1.0,
        judge=JudgeConfig(base_urls=(judge_url,), api=request.param),
    )
    stop = trio.Event()
    async with trio.open_nursery() as server:
        url = await server.start(functools.partial(run_server, cfg, shutdown=stop))
        yield Stack(url, state, cfg)
        stop.set()


@pytest.mark.parametrize("always", [False, True], ids=["once", "always"])
@pytest.mark.parametrize("fault", list(Fault), ids=[f.value for f in Fault])
async def test_fault_matrix(stack: Stack, fault: Fault, always: bool) -> None:
    stack.state.set_fault(fault, None if always else 1)
    want = expected(fault, always)
    group_ids = [f"matrix-{fault.value}-{always}", ""]
    bodies = [verify_body(0, 0, slot, 0, 0, group_ids) for slot in range(N)]
    answers: dict[int, httpx2.Response] = {}
    # Wall-clock bound on every request: the evaluation deadline plus a little.
    started = time.monotonic()
    async with httpx2.AsyncClient(base_url=stack.url, timeout=None) as client:

        async def send(slot: int) -> None:
            answers[slot] = await client.post("/verify", json=bodies[slot])

        with trio.fail_after(EVALUATION_TIMEOUT_S + 2.0):
            async with trio.open_nursery() as nursery:
                for slot in range(N):
                    nursery.start_soon(send, slot)
    elapsed = time.monotonic() - started

    assert sorted(answers) == list(range(N))
    calls = stack.state.calls
    assert want.min_calls <= calls <= want.max_calls, (fault, always, calls)
    if fault in DEADLINE:
        # Ended by the per-request deadline, well before the evaluation deadline.
        assert elapsed < EVALUATION_TIMEOUT_S - 1.0
    bodies_out = [answers[slot].json() for slot in range(N)]
    assert all(answers[slot].status_code == 200 for slot in range(N)), bodies_out
    if want.masked:
        for slot, out in enumerate(bodies_out):
            assert out["mask_sample"] is True
            assert out["failure_kind"] == "judge_failed"
            assert out["reward"] == 0.0
            assert out["_ng_failure_class"] == "judge_failed"
            assert out["instance_config"] == {"mask_sample": True}
            assert out["_ng_rollout_index"] == slot
            assert out["response"] == bodies[slot]["response"]
            assert 0 < len(out["failure_reason"]) <= 2000
        return
    if want.default_rewards:
        reference = [stack.cfg.default_score] * N
    else:
        reference = reference_rewards(
            stack.cfg, PROMPTS[0], [answer_text(0, 0, slot, 0) for slot in range(N)])
    for slot, out in enumerate(bodies_out):
        assert out["mask_sample"] is False
        assert out["failure_kind"] is None
        assert out["_ng_rollout_index"] == slot
        assert out["reward"] == reference[slot]
        assert out["extra_passthrough"] == {"g": 0, "s": slot}
