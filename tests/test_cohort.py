"""Lifecycle of cohorts in the registry, on the autojump clock (virtual time, exact)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from genrm_trio.config import Config
from genrm_trio.server.cohort import DISCONNECT_WATCH_AFTER_S, Failure, Rewarded
from genrm_trio.wire import LEGACY_GUIDANCE
from tests.lifecycle_helpers import (
    Outcomes,
    ScriptedJudge,
    answer,
    member,
    open_registry,
    reference_rewards,
)

N = 4


def cfg_for(**kw: object) -> Config:
    base: dict[str, object] = {
        "num_rollouts_per_prompt": N,
        "cohort_collection_timeout_s": 60.0,
        "cohort_evaluation_timeout_s": 30.0,
    }
    base.update(kw)
    return Config(**base)  # type: ignore[arg-type]


async def test_wait_for_all_rewards_by_slot_not_arrival(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge(latency_s=1.0)
    expected = reference_rewards(cfg, [answer(s) for s in range(N)])
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot in (3, 1, 0):
            out.send(f"m{slot}", member(cfg, slot))
            await trio.sleep(2.0)
        await trio.testing.wait_all_tasks_blocked()
        assert judge.calls == 0  # nothing judged before all N are present
        out.send("m2", member(cfg, 2))
    assert judge.calls == N  # circular: N comparisons
    times = {out.results[f"m{s}"][0] for s in range(N)}
    assert times == {7.0}  # published at the same moment, after one judge latency
    assert [out.reward(f"m{s}") for s in range(N)] == expected
    assert len(set(expected)) > 1  # the reference distinguishes slots


async def test_identical_duplicate_attaches_and_conflict_changes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge(latency_s=1.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("a", member(cfg, 0))
        out.send("a-dup", member(cfg, 0))
        await trio.testing.wait_all_tasks_blocked()
        before = registry.snapshot()
        assert before["waiters"] == 2 and before["active_cohorts"] == 1
        conflict = await registry.verify(member(cfg, 0, text="a different answer"))
        assert isinstance(conflict, Failure)
        assert (conflict.status, conflict.kind) == (409, "conflict")
        assert "slot 0" in conflict.detail
        assert registry.snapshot() == before
        for slot in range(1, N):
            out.send(f"m{slot}", member(cfg, slot))
    assert out.reward("a") == out.reward("a-dup")
    assert judge.calls == N


async def test_disconnect_before_and_during_judging_then_identical_retry(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge(latency_s=5.0)
    expected = reference_rewards(cfg, [answer(s) for s in range(N)])
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("m0", member(cfg, 0))
        await trio.sleep(1.0)
        out.disconnect("m0")  # before judging: only this waiter goes
        await trio.testing.wait_all_tasks_blocked()
        assert registry.snapshot()["waiters"] == 0
        assert registry.snapshot()["active_cohorts"] == 1  # the member's answer stays
        for slot in range(1, N):
            out.send(f"m{slot}", member(cfg, slot))
        await trio.sleep(1.0)  # judging in progress
        out.disconnect("m1")  # during judging: judging goes on
        out.send("m0-retry", member(cfg, 0))
        await trio.sleep(10.0)
        assert judge.cancelled == 0
        out.send("m1-retry", member(cfg, 1))  # after completion: replayed
    assert "m0" not in out.results and "m1" not in out.results
    assert out.reward("m0-retry") == expected[0]
    assert out.reward("m1-retry") == expected[1]
    assert out.results["m2"][0] == 6.0  # arrivals at t=1, one 5 s judge round
    assert out.results["m1-retry"][0] == 12.0  # answered the moment it was sent
    assert judge.calls == N  # the replay made no judge call


async def test_collection_timeout_fails_all_with_identical_detail(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge()
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("m0", member(cfg, 0))
        await trio.sleep(10.0)
        out.send("m1", member(cfg, 1))
        out.send("m1-dup", member(cfg, 1))  # duplicates never extend the deadline
        out.disconnect("m1-dup")
        await trio.sleep(10.0)
        out.send("m2", member(cfg, 2))
    failures = [out.failure(label) for label in ("m0", "m1", "m2")]
    assert {out.results[label][0] for label in ("m0", "m1", "m2")} == {60.0}
    assert {(f.status, f.kind) for f in failures} == {(503, "cohort_incomplete")}
    assert len({f.detail for f in failures}) == 1
    assert "missing slots: 3" in failures[0].detail
    assert judge.calls == 0


async def test_late_member_gets_recorded_incomplete_failure(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge()
    async with open_registry(cfg, judge) as registry:
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            out.send("m0", member(cfg, 0))
        late = await registry.verify(member(cfg, 3))
        regenerated = await registry.verify(member(cfg, 0, text="regenerated answer"))
    first = out.failure("m0")
    assert late == first and regenerated == first
    assert judge.calls == 0


async def test_final_arrival_racing_the_deadline(autojump_clock: trio.abc.Clock) -> None:
    """The last member lands exactly at the deadline: all rewards or all failures, never a mix."""
    for final_at in (59.0, 60.0, 61.0):
        cfg = cfg_for()
        judge = ScriptedJudge()
        async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
            start = trio.current_time()
            out = Outcomes(registry, nursery)
            for slot in range(N - 1):
                out.send(f"m{slot}", member(cfg, slot, group=f"race-{final_at}"))
            await trio.sleep_until(start + final_at)
            out.send("last", member(cfg, N - 1, group=f"race-{final_at}"))
        kinds = {type(o).__name__ for _t, o in out.results.values()}
        assert len(out.results) == N
        assert len(kinds) == 1, (final_at, out.results)
        if final_at < 60.0:
            assert kinds == {"Rewarded"}
        if final_at > 60.0:
            assert kinds == {"Failure"}


async def test_evaluation_deadline_is_separate_and_masks(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(cohort_collection_timeout_s=60.0, cohort_evaluation_timeout_s=30.0)
    judge = ScriptedJudge(latency_s=45.0)  # each call alone is within the collection window
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot in range(N):
            out.send(f"m{slot}", member(cfg, slot))
            await trio.sleep(10.0)  # last arrives at t=30
    for slot in range(N):
        t, outcome = out.results[f"m{slot}"]
        assert isinstance(outcome, Failure) and outcome.masked
        assert outcome.kind == "judge_failed"
        assert t == 30.0 + 30.0
        assert "evaluation deadline of 30 s" in outcome.detail
    assert judge.cancelled == N and judge.finished == 0


async def test_judge_failure_masks_cohort_and_cancels_siblings(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for()

    class OneFails(ScriptedJudge):
        async def judge_pair(self, request, group=None, trace=None):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.calls == 2:
                await trio.sleep(1.0)
                from genrm_trio.errors import JudgeFailed

                raise JudgeFailed("judge: HTTP 500 after 4 attempts")
            try:
                await trio.sleep(100.0)
            except trio.Cancelled:
                self.cancelled += 1
                raise
            raise AssertionError("sibling should have been cancelled")

    judge = OneFails()
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot in range(N):
            out.send(f"m{slot}", member(cfg, slot))
    failures = [out.failure(f"m{s}") for s in range(N)]
    assert all(f.masked and "HTTP 500" in f.detail for f in failures)
    assert {out.results[f"m{s}"][0] for s in range(N)} == {1.0}
    assert judge.cancelled == N - 1


async def test_supersession_cancels_old_judging_and_discards_late_result(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge(latency_s=10.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot in range(N):
            out.send(f"old{slot}", member(cfg, slot, attempt=0))
        await trio.sleep(5.0)  # attempt 0 is being judged
        out.send("new0", member(cfg, 0, attempt=1))
        await trio.testing.wait_all_tasks_blocked()
        assert judge.cancelled == N  # old judging cancelled
        for slot in range(1, N):
            out.send(f"new{slot}", member(cfg, slot, attempt=1))
    for slot in range(N):
        t, outcome = out.results[f"old{slot}"]
        assert t == 5.0
        assert isinstance(outcome, Failure)
        assert (outcome.status, outcome.kind) == (503, "superseded")
        assert isinstance(out.results[f"new{slot}"][1], Rewarded)
    assert judge.calls == 2 * N and judge.finished == N


async def test_stale_attempt_and_prompt_mismatch_cannot_supersede(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge(latency_s=1.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("a1", member(cfg, 0, attempt=1))
        await trio.testing.wait_all_tasks_blocked()
        before = registry.snapshot()
        stale = await registry.verify(member(cfg, 1, attempt=0))
        assert isinstance(stale, Failure) and (stale.status, stale.kind) == (409, "stale_attempt")
        mismatch = await registry.verify(member(cfg, 1, attempt=2, prompt="another prompt"))
        assert isinstance(mismatch, Failure)
        assert (mismatch.status, mismatch.kind) == (409, "prompt_mismatch")
        same_attempt = await registry.verify(member(cfg, 1, attempt=1, principle="be terse"))
        assert isinstance(same_attempt, Failure) and same_attempt.kind == "prompt_mismatch"
        assert registry.snapshot() == before
        for slot in range(1, N):
            out.send(f"a1-{slot}", member(cfg, slot, attempt=1))
    assert isinstance(out.results["a1"][1], Rewarded)


@pytest.mark.parametrize(("reuse", "rerun_calls"), [("off", N), ("group", 0)])
async def test_explicit_replay_and_legacy_rejudge(
    autojump_clock: trio.abc.Clock, reuse: str, rerun_calls: int,
) -> None:
    cfg = cfg_for(verdict_reuse=reuse)
    judge = ScriptedJudge(latency_s=1.0)
    async with open_registry(cfg, judge) as registry:
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            for slot in range(N):
                out.send(f"e{slot}", member(cfg, slot))
                out.send(f"l{slot}", member(cfg, slot, group=None, attempt=None, task=7))
        assert judge.calls == 2 * N
        replay = await registry.verify(member(cfg, 2))
        assert replay == Rewarded(out.reward("e2"))
        assert judge.calls == 2 * N  # replay: no judge call
        assert registry.snapshot()["retained_records"] == 1  # legacy removed at completion
        async with trio.open_nursery() as nursery:
            again = Outcomes(registry, nursery)
            for slot in range(N):
                again.send(f"l{slot}", member(cfg, slot, group=None, attempt=None, task=7))
        # A legacy rerun (the same legacy key) is judged afresh, or with verdict reuse scored
        # with the verdicts its first run drew: the same rewards either way.
        assert judge.calls == 2 * N + rerun_calls
        assert [again.reward(f"l{s}") for s in range(N)] == [out.reward(f"l{s}") for s in range(N)]


async def test_failed_legacy_key_returns_failure_with_guidance(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge(mode="fail")
    async with open_registry(cfg, judge) as registry:
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            for slot in range(N):
                out.send(f"l{slot}", member(cfg, slot, group=None, attempt=None, task=3))
        calls = judge.calls
        first = out.failure("l0")
        assert first.masked and first.detail.endswith(LEGACY_GUIDANCE)
        judge.mode = "ok"
        again = await registry.verify(
            member(cfg, 1, group=None, attempt=None, task=3, text="regenerated"))
        assert again == first and judge.calls == calls
        async with trio.open_nursery() as nursery:
            fresh = Outcomes(registry, nursery)
            for slot in range(N):
                fresh.send(f"f{slot}", member(cfg, slot, group="fresh-id", task=3))
        assert all(isinstance(fresh.results[f"f{s}"][1], Rewarded) for s in range(N))


async def test_retention_count_cap_and_ttl(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(num_rollouts_per_prompt=2, max_terminal_cohorts=3, cohort_result_ttl_s=100.0)
    judge = ScriptedJudge()
    async with open_registry(cfg, judge) as registry:
        for g in range(5):
            async with trio.open_nursery() as nursery:
                out = Outcomes(registry, nursery)
                for slot in range(2):
                    out.send(f"{slot}", member(cfg, slot, group=f"g{g}"))
            await trio.sleep(10.0)
        snap = registry.snapshot()
        # Records: the cap. Watermarks outlive records (twice the cap and the TTL), so an
        # evicted attempt is recognised instead of waiting out a fresh collection.
        assert snap["retained_records"] == 3 and snap["watermarks"] == 5
        calls = judge.calls
        assert isinstance(await registry.verify(member(cfg, 0, group="g4")), Rewarded)
        assert judge.calls == calls  # g4 retained: replay
        evicted = await registry.verify(member(cfg, 0, group="g0"))  # over the record cap
        assert isinstance(evicted, Failure) and evicted.kind == "result_expired"
        await trio.sleep(100.0)  # every record is now past its TTL
        started = trio.current_time()
        expired = await registry.verify(member(cfg, 0, group="g4"))
        assert isinstance(expired, Failure)
        assert (expired.status, expired.kind) == (409, "result_expired")
        assert "higher _ng_group_attempt" in expired.detail
        assert trio.current_time() == started and judge.calls == calls  # at once, no judging
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            for slot in range(2):
                out.send(f"{slot}", member(cfg, slot, group="g4", attempt=1))
        assert judge.calls == calls + 2  # the replacement attempt is judged afresh
        assert registry.snapshot()["retained_records"] == 1
        await trio.sleep(200.0)  # watermarks too are past their (doubled) TTL
        assert registry.snapshot()["watermarks"] >= 1  # pruning runs on the next request
        await registry.verify(member(cfg, 0, group="other", attempt=0, text="x"))
        assert registry.snapshot()["watermarks"] == 1  # only the group just opened


async def test_admission_control_only_refuses_new_cohorts(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(max_active_cohorts=1)
    judge = ScriptedJudge()
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("a0", member(cfg, 0, group="a"))
        await trio.testing.wait_all_tasks_blocked()
        before = registry.snapshot()
        refused = await registry.verify(member(cfg, 0, group="b"))
        assert isinstance(refused, Failure)
        assert (refused.status, refused.kind, refused.retry_after_s) == (429, "overloaded", 1.0)
        assert registry.snapshot() == before
        for slot in range(1, N):  # members of the existing cohort are always admitted
            out.send(f"a{slot}", member(cfg, slot, group="a"))
    assert all(isinstance(out.results[f"a{s}"][1], Rewarded) for s in range(N))


async def test_shutdown_releases_everyone(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for()
    judge = ScriptedJudge(mode="hang")
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot in range(N):
            out.send(f"judging{slot}", member(cfg, slot, group="judging"))
        out.send("collecting", member(cfg, 0, group="collecting"))
        await trio.sleep(3.0)
        registry.begin_shutdown()
        await trio.testing.wait_all_tasks_blocked()
        late = await registry.verify(member(cfg, 1, group="collecting"))
        assert isinstance(late, Failure) and late.kind == "shutdown"
    assert len(out.results) == N + 1
    for t, outcome in out.results.values():
        assert t == 3.0
        assert isinstance(outcome, Failure) and (outcome.status, outcome.kind) == (503, "shutdown")
    assert judge.cancelled == N


async def test_eager_schedule_gives_the_same_rewards_earlier(
    autojump_clock: trio.abc.Clock,
) -> None:
    results = {}
    for schedule in ("wait_for_all", "eager"):
        cfg = cfg_for(judge_schedule=schedule, comparison_strategy="all_pairs")
        judge = ScriptedJudge(latency_s=4.0)
        async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
            start = trio.current_time()
            out = Outcomes(registry, nursery)
            for slot in range(N):
                out.send(f"m{slot}", member(cfg, slot))
                await trio.sleep(5.0)
        results[schedule] = (
            [out.reward(f"m{s}") for s in range(N)],
            out.results["m0"][0] - start,
        )
    assert results["eager"][0] == results["wait_for_all"][0]
    assert results["wait_for_all"][1] == 15.0 + 4.0
    assert results["eager"][1] == 15.0 + 4.0  # the pairs with the last member still take 4 s


async def test_a_handler_watching_its_connection_is_woken_by_its_cohort(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An HTTP handler's member (verify_unless_gone) that waits past DISCONNECT_WATCH_AFTER_S
    reads its connection meanwhile; its cohort's resolution must still wake it at once, with
    the same rewards as plain waiters, and leave no waiter behind."""
    cfg = cfg_for()
    judge = ScriptedJudge(latency_s=1.0)
    expected = reference_rewards(cfg, [answer(s) for s in range(N)])
    still_connected = trio.Event()  # never set: the client stays
    got: dict[int, tuple[float, object]] = {}
    async with open_registry(cfg, judge) as registry:

        async def handler(slot: int) -> None:
            outcome = await registry.verify_unless_gone(member(cfg, slot), still_connected.wait)
            got[slot] = (trio.current_time(), outcome)

        with trio.fail_after(100):  # a waiter nobody wakes would hang here (virtual time)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(handler, 0)
                await trio.sleep(DISCONNECT_WATCH_AFTER_S * 5)  # long past the watch start
                assert registry.snapshot()["waiters"] == 1
                for slot in range(1, N):
                    nursery.start_soon(handler, slot)
        start = DISCONNECT_WATCH_AFTER_S * 5
        assert {t for t, _ in got.values()} == {start + 1.0}  # one judge latency later
        rewards = [got[s][1] for s in range(N)]
        assert all(isinstance(r, Rewarded) for r in rewards)
        assert [r.reward for r in rewards if isinstance(r, Rewarded)] == expected
        assert registry.snapshot()["waiters"] == 0


