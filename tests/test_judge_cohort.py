"""What the cohort hands the judge and takes back: each comparison's pass number, the
evaluation deadline as the judge's enclosing cancel scope (under both schedules)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from genrm_trio import scoring
from genrm_trio.config import Config
from genrm_trio.server.judge import JudgeRequest
from tests.lifecycle_helpers import Outcomes, heuristic_verdict, member, open_registry


class RecordingJudge:
    """Records each call's pass number and how long its enclosing deadline had left."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []

    async def judge_pair(self, request: JudgeRequest, group: object = None,
                         trace: object = None) -> scoring.Verdict:
        left = trio.current_effective_deadline() - trio.current_time()
        self.calls.append((request.judge_idx, left))
        await trio.sleep(1.0)
        return heuristic_verdict(request)


@pytest.mark.parametrize("schedule", ["wait_for_all", "eager"])
async def test_judge_calls_see_the_evaluation_deadline_and_their_pass(
    schedule: str, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = Config(num_rollouts_per_prompt=3, num_judges_per_comparison=2,
                 cohort_evaluation_timeout_s=50.0, judge_schedule=schedule)
    judge = RecordingJudge()
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        outcomes = Outcomes(registry, nursery)
        for slot in range(3):
            outcomes.send(f"m{slot}", member(cfg, slot))
        await trio.testing.wait_all_tasks_blocked()
    assert sorted(idx for idx, _ in judge.calls) == [0, 0, 0, 1, 1, 1]
    assert all(left == 50.0 for _, left in judge.calls), judge.calls
    assert all(isinstance(outcomes.results[f"m{s}"][1].reward, float)  # type: ignore[union-attr]
               for s in range(3))
