"""Randomized lifecycle torture of the cohort registry (in process, virtual clock) and of a live
server over HTTP, plus proof that the checks have teeth (deliberately broken registries fail)."""

from __future__ import annotations

import functools
import logging
import random
import warnings
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import trio
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genrm_trio import scoring
from genrm_trio.config import Config, JudgeConfig
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.cohort import Cohort, CohortRegistry
from genrm_trio.server.serve import run_server
from genrm_trio.torture.cli import print_local_summary, torture_cli
from genrm_trio.torture.http import run_http_torture
from genrm_trio.torture.local import run_local, run_schedule_sync
from genrm_trio.torture.schedules import (
    ADVANCES_S,
    JUDGE_DELAYS_S,
    JUDGE_MODES,
    NUM_GROUPS,
    Advance,
    Arrive,
    Disconnect,
    JudgeMode,
    NewAttempt,
    Schedule,
    Shutdown,
    generate_schedule,
)
from genrm_trio.torture.shrink import shrink_schedule

# On a failure hypothesis writes a patch with libcst, whose import warns (DeprecationWarning from
# mypy_extensions); with filterwarnings=error that would hide the falsifying example. Import it
# here, quietly, so the later import is a no-op.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import libcst.codemod  # noqa: F401
        import libcst.metadata  # noqa: F401
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _quiet_registry_logs() -> Iterator[None]:
    # The scripted judge's crashes are logged with tracebacks; thousands of them are noise.
    log = logging.getLogger("genrm_trio")
    old = log.level
    log.setLevel(logging.CRITICAL)
    yield
    log.setLevel(old)


groups = st.integers(0, NUM_GROUPS - 1)
single_ops = st.one_of(
    st.builds(Arrive, group=groups, slot=st.integers(0, 2),
              variant=st.sampled_from([0, 0, 0, 1]), prompt=st.sampled_from([0, 0, 0, 0, 1]),
              older=st.sampled_from([False, False, False, True])),
    st.builds(Disconnect, back=st.integers(1, 4)),
    st.builds(NewAttempt, group=groups),
    st.builds(Advance, seconds=st.sampled_from(ADVANCES_S)),
    st.builds(JudgeMode, group=groups, mode=st.sampled_from(JUDGE_MODES),
              delay_s=st.sampled_from(JUDGE_DELAYS_S)),
)
whole_group = st.builds(
    lambda g, order: [Arrive(group=g, slot=s) for s in order],
    groups, st.permutations([0, 1, 2]),
)
schedules = st.builds(
    lambda parts, **kw: Schedule(ops=tuple(op for part in parts for op in part), **kw),
    st.lists(st.one_of(single_ops.map(lambda op: [op]), single_ops.map(lambda op: [op]),
                       whole_group, st.just([Shutdown()])),
             max_size=10)
    .filter(lambda parts: sum(1 for p in parts if p == [Shutdown()]) <= 1),
    n=st.sampled_from([2, 3]),
    strategy=st.sampled_from(["circular", "all_pairs"]),
    eager=st.booleans(),
    max_terminal=st.sampled_from([1, 2, 8]),
    ttl_s=st.sampled_from([30.0, 3.0, None]),
    max_active=st.sampled_from([None, None, 2]),
    judges=st.sampled_from([1, 1, 2]),
)


def _fail_text(schedule: Schedule, violations: list[str]) -> str:
    return schedule.describe() + "\nviolations:\n" + "\n".join(violations)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules)
def test_random_schedules_keep_every_invariant(schedule: Schedule) -> None:
    report = run_schedule_sync(schedule)
    assert not report.violations, _fail_text(schedule, report.violations)


@pytest.mark.parametrize("eager", [False, True], ids=["wait_for_all", "eager"])
def test_seeded_schedules_keep_every_invariant_and_reach_every_outcome(eager: bool) -> None:
    summary = run_local(400, seed=7, eager=eager)
    assert summary.shrunk is None, _fail_text(summary.shrunk, summary.violations)
    assert summary.schedules == 400
    # The generator really exercises the lifecycle: every outcome kind shows up.
    for kind in ("rewarded", "conflict", "cohort_incomplete", "judge_failed", "shutdown",
                 "superseded", "evaluation_error", "prompt_mismatch", "disconnected"):
        assert summary.outcomes[kind] > 0, summary.outcomes


@pytest.mark.parametrize("eager", [False, True], ids=["wait_for_all", "eager"])
def test_partial_cohort_schedules_keep_every_invariant(eager: bool) -> None:
    # incomplete_cohort_policy: judge_present, groups missing a straggler that may come late:
    # partial rewards equal the reference over the members scored, late members get
    # cohort_closed, legacy groups and too few members still fail whole, nothing is left over.
    summary = run_local(400, seed=11, eager=eager, partial=True)
    assert summary.shrunk is None, _fail_text(summary.shrunk, summary.violations)
    for kind in ("rewarded", "rewarded_partial", "cohort_closed", "cohort_incomplete",
                 "judge_failed", "shutdown", "superseded"):
        assert summary.outcomes[kind] > 0, summary.outcomes


