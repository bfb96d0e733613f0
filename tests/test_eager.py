"""Eager judging (``judge_schedule: eager``) on the autojump clock, with exact virtual times.

Each comparison must start at the instant its second member arrives, never earlier and never
later; rewards must equal wait-for-all's; a cohort that fails while comparisons are under way
(supersession, collection deadline, shutdown) cancels them, counts them as wasted and publishes
nothing; a duplicate or re-attached member never starts a second comparison of a pair.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from genrm_trio import scoring
from genrm_trio.config import Config
from genrm_trio.server.cohort import Failure, Rewarded
from genrm_trio.server.judge import JudgeRequest
from tests.lifecycle_helpers import (
    Outcomes,
    answer,
    heuristic_verdict,
    member,
    open_registry,
    reference_rewards,
)


def cfg_for(n: int, schedule: str = "eager", **kw: object) -> Config:
    base: dict[str, object] = {
        "num_rollouts_per_prompt": n,
        "judge_schedule": schedule,
        "cohort_collection_timeout_s": 60.0,
        "cohort_evaluation_timeout_s": 300.0,
    }
    base.update(kw)
    return Config(**base)  # type: ignore[arg-type]


SLOT_OF = {answer(s): s for s in range(16)}


class TimedJudge:
    """Records when each comparison starts (virtual time) and which slots it compares.

    ``latency_s`` per call (``None``: never answers); ``capacity`` bounds calls served at once
    (a queued call counts as started when it is served, like a capacity-limited judge)."""

    def __init__(self, latency_s: float | None = 1.0, capacity: int | None = None) -> None:
        self.latency_s = latency_s
        self.limiter = trio.CapacityLimiter(capacity) if capacity is not None else None
        self.calls: list[tuple[float, tuple[int, int]]] = []
        self.finished = 0
        self.cancelled = 0

    async def judge_pair(self, request: JudgeRequest, group: object = None,
                         trace: object = None) -> scoring.Verdict:
        pair = (SLOT_OF[request.response_1], SLOT_OF[request.response_2])
        try:
            if self.limiter is not None:
                async with self.limiter:
                    return await self._serve(pair, request)
            return await self._serve(pair, request)
        except trio.Cancelled:
            self.cancelled += 1
            raise

    async def _serve(self, pair: tuple[int, int], request: JudgeRequest) -> scoring.Verdict:
        self.calls.append((trio.current_time(), pair))
        if self.latency_s is None:
            await trio.sleep_forever()
        await trio.sleep(self.latency_s)
        self.finished += 1
        return heuristic_verdict(request)

    def starts(self) -> dict[tuple[int, int], list[float]]:
        out: dict[tuple[int, int], list[float]] = {}
        for t, pair in self.calls:
            out.setdefault(pair, []).append(t)
        return out


async def _send_at(out: Outcomes, cfg: Config, arrivals: dict[int, float],
                   group: str = "g") -> None:
    """Send each slot at its arrival time (relative to now), in time order."""
    start = trio.current_time()
    for slot, at in sorted(arrivals.items(), key=lambda item: item[1]):
        await trio.sleep(start + at - trio.current_time())
        out.send(f"m{slot}", member(cfg, slot, group=group))


# Staggered arrivals, out of slot order; gaps larger and smaller than the judge latency.
ARRIVALS = {2: 0.0, 0: 3.0, 3: 3.5, 1: 12.0, 4: 20.0}


@pytest.mark.parametrize("strategy", ["circular", "all_pairs"])
@pytest.mark.parametrize("latency_s", [1.0, 5.0])
async def test_each_comparison_starts_when_its_second_member_arrives(
    autojump_clock: trio.abc.Clock, strategy: str, latency_s: float,
) -> None:
    n = len(ARRIVALS)
    cfg = cfg_for(n, comparison_strategy=strategy)
    judge = TimedJudge(latency_s)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()
        await _send_at(out, cfg, ARRIVALS)
    pairs = [(i, j) for i, j, _ in scoring.comparison_pairs(n, strategy, 1)]
    expected = {(i, j): [t0 + max(ARRIVALS[i], ARRIVALS[j])] for i, j in pairs}
    assert judge.starts() == expected
    # Published once, when the comparisons with the last member are done.
    assert {out.results[f"m{s}"][0] for s in range(n)} == {t0 + 20.0 + latency_s}
    assert all(isinstance(out.results[f"m{s}"][1], Rewarded) for s in range(n))
    assert registry.counters["comparisons_started"] == len(pairs)
    assert registry.counters["comparisons_wasted"] == 0


async def test_wait_for_all_starts_every_comparison_at_the_last_arrival(
    autojump_clock: trio.abc.Clock,
) -> None:
    n = len(ARRIVALS)
    cfg = cfg_for(n, "wait_for_all", comparison_strategy="all_pairs")
    judge = TimedJudge(1.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()
        await _send_at(out, cfg, ARRIVALS)
    assert {t for t, _ in judge.calls} == {t0 + 20.0}
    assert len(judge.calls) == n * (n - 1) // 2


@pytest.mark.parametrize("strategy", ["circular", "all_pairs"])
@pytest.mark.parametrize("judges", [1, 2])
async def test_rewards_equal_wait_for_all_and_arrive_sooner_with_a_busy_judge(
    autojump_clock: trio.abc.Clock, strategy: str, judges: int,
) -> None:
    n = len(ARRIVALS)
    rewards: dict[str, list[float]] = {}
    finished: dict[str, float] = {}
    for schedule in ("wait_for_all", "eager"):
        cfg = cfg_for(n, schedule, comparison_strategy=strategy,
                      num_judges_per_comparison=judges)
        judge = TimedJudge(1.0, capacity=1)  # one comparison at a time
        async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            t0 = trio.current_time()
            await _send_at(out, cfg, ARRIVALS)
        rewards[schedule] = [out.reward(f"m{s}") for s in range(n)]
        finished[schedule] = out.results["m0"][0] - t0
        assert registry.counters["comparisons_wasted"] == 0
    cfg = cfg_for(n, comparison_strategy=strategy, num_judges_per_comparison=judges)
    assert rewards["eager"] == rewards["wait_for_all"]
    assert rewards["eager"] == reference_rewards(cfg, [answer(s) for s in range(n)])
    calls = len(scoring.comparison_pairs(n, strategy, judges))
    assert finished["wait_for_all"] == 20.0 + 1.0 * calls  # the whole queue after the last one
    # Eager has judged every pair without slot 4 by t=20 (at most 12 calls of 1 s, all ready
    # by t=12), so only the comparisons with slot 4 remain when it arrives.
    with_last = sum(1 for i, j, _ in scoring.comparison_pairs(n, strategy, judges)
                    if 4 in (i, j))
    assert finished["eager"] == 20.0 + 1.0 * with_last


@pytest.mark.parametrize("reuse", ["off", "group"])
@pytest.mark.parametrize("latency_s", [None, 1.0], ids=["in-flight", "finished"])
async def test_supersession_during_early_judging_cancels_and_publishes_nothing(
    autojump_clock: trio.abc.Clock, latency_s: float | None, reuse: str,
) -> None:
    cfg = cfg_for(3, verdict_reuse=reuse)
    judge = TimedJudge(latency_s)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()
        out.send("a0", member(cfg, 0))
        out.send("a1", member(cfg, 1))
        await trio.sleep(4.0)
        assert judge.calls == [(t0, (0, 1))]  # judged early
        out.send("b0", member(cfg, 0, attempt=1))  # the caller replaces the group
        await trio.testing.wait_all_tasks_blocked()
        for label in ("a0", "a1"):
            t, outcome = out.results[label]
            assert t == t0 + 4.0
            assert isinstance(outcome, Failure) and outcome.kind == "superseded"
        assert registry.counters["comparisons_wasted"] == 1
        assert judge.cancelled == (1 if latency_s is None else 0)
        late = await registry.verify(member(cfg, 2))  # attempt 0 can never complete now
        assert isinstance(late, Failure) and late.kind == "stale_attempt"
        judge.latency_s = 1.0
        for slot in (1, 2):
            out.send(f"b{slot}", member(cfg, slot, attempt=1))
    # Attempt 1 is judged afresh: its own three comparisons, none from attempt 0, except with
    # verdict reuse the one attempt 0 finished before it was superseded (a cancelled call left
    # no verdict to keep).
    reused = 1 if reuse == "group" and latency_s is not None else 0
    assert len(judge.calls) == 1 + 3 - reused
    assert all(isinstance(out.results[f"b{s}"][1], Rewarded) for s in range(3))
    assert registry.counters["comparisons_started"] == 4 - reused
    assert registry.counters["comparisons_reused"] == reused
    assert registry.counters["comparisons_wasted"] == 1


async def test_collection_deadline_during_early_judging_cancels_and_publishes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(4, comparison_strategy="all_pairs")
    judge = TimedJudge(None)  # the early comparisons never finish
    async with open_registry(cfg, judge) as registry:
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            t0 = trio.current_time()
            await _send_at(out, cfg, {0: 0.0, 1: 10.0, 2: 30.0})
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(judge.starts().items()) == [
                ((0, 1), [t0 + 10.0]), ((0, 2), [t0 + 30.0]), ((1, 2), [t0 + 30.0])]
        for s in range(3):
            t, outcome = out.results[f"m{s}"]
            assert t == t0 + 60.0
            assert isinstance(outcome, Failure) and outcome.kind == "cohort_incomplete"
        assert judge.cancelled == 3
        assert registry.counters["comparisons_wasted"] == 3
        again = await registry.verify(member(cfg, 3))  # the failure record, no judge call
        assert isinstance(again, Failure) and again.kind == "cohort_incomplete"
        assert len(judge.calls) == 3


async def test_shutdown_during_early_judging_cancels_and_publishes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(3)
    judge = TimedJudge(None)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()
        out.send("m0", member(cfg, 0))
        out.send("m1", member(cfg, 1))
        await trio.sleep(5.0)
        assert judge.calls == [(t0, (0, 1))]
        registry.begin_shutdown()
    for label in ("m0", "m1"):
        t, outcome = out.results[label]
        assert t == t0 + 5.0
        assert isinstance(outcome, Failure) and outcome.kind == "shutdown"
    assert judge.cancelled == 1 and judge.finished == 0
    assert registry.counters["comparisons_wasted"] == 1


@pytest.mark.parametrize("latency_s", [0.5, 30.0], ids=["early-call-done", "early-in-flight"])
async def test_duplicate_and_reattached_members_never_start_a_second_comparison(
    autojump_clock: trio.abc.Clock, latency_s: float,
) -> None:
    cfg = cfg_for(3)
    judge = TimedJudge(latency_s)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()
        out.send("m0", member(cfg, 0))
        await trio.sleep(1.0)
        out.send("m1", member(cfg, 1))  # pair (0, 1) starts now
        await trio.sleep(1.0)
        out.send("m1-dup", member(cfg, 1))  # an identical duplicate attaches
        await trio.sleep(1.0)
        out.disconnect("m0")
        await trio.sleep(1.0)
        out.send("m0-retry", member(cfg, 0))  # the retried request re-attaches
        await trio.sleep(1.0)
        out.send("m2", member(cfg, 2))  # pairs (1, 2) and (2, 0) start now
    assert judge.starts() == {(0, 1): [t0 + 1.0], (1, 2): [t0 + 5.0], (2, 0): [t0 + 5.0]}
    finish = max(t0 + 1.0 + latency_s, t0 + 5.0 + latency_s)
    for label in ("m1", "m1-dup", "m0-retry", "m2"):
        assert out.results[label][0] == finish
    assert out.reward("m1") == out.reward("m1-dup")
    assert "m0" not in out.results
    assert registry.counters["comparisons_started"] == 3
