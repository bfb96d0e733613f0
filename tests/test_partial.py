"""Partial cohorts (``incomplete_cohort_policy: judge_present``, issue 19) on the autojump clock.

At the collection deadline with at least ``min_cohort_members`` distinct slots present, an
explicit group is judged over exactly those members: its comparisons re-planned over them in
slot order, penalties and aggregation over them, so the M rewards equal the pure scoring
module's computation over the M answers alone. Fewer members, a legacy group or the default
policy: ``cohort_incomplete`` as before. A member arriving after the partial judgement gets 409
``cohort_closed`` at once (never a cohort of its own), from the active cohort and from its
retained record, journal included. Eager verdicts in the new plan are kept, others cancelled
and counted as wasted; shutdown and supersession during a partial evaluation behave as for a
full one.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from genrm_trio import scoring
from genrm_trio.config import Config
from genrm_trio.server.cohort import CohortRegistry, Failure, Rewarded
from genrm_trio.server.journal import FILE_NAME, Journal
from genrm_trio.server.judge import JudgeRequest
from tests.lifecycle_helpers import (
    PROMPT,
    Outcomes,
    ScriptedJudge,
    answer,
    heuristic_verdict,
    member,
    open_registry,
    reference_rewards,
)
from tests.test_eager import TimedJudge

DEADLINE_S = 10.0


def cfg_for(n: int, *, policy: str = "judge_present", min_members: int | None = None,
            **kw: Any) -> Config:
    return Config(
        num_rollouts_per_prompt=n, incomplete_cohort_policy=policy,  # type: ignore[arg-type]
        min_cohort_members=min_members, cohort_collection_timeout_s=DEADLINE_S,
        cohort_evaluation_timeout_s=60.0, **kw)


def texts(slots: tuple[int, ...]) -> list[str]:
    return [answer(s) for s in slots]


async def send_slots(out: Outcomes, cfg: Config, slots: tuple[int, ...], *,
                     group: str = "g", attempt: int = 0) -> None:
    for slot in slots:
        out.send(f"m{slot}", member(cfg, slot, group=group, attempt=attempt))
    await trio.testing.wait_all_tasks_blocked()


@pytest.mark.parametrize("strategy", ["circular", "all_pairs"])
@pytest.mark.parametrize(("n", "present", "min_members"), [
    (4, (0, 1, 2), None),      # the last slot missing: the circular wrap closes on slot 2
    (4, (1, 2, 3), None),      # the first slot missing
    (5, (0, 2, 4), 3),         # every other slot: no comparison of the full plan survives
    (6, (1, 4), 2),            # M = 2: circular judges both orders
])
async def test_present_members_get_the_reference_rewards_over_exactly_them(
    autojump_clock: trio.abc.Clock, strategy: str, n: int, present: tuple[int, ...],
    min_members: int | None,
) -> None:
    # Penalties on, so a reward that was centred over N (or over a wrong set) would differ.
    cfg = cfg_for(n, min_members=min_members, comparison_strategy=strategy,
                  num_judges_per_comparison=2, group_style_penalty_coeff=0.3,
                  group_answer_length_penalty_coeff=0.2)
    judge = TimedJudge(latency_s=1.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()
        await send_slots(out, cfg, present)
    expected = reference_rewards(cfg, texts(present))
    for slot, reward in zip(present, expected, strict=True):
        when, outcome = out.results[f"m{slot}"]
        assert when == t0 + DEADLINE_S + 1.0  # judged at the deadline, one judge round
        assert isinstance(outcome, Rewarded)
        assert outcome.reward == reward
        assert (outcome.cohort_expected, outcome.cohort_scored) == (n, len(present))
    # The comparisons judged are the strategy's plan over the present slots, each once per
    # judge pass, and no comparison touches a missing slot.
    plan = scoring.comparison_pairs(len(present), strategy, 2)
    assert sorted(pair for _t, pair in judge.calls) == sorted(
        (present[a], present[b]) for a, b, _k in plan)
    assert registry.counters["cohorts_partial"] == 1
    assert registry.counters["cohorts_completed"] == 1
    # A reference over all N slots would differ (the re-plan and the centring over M matter).
    full = reference_rewards(cfg, texts(tuple(range(n))))
    assert [full[s] for s in present] != expected


async def test_a_full_cohort_says_it_scored_all_of_its_members(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(3)
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        await send_slots(out, cfg, (2, 0, 1))
    for slot in range(3):
        outcome = out.results[f"m{slot}"][1]
        assert isinstance(outcome, Rewarded)
        assert (outcome.cohort_expected, outcome.cohort_scored) == (3, 3)
    assert registry.counters["cohorts_partial"] == 0


@pytest.mark.parametrize(("cfg", "group", "needle"), [
    (cfg_for(5, min_members=4), "g",
     "incomplete_cohort_policy judge_present needs at least 4 members"),
    (cfg_for(5), "g", "needs at least 4 members"),  # null: N - 1
    (cfg_for(5, min_members=2), None,
     "legacy groups (no _ng_group_id) are judged partially only with legacy_slots: arrival"),
    (cfg_for(5, policy="fail"), "g", "no reward is computed from an incomplete cohort"),
])
async def test_too_few_members_a_legacy_group_or_the_default_policy_fail_as_incomplete(
    autojump_clock: trio.abc.Clock, cfg: Config, group: str | None, needle: str,
) -> None:
    judge = ScriptedJudge()
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot in (0, 1, 3):
            out.send(f"m{slot}", member(cfg, slot, group=group, task=7))
    for slot in (0, 1, 3):
        failure = out.failure(f"m{slot}")
        assert failure.status == 503 and failure.kind == "cohort_incomplete"
        assert "3 of 5 rollouts (missing slots: 2, 4)" in failure.detail
        assert needle in failure.detail, failure.detail
    assert judge.calls == 0
    assert registry.counters["cohorts_partial"] == 0


async def test_a_late_member_gets_cohort_closed_at_once_while_judged_and_after(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(4)
    judge = TimedJudge(latency_s=5.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()
        await send_slots(out, cfg, (0, 1, 2), group="grp", attempt=3)
        await trio.sleep(DEADLINE_S + 1.0)  # the partial cohort is being judged now
        assert registry.snapshot()["evaluating"] == 1
        during = await registry.verify(member(cfg, 3, group="grp", attempt=3))
        assert trio.current_time() == t0 + DEADLINE_S + 1.0  # answered at once
        await trio.sleep(10.0)  # published, record retained
        after = await registry.verify(member(cfg, 3, group="grp", attempt=3))
        replay = await registry.verify(member(cfg, 1, group="grp", attempt=3))
        snapshot = registry.snapshot()
    for closed in (during, after):
        assert isinstance(closed, Failure)
        assert (closed.status, closed.kind) == (409, "cohort_closed")
        assert "group 'grp' attempt 3: slot 3" in closed.detail
        assert "3 of 4 members" in closed.detail
        assert "resend the complete group with a higher _ng_group_attempt" in closed.detail
    # A present member replays its reward; no cohort was opened for the late one.
    assert replay == Rewarded(out.reward("m1"))
    assert isinstance(replay, Rewarded) and replay.cohort_scored == 3
    assert registry.counters["cohorts_opened"] == 1
    assert registry.counters["verify_cohort_closed"] == 2
    assert snapshot["active_cohorts"] == 0
    assert len(judge.calls) == 3


async def test_a_new_attempt_of_the_group_is_judged_whole(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(3)
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        await send_slots(out, cfg, (0, 2))
        await trio.sleep(DEADLINE_S + 1.0)
        for slot in range(3):
            out.send(f"next{slot}", member(cfg, slot, attempt=1))
    first = out.results["m0"][1]
    assert isinstance(first, Rewarded) and first.cohort_scored == 2
    expected = reference_rewards(cfg, texts((0, 1, 2)))
    for slot in range(3):
        outcome = out.results[f"next{slot}"][1]
        assert isinstance(outcome, Rewarded) and outcome.cohort_scored == 3
        assert outcome.reward == expected[slot]


@pytest.mark.parametrize("latency_s", [2.0, 30.0], ids=["early-done", "early-in-flight"])
async def test_eager_verdicts_in_the_new_plan_are_kept(
    autojump_clock: trio.abc.Clock, latency_s: float,
) -> None:
    # N = 5 circular, slot 2 never comes: early pairs (0, 1) and (3, 4) are in the new plan
    # (0, 1), (1, 3), (3, 4), (4, 0); (4, 0) also started early. (1, 3) starts at the deadline.
    cfg = cfg_for(5, judge_schedule="eager")
    judge = TimedJudge(latency_s)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        t0 = trio.current_time()
        await send_slots(out, cfg, (0, 1))
        await trio.sleep(1.0)
        await send_slots(out, cfg, (3, 4))
    assert judge.starts() == {(0, 1): [t0], (3, 4): [t0 + 1.0], (4, 0): [t0 + 1.0],
                              (1, 3): [t0 + DEADLINE_S]}
    assert judge.cancelled == 0
    assert registry.counters["comparisons_started"] == 4
    assert registry.counters["comparisons_wasted"] == 0
    finish = max(t0 + 1.0 + latency_s, t0 + DEADLINE_S + latency_s)
    expected = reference_rewards(cfg, texts((0, 1, 3, 4)))
    for slot, reward in zip((0, 1, 3, 4), expected, strict=True):
        assert out.results[f"m{slot}"] == (finish, Rewarded(reward))


class _PlanWithoutFirstPair(CohortRegistry):
    """Re-plans a partial cohort without the comparison of its two lowest slots: the only way
    an early verdict can fall out of the plan (circular and all_pairs always keep them)."""

    def _plan_present(self, present: tuple[int, ...]) -> list[tuple[int, int, int]]:
        return [p for p in super()._plan_present(present) if p[:2] != present[:2]]


@pytest.mark.parametrize("latency_s", [2.0, 30.0], ids=["early-done", "early-in-flight"])
async def test_eager_verdicts_left_out_of_the_new_plan_are_cancelled_and_wasted(
    autojump_clock: trio.abc.Clock, latency_s: float,
) -> None:
    cfg = cfg_for(4, judge_schedule="eager")
    judge = TimedJudge(latency_s)
    async with trio.open_nursery() as cohorts:
        registry = _PlanWithoutFirstPair(cfg, judge, cohorts)
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            t0 = trio.current_time()
            await send_slots(out, cfg, (0, 1, 2))  # eager: (0, 1) and (1, 2) start now
        await trio.testing.wait_all_tasks_blocked()
        assert not cohorts.child_tasks and registry.snapshot()["active_cohorts"] == 0
    # (0, 1) is not in the new plan (1, 2), (2, 0): cancelled if still running, discarded if
    # done, and counted as wasted either way; (2, 0) starts at the deadline.
    assert judge.starts() == {(0, 1): [t0], (1, 2): [t0], (2, 0): [t0 + DEADLINE_S]}
    assert judge.cancelled == (1 if latency_s > DEADLINE_S else 0)
    assert registry.counters["comparisons_wasted"] == 1
    comparisons = []
    for i, j in ((1, 2), (2, 0)):
        verdict = _verdict(answer(i), answer(j))
        comparisons.append(scoring.Comparison(
            response_i=(0, 1, 2).index(i), response_j=(0, 1, 2).index(j), judge_idx=0,
            score_1=verdict.score_1, score_2=verdict.score_2, ranking=verdict.ranking))
    expected, _ = scoring.aggregate(
        comparisons, [member(cfg, s).fields().response for s in (0, 1, 2)], cfg)
    for slot in (0, 1, 2):
        assert out.reward(f"m{slot}") == expected[slot]


def _verdict(r1: str, r2: str) -> scoring.Verdict:
    return heuristic_verdict(JudgeRequest(history=scoring.conversation_history(PROMPT),
                                          response_1=r1, response_2=r2, principle=None))


@pytest.mark.parametrize("eager", [False, True], ids=["wait_for_all", "eager"])
async def test_shutdown_during_a_partial_evaluation_answers_every_waiter(
    autojump_clock: trio.abc.Clock, eager: bool,
) -> None:
    cfg = cfg_for(4, judge_schedule="eager" if eager else "wait_for_all")
    judge = ScriptedJudge(mode="hang")
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        await send_slots(out, cfg, (0, 1, 3))
        await trio.sleep(DEADLINE_S + 1.0)
        assert registry.snapshot()["evaluating"] == 1
        registry.begin_shutdown()
        await trio.testing.wait_all_tasks_blocked()
        late = await registry.verify(member(cfg, 2))
    for slot in (0, 1, 3):
        assert out.failure(f"m{slot}").kind == "shutdown"
    assert isinstance(late, Failure) and late.kind == "shutdown"
    assert judge.cancelled == judge.calls == 3
    assert registry.counters["comparisons_wasted"] == 3
    assert registry.counters["cohorts_partial"] == 0


async def test_a_newer_attempt_supersedes_a_partial_evaluation(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(4)
    judge = ScriptedJudge(latency_s=30.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        await send_slots(out, cfg, (0, 1, 3))
        await trio.sleep(DEADLINE_S + 1.0)
        out.send("new0", member(cfg, 0, attempt=1))
        await trio.testing.wait_all_tasks_blocked()
        for slot in (0, 1, 3):
            failure = out.failure(f"m{slot}")
            assert (failure.status, failure.kind) == (503, "superseded")
        # The superseded attempt's late member is fenced as for any older attempt.
        stale = await registry.verify(member(cfg, 2, attempt=0))
        assert isinstance(stale, Failure) and stale.kind == "stale_attempt"
        for slot in (1, 2, 3):
            out.send(f"new{slot}", member(cfg, slot, attempt=1))
    assert judge.cancelled == 3
    assert registry.counters["comparisons_wasted"] == 3
    for slot in range(4):
        outcome = out.results[f"new{slot}"][1]
        assert isinstance(outcome, Rewarded) and outcome.cohort_scored == 4


async def test_a_judge_failure_of_a_partial_cohort_is_recorded_for_every_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(3)
    judge = ScriptedJudge(mode="fail")
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        await send_slots(out, cfg, (0, 1))
        await trio.sleep(DEADLINE_S + 1.0)
        late = await registry.verify(member(cfg, 2))
    assert out.failure("m0").masked and out.failure("m0").kind == "judge_failed"
    assert late == out.failure("m0")  # the failure record answers any slot, as for a full one


async def test_the_disposition_line_says_partial_m_of_n(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="genrm_trio.server.cohort")
    cfg = cfg_for(4)
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        await send_slots(out, cfg, (0, 1, 3))
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "cohort"]
    text = line.getMessage()
    assert "completed partial (3 of 4 members)" in text, text
    assert "missing slots: 2" in text
    assert f"rewards by slot [{round(out.reward('m0'), 4)}, " in text and ", None, " in text
    fields = vars(line)
    assert (fields["kind"], fields["partial"], fields["scored"], fields["size"]) == (
        "partial", True, 3, 4)


# ---------------------------------------------------------------- state_dir


async def test_a_partial_record_survives_a_restart(
    tmp_path: Path, autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(4, state_dir=str(tmp_path))
    judge = ScriptedJudge()
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, judge, journal=journal) as registry, \
            trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        await send_slots(out, cfg, (0, 2, 3))
    journal.close()
    calls = judge.calls

    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, judge, journal=journal) as registry:
        assert journal.skipped_rows == 0
        replay = await registry.verify(member(cfg, 2))
        closed = await registry.verify(member(cfg, 1))
        conflict = await registry.verify(member(cfg, 0, text="another answer"))
    journal.close()
    assert replay == Rewarded(out.reward("m2"))
    assert isinstance(replay, Rewarded)
    assert (replay.cohort_expected, replay.cohort_scored) == (4, 3)
    assert isinstance(closed, Failure) and closed.kind == "cohort_closed"
    assert isinstance(conflict, Failure) and conflict.kind == "conflict"
    assert judge.calls == calls


@pytest.mark.parametrize(("digests", "rewards"), [
    (["d", None, "d", "d"], [1.0, 2.0, None, 3.0]),  # missing at different places
    (["d", None, None, None], [1.0, None, None, None]),  # one member is no cohort
    ([None, None, None, None], [None, None, None, None]),
    (["d", None, "d"], [1.0, None, 2.0]),  # not this cohort size
])
def test_malformed_partial_rows_are_skipped_at_reload(
    tmp_path: Path, digests: list[str | None], rewards: list[float | None],
) -> None:
    journal = Journal.open(str(tmp_path))
    journal.put_record(_key(), None, ("a" * 64,) * 4, (1.0, 2.0, 3.0, 4.0), None)
    journal.close()
    db = sqlite3.connect(tmp_path / FILE_NAME)
    db.execute("UPDATE records SET digests = ?, rewards = ?",
               (json.dumps([d and "b" * 64 for d in digests]), json.dumps(rewards)))
    db.commit()
    db.close()
    journal = Journal.open(str(tmp_path))
    assert list(journal.records(4)) == []
    assert journal.skipped_rows == 1
    journal.close()


def test_a_well_formed_partial_row_reloads() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal.open(tmp)
        journal.put_record(_key(), None, ("a" * 64, None, "b" * 64, None),
                           (1.5, None, 2.5, None), None)
        [record] = list(journal.records(4))
        assert record.digests == ("a" * 64, None, "b" * 64, None)
        assert record.rewards == (1.5, None, 2.5, None)
        assert journal.skipped_rows == 0
        journal.close()


def _key() -> Any:
    from genrm_trio import identity

    return identity.explicit_key("g", 0)