async def test_a_client_gone_removes_only_its_waiter_within_the_watch_delay(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A handler whose client hangs up gets None (nobody to answer) no later than
    DISCONNECT_WATCH_AFTER_S after it arrived, or at once when it hangs up later; its waiter
    goes, its member stays, and the cohort completes for the others."""
    cfg = cfg_for()
    judge = ScriptedJudge(latency_s=1.0)
    early_gone, late_gone, stays = trio.Event(), trio.Event(), trio.Event()
    got: dict[str, tuple[float, object]] = {}
    async with open_registry(cfg, judge) as registry:

        async def handler(name: str, slot: int, gone: trio.Event) -> None:
            outcome = await registry.verify_unless_gone(member(cfg, slot), gone.wait)
            got[name] = (trio.current_time(), outcome)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(handler, "early", 0, early_gone)
            nursery.start_soon(handler, "late", 1, late_gone)
            await trio.sleep(0.25)
            early_gone.set()  # hangs up before the watch starts
            await trio.sleep(DISCONNECT_WATCH_AFTER_S * 3)
            late_gone.set()  # hangs up while watched
            await trio.testing.wait_all_tasks_blocked()
            assert got["early"] == (DISCONNECT_WATCH_AFTER_S, None)
            assert got["late"] == (0.25 + DISCONNECT_WATCH_AFTER_S * 3, None)
            assert registry.snapshot()["waiters"] == 0
            assert registry.snapshot()["active_cohorts"] == 1  # the members stay
            for slot in range(2, N):
                nursery.start_soon(handler, f"m{slot}", slot, stays)
    assert all(isinstance(got[f"m{s}"][1], Rewarded) for s in range(2, N))
