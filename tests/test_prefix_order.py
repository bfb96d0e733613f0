"""Prefix order (issue 18 item 3): a cohort's comparisons are issued so that calls sharing the
longest prefix go back to back, with one warm-up call first under ``cohort_affinity``; rewards
never depend on issue order."""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from typing import Any

import pytest
import trio
import trio.testing

from genrm_trio import scoring
from genrm_trio.config import Config, JudgeConfig
from genrm_trio.server import cohort as cohort_module
from genrm_trio.server.judge import Judge, JudgeRequest, open_judge
from tests.lifecycle_helpers import (
    Outcomes,
    answer,
    heuristic_verdict,
    member,
    open_registry,
    reference_rewards,
)
from tests.test_judge import MaxRng, transport
from tests.test_judge_routing import URL_A, URL_B
from tests.test_judge_routing import Endpoints as FakeEndpoints


def test_prefix_order_groups_calls_by_response_1_then_response_2_then_pass() -> None:
    pairs = scoring.comparison_pairs(4, "all_pairs", 2)  # judge-major: pass 0 first
    ordered = [pairs[i] for i in scoring.prefix_order(pairs)]
    assert ordered == [(0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (0, 3, 0), (0, 3, 1),
                       (1, 2, 0), (1, 2, 1), (1, 3, 0), (1, 3, 1), (2, 3, 0), (2, 3, 1)]
    circular = scoring.comparison_pairs(3, "circular", 1)
    assert [circular[i] for i in scoring.prefix_order(circular)] == [(0, 1, 0), (1, 2, 0),
                                                                      (2, 0, 0)]


class TimedJudge:
    """Records when each comparison started; each takes a duration drawn from its content,
    so completions come back in an order unrelated to issue order."""

    def __init__(self) -> None:
        self.started: list[tuple[float, str, str]] = []
        self.conversations: list[str] = []  # of each started call, in the same order

    async def judge_pair(self, request: JudgeRequest, group: object = None,
                         trace: object = None) -> scoring.Verdict:
        self.started.append((trio.current_time(), request.response_1, request.response_2))
        self.conversations.append(request.history[0]["content"])
        digest = hashlib.sha256((request.response_1 + request.response_2).encode()).digest()
        await trio.sleep(1.0 + digest[0] / 64)
        return heuristic_verdict(request)


class Backend:
    """A judge backend answering through a :class:`TimedJudge`: the real retry loop and its
    ordered limiter in front of it."""

    kind = "builtin"

    def __init__(self, judge: TimedJudge) -> None:
        self.judge = judge

    async def call(self, request: JudgeRequest, attempt: int, state: Any) -> str:
        verdict = await self.judge.judge_pair(request)
        return (f'{{"score_1": {verdict.score_1}, "score_2": {verdict.score_2}, '
                f'"ranking": {verdict.ranking}}}')

    def status(self) -> dict[str, Any]:
        return {"endpoints": []}


def config(routing: str, schedule: str = "wait_for_all", n: int = 5, engine: str = "unknown",
           **top: Any) -> Config:
    # One judge URL (the tests' judges answer in process): cohort_affinity applies to judge
    # endpoints only.
    return Config(num_rollouts_per_prompt=n, comparison_strategy="all_pairs",
                  judge_schedule=schedule,  # type: ignore[arg-type]
                  judge=JudgeConfig(routing=routing,  # type: ignore[arg-type]
                                    engine=engine,  # type: ignore[arg-type]
                                    base_urls=("http://judge.test",)), **top)


async def run_cohort(cfg: Config, judge: Any) -> list[float]:
    n = cfg.num_rollouts_per_prompt
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        outcomes = Outcomes(registry, nursery)
        for slot in range(n):
            outcomes.send(f"m{slot}", member(cfg, slot))
    return [outcomes.reward(f"m{slot}") for slot in range(n)]


@pytest.mark.parametrize(("engine", "warm_up"), [
    ("llama_cpp", True),
    # an engine that shares prefixes between the calls it runs (vllm): a warm-up only adds a
    # round trip
    ("vllm", False),
    # sglang / unknown before any judge endpoint has answered: nothing is known of it yet, so
    # as llama_cpp
    ("sglang", True), ("unknown", True),
    # ... and once an endpoint answered without showing that its concurrent calls do not share
    # (judge/endpoints.py sets the registry's Crowd.waits then; the in-process judge here has
    # no endpoints, so the test sets it)
    ("unknown, answered", False), ("sglang, answered", False),
    # unknown once an endpoint's cached tokens showed concurrent calls do not share a prefix
    # (judge/endpoints.py sets the registry's Crowd.waits then): the warm-up, as llama_cpp
    ("unknown, shown not to share", True), ("sglang, shown not to share", True),
])
@pytest.mark.parametrize("schedule", ["wait_for_all", "eager"])
async def test_with_two_cohorts_per_judge_affinity_sends_one_warm_up_call_then_the_rest(
    autojump_clock: trio.testing.MockClock, schedule: str, engine: str, warm_up: bool,
) -> None:
    # No judge.max_concurrency_per_endpoint: the warm-up is the cohort's own, and pays only
    # while another cohort keeps the judge busy (one judge here: two cohorts), on an engine
    # whose concurrent calls do not share a prefix (judge.engine).
    cfg = config("cohort_affinity", schedule, engine=engine.partition(",")[0])
    judge = TimedJudge()
    n = cfg.num_rollouts_per_prompt
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        assert registry._crowd.waits is (engine != "vllm")
        if "shown" in engine:
            registry._crowd.waits = True
        elif "answered" in engine:
            registry._crowd.waits = False
        outcomes = Outcomes(registry, nursery)
        for slot in range(n):
            for c in range(2):
                outcomes.send(f"c{c}m{slot}", member(cfg, slot, group=f"g{c}",
                                                     prompt=f"Task {c}: why is the sky blue?"))
    for c in range(2):
        times = [t for (t, _, _), conversation in zip(judge.started, judge.conversations,
                                                      strict=True)
                 if conversation.startswith(f"Task {c}")]
        first, *rest = times
        assert len(times) == 10
        if warm_up:
            assert all(t > first for t in rest)  # the warm-up ran alone
            assert len(set(rest)) == 1  # then everything else fanned out at once
        else:
            assert len(set(times)) == 1  # everything at once


async def test_one_cohort_alone_sends_every_call_at_once_under_affinity(
    autojump_clock: trio.testing.MockClock,
) -> None:
    judge = TimedJudge()
    await run_cohort(config("cohort_affinity"), judge)
    assert len({t for t, _, _ in judge.started}) == 1 and len(judge.started) == 10



async def test_waiting_calls_of_a_cohort_start_in_prefix_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One judge slot: the queue decides, whatever order trio runs the cohort's tasks in.
    cfg = config("cohort_affinity", judge_max_concurrency=1)
    judge = TimedJudge()
    await run_cohort(cfg, Judge(cfg, Backend(judge), None, random.Random(0)))
    texts = [answer(slot) for slot in range(cfg.num_rollouts_per_prompt)]
    pairs = scoring.comparison_pairs(cfg.num_rollouts_per_prompt, "all_pairs", 1)
    expected = [(texts[i], texts[j])
                for i, j, _ in (pairs[k] for k in scoring.prefix_order(pairs))]
    started = [(r1, r2) for _, r1, r2 in judge.started]
    # one cohort: no warm-up; the first call takes the free slot at once (whichever task
    # trio runs first); every other one waited in the queue, which hands slots out in
    # prefix order
    assert started[1:] == [p for p in expected if p != started[0]]


async def test_least_loaded_fans_out_at_once(autojump_clock: trio.testing.MockClock) -> None:
    judge = TimedJudge()
    await run_cohort(config("least_loaded"), judge)
    assert len({t for t, _, _ in judge.started}) == 1 and len(judge.started) == 10


@pytest.mark.parametrize("order", ["reversed", "interleaved"])
async def test_rewards_never_depend_on_issue_order(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, order: str,
) -> None:
    cfg = config("cohort_affinity")
    texts = [answer(slot) for slot in range(cfg.num_rollouts_per_prompt)]
    expected = reference_rewards(cfg, texts)
    assert await run_cohort(cfg, TimedJudge()) == expected
    assert await run_cohort(config("least_loaded"), TimedJudge()) == expected

    def other(pairs: list[tuple[int, int, int]]) -> list[int]:
        indices = list(range(len(pairs)))
        if order == "reversed":
            return indices[::-1]
        return indices[1::2] + indices[::2]

    monkeypatch.setattr(cohort_module.scoring, "prefix_order", other)
    # One judge slot: calls start in issue order (after whichever trio runs first).
    one = config("cohort_affinity", judge_max_concurrency=1)
    judge = TimedJudge()
    assert await run_cohort(one, Judge(one, Backend(judge), None, random.Random(0))) == expected
    pairs = scoring.comparison_pairs(cfg.num_rollouts_per_prompt, "all_pairs", 1)
    issued = [(texts[pairs[k][0]], texts[pairs[k][1]]) for k in other(pairs)]
    started = [(r1, r2) for _, r1, r2 in judge.started]
    assert started[1:] == [p for p in issued if p != started[0]]  # the order really changed
    assert issued != sorted(issued, key=lambda p: (texts.index(p[0]), texts.index(p[1])))


@pytest.mark.parametrize("cohorts", [1, 4])
async def test_with_many_cohorts_in_flight_each_endpoint_computes_a_conversation_once(
    autojump_clock: trio.testing.MockClock, cohorts: int,
) -> None:
    # The registry tells cohort_affinity how many cohorts are active: with two per endpoint,
    # no call reaches an endpoint while another call with its conversation, the first there,
    # is still being computed; with one cohort the free slots are used at once instead.
    fakes = FakeEndpoints()
    n = 4
    cfg = Config(num_rollouts_per_prompt=n, comparison_strategy="all_pairs",
                 genrm_parse_retry_sleep_s=0.0,
                 judge=JudgeConfig(base_urls=(URL_A, URL_B), routing="cohort_affinity",
                                   max_concurrency_per_endpoint=2, engine="llama_cpp"))
    async with open_judge(cfg, transport=transport(fakes), rng=MaxRng()) as judge, \
            open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        outcomes = Outcomes(registry, nursery)
        for c in range(cohorts):
            for slot in range(n):
                outcomes.send(f"c{c}m{slot}", member(cfg, slot, group=f"g{c}",
                                                     prompt=f"Task {c}: why is the sky blue?"))
    starts: dict[tuple[str, str], list[float]] = defaultdict(list)
    for started, host, history in fakes.histories:
        starts[host, history].append(started)
    # start times of the calls that started while the first with their conversation at
    # their endpoint was still running
    overlapping = [t for times in starts.values() for t in sorted(times)[1:]
                   if t < min(times) + fakes.service_s]
    assert len(fakes.histories) == cohorts * 6
    if cohorts == 4:
        # none while four cohorts were active; once one is done (three left: fewer than two
        # per endpoint) a call may take a free slot rather than wait
        first_done = min(t for t, _ in outcomes.results.values())
        assert all(t >= first_done for t in overlapping), (overlapping, first_done)
    else:
        assert overlapping  # one cohort: its calls share the free slots at once
    # 6 calls a cohort on 4 slots of 1 s: as least_loaded takes (one cohort: 2 rounds; four:
    # 6), or one round more when trio's start order homes three of the four cohorts on one
    # endpoint (within the spill factor) while the other's spare slot waits for its cohort's
    # conversation in the first round
    if cohorts == 1:
        assert trio.current_time() == 2.0
    else:
        assert trio.current_time() in (6.0, 7.0)


@pytest.mark.parametrize("strategy", ["circular", "all_pairs"])
async def test_without_a_per_endpoint_limit_waiting_duplicates_go_when_their_prefix_is_warm(
    autojump_clock: trio.testing.MockClock, strategy: str,
) -> None:
    # The default judge settings (cohort_affinity, no judge.max_concurrency_per_endpoint) with
    # one endpoint and four cohorts active: calls that would compute again the conversation
    # the warm-up call is computing wait for it, and its answer must release them (a lost
    # wake-up here once left a cohort waiting for its collection timeout).
    fakes = FakeEndpoints()
    n = 4
    cfg = Config(num_rollouts_per_prompt=n, comparison_strategy=strategy,  # type: ignore[arg-type]
                 genrm_parse_retry_sleep_s=0.0, judge=JudgeConfig(base_urls=(URL_A,)))
    assert cfg.judge.routing == "cohort_affinity"
    assert cfg.judge.max_concurrency_per_endpoint is None
    with trio.fail_after(cfg.cohort_collection_timeout_s / 2):
        async with open_judge(cfg, transport=transport(fakes), rng=MaxRng()) as judge, \
                open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
            outcomes = Outcomes(registry, nursery)
            for c in range(4):
                for slot in range(n):
                    outcomes.send(f"c{c}m{slot}", member(cfg, slot, group=f"g{c}",
                                                         prompt=f"Task {c}: why?"))
    assert all(outcomes.reward(f"c{c}m{slot}") > 0 for c in range(4) for slot in range(n))
    # each cohort's conversation went first alone (the warm-up), then the rest together
    first: dict[str, float] = {}
    for started, _, history in fakes.histories:
        first.setdefault(history, started)
    assert all(started == first[history] or started >= first[history] + fakes.service_s
               for started, _, history in fakes.histories)