def test_cli_local_partial_runs_the_partial_family() -> None:
    result = CliRunner().invoke(torture_cli, ["--local", "--partial", "--schedules", "60",
                                              "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert "rewarded_partial" in result.output and "violations: 0" in result.output


def test_a_seed_reproduces_its_schedule_and_its_report() -> None:
    a = generate_schedule(random.Random(1234))
    b = generate_schedule(random.Random(1234))
    assert a == b
    ra, rb = run_schedule_sync(a), run_schedule_sync(b)
    assert (ra.outcomes, ra.judge_calls, ra.virtual_s) == (rb.outcomes, rb.judge_calls,
                                                          rb.virtual_s)


def test_one_complete_group_is_rewarded_with_the_reference_rewards() -> None:
    schedule = Schedule(ops=(Arrive(0, 1), Arrive(0, 0), Arrive(0, 2)), n=3)
    report = run_schedule_sync(schedule)
    assert report.violations == []
    assert report.outcomes == {"rewarded": 3}
    assert report.judge_calls == 3


# ---------------------------------------------------------------- the checks catch real bugs


class _SlotOrderBug(CohortRegistry):
    """Publishes the rewards in reverse slot order."""

    def _publish(self, cohort: Cohort) -> None:
        super()._publish(cohort)
        cohort.rewards = tuple(reversed(cohort.rewards))


class _ShutdownBug(CohortRegistry):
    """Refuses new requests on shutdown but forgets the waiters."""

    def begin_shutdown(self) -> None:
        self._shutting_down = True


class _EarlyPublishBug(CohortRegistry):
    """Judges and publishes when N-1 slots have arrived."""

    def _add_member(self, cohort: Cohort, slot: int, digest: str, member: Any) -> None:
        super()._add_member(cohort, slot, digest, member)
        if len(cohort.members) == cohort.size - 1 and cohort.phase.value == "collecting":
            missing = next(s for s in range(cohort.size) if s not in cohort.members)
            cohort.members[missing] = cohort.members[slot]
            cohort.phase = type(cohort.phase)("evaluating")
            cohort.arrival.set()


class _LateEagerBug(CohortRegistry):
    """Eager in name only: starts no comparison before the cohort is complete."""

    def _start_ready_pairs(self, cohort: Cohort, nursery: trio.Nursery) -> None:
        if cohort.phase.value != "collecting":
            super()._start_ready_pairs(cohort, nursery)


class _RepeatedPairBug(CohortRegistry):
    """Forgets which comparisons it started, so a duplicate arrival starts them again. Without
    verdict reuse: with it, a finished pair started again takes its kept verdict, no judge
    call, so the harness (which watches judge calls) has nothing to see."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verdicts = None

    def _start_ready_pairs(self, cohort: Cohort, nursery: trio.Nursery) -> None:
        cohort.started_pairs.clear()
        super()._start_ready_pairs(cohort, nursery)


class _EarlyWaitForAllBug(CohortRegistry):
    """Judges pairs as they form even under wait_for_all."""

    def _start_ready_pairs(self, cohort: Cohort, nursery: trio.Nursery) -> None:
        super()._start_ready_pairs(cohort, nursery)

    def _add_member(self, cohort: Cohort, slot: int, digest: str, member: Any) -> None:
        super()._add_member(cohort, slot, digest, member)
        if cohort.phase.value == "collecting":
            self._start_ready_pairs(cohort, self._nursery)


class _FullPlanBug(CohortRegistry):
    """Judges a partial cohort with the comparisons planned for all N, keeping those whose two
    members are present (NeMo Gym PR #2385's semantics: unequal numbers of comparisons)."""

    def _plan_present(self, present: tuple[int, ...]) -> list[tuple[int, int, int]]:
        cfg = self._cfg
        return [(i, j, k) for i, j, k in scoring.comparison_pairs(
            cfg.num_rollouts_per_prompt, cfg.comparison_strategy, cfg.num_judges_per_comparison)
            if i in present and j in present]


class _PolicyIgnoredBug(CohortRegistry):
    """Judges whatever is present at the deadline even where the policy is off."""

    def __init__(self, cfg: Config, judge: Any, nursery: trio.Nursery) -> None:
        super().__init__(msgspec.structs.replace(
            cfg, incomplete_cohort_policy="judge_present", min_cohort_members=2), judge, nursery)


_EAGER_THREE = (JudgeMode(0, "ok", 0.713), Arrive(0, 0), Arrive(0, 1), Advance(0.517),
                Arrive(0, 1), Advance(0.517), Arrive(0, 2))


@pytest.mark.parametrize(
    ("bug", "schedule", "expect"),
    [
        (_LateEagerBug, Schedule(ops=_EAGER_THREE, n=3, eager=True),
         "not at the arrival of one of its members (late)"),
        (_RepeatedPairBug, Schedule(ops=_EAGER_THREE, n=3, eager=True),
         "a second comparison of a pair"),
        (_EarlyWaitForAllBug, Schedule(ops=_EAGER_THREE, n=3), "before all 3 members arrived"),
        (_SlotOrderBug, Schedule(ops=(Arrive(0, 0), Arrive(0, 1), Arrive(0, 2)), n=3),
         "matches no reference"),
        (_ShutdownBug, Schedule(ops=(Arrive(0, 0), Advance(0.517), Shutdown())),
         "still waiting after shutdown"),
        (_EarlyPublishBug, Schedule(ops=(Arrive(1, 0), Arrive(1, 1)), n=3),
         "incomplete cohort"),
        (_FullPlanBug, Schedule(ops=(Arrive(0, 0), Arrive(0, 1), Arrive(0, 3)), n=4,
                                partial=True), "matches no reference"),
        (_PolicyIgnoredBug, Schedule(ops=(Arrive(0, 0), Arrive(0, 1)), n=3),
         "a partial reward (2 of 3) without incomplete_cohort_policy judge_present"),
    ],
)
def test_a_broken_registry_is_caught(bug: type[CohortRegistry], schedule: Schedule,
                                     expect: str) -> None:
    report = run_schedule_sync(schedule, bug)
    assert any(expect in v for v in report.violations), report.violations
    assert not run_schedule_sync(schedule).violations


def test_random_search_finds_a_bug_and_shrinks_it() -> None:
    found = None
    for seed in range(200):
        schedule = generate_schedule(random.Random(seed))
        if run_schedule_sync(schedule, _ShutdownBug).violations:
            found = schedule
            break
    assert found is not None

    def fails(s: Schedule) -> bool:
        return bool(run_schedule_sync(s, _ShutdownBug).violations)

    shrunk = shrink_schedule(found, fails)
    assert fails(shrunk)
    assert len(shrunk.ops) < len(found.ops)
    assert len(shrunk.ops) <= 4, shrunk.describe()
    assert any(isinstance(op, Shutdown) for op in shrunk.ops)
    assert any(isinstance(op, Arrive) for op in shrunk.ops)


def test_a_failing_run_prints_the_shrunk_schedule_and_its_seed(
        capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_local(300, seed=0, registry_factory=_ShutdownBug)
    assert summary.failing_seed is not None and summary.shrunk is not None
    print_local_summary(summary, 0)
    out = capsys.readouterr().out
    assert f"VIOLATION in schedule seed {summary.failing_seed}" in out
    assert "Shutdown()" in out and "still waiting after shutdown" in out
    assert f"--seed {summary.failing_seed} --schedules 1" in out
    # The printed seed reproduces the failure.
    again = run_local(1, seed=summary.failing_seed, registry_factory=_ShutdownBug)
    assert again.failing_seed == summary.failing_seed


def test_cli_local_prints_a_summary_and_exits_zero() -> None:
    result = CliRunner().invoke(torture_cli, ["--local", "--schedules", "60",
                                                      "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert "torture --local: 60 schedules" in result.output
    assert "violations: 0" in result.output


def test_cli_needs_exactly_one_target() -> None:
    result = CliRunner().invoke(torture_cli, [])
    assert result.exit_code == 2
    assert "exactly one of --local and --url" in result.output


# ---------------------------------------------------------------- black box over HTTP


async def test_http_torture_against_our_server_on_loopback() -> None:
    state = MockJudgeState()
    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(functools.partial(
            run_mock_judge, MockJudgeSettings(latency_s=0.002), state=state))
        cfg = Config(
            num_rollouts_per_prompt=3, port=0,
            cohort_collection_timeout_s=0.6, cohort_evaluation_timeout_s=1.5,
            judge_request_timeout_s=0.4, genrm_parse_retries=1, genrm_parse_retry_sleep_s=0.01,
            judge_retry_backoff_max_s=0.05, shutdown_grace_s=1.0,
            judge=JudgeConfig(base_urls=(judge_url,)),
        )
        stop = trio.Event()
        with trio.fail_after(30):
            async with trio.open_nursery() as server:
                url = await server.start(functools.partial(run_server, cfg, shutdown=stop))
                summary = await run_http_torture(
                    url, judge_url=judge_url, max_requests=60, time_limit_s=20,
                    hang_after_s=5, seed=3, settle_s=2.5)
                stop.set()
        nursery.cancel_scope.cancel()
    assert summary.violations == [], summary.violations
    assert summary.hung == 0
    assert summary.requests >= 60
    assert state.calls > 0
    answered = sum(summary.statuses.values())
    assert summary.statuses["200 rewarded"] > 0, summary.statuses
    assert answered + summary.disconnects == summary.requests
