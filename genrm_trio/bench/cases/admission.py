"""``admission``: the cost of admitting a new cohort against many active groups (in process, no
HTTP)."""

from __future__ import annotations

import gc
import time
from typing import Any

import msgspec
import trio
import trio.testing

from genrm_trio.bench.records import BenchContext, Case, RunRecord


class _InstantJudge:
    """A judge that answers every pair at once with a tie: admission is measured, not judging."""

    async def judge_pair(self, request: Any, group: Any = None, trace: Any = None) -> Any:
        from genrm_trio.scoring import Verdict

        return Verdict(score_1=3.0, score_2=3.0, ranking=3.5)


def admission_case(active_groups: int, *, cap: int = 1000, admissions: int = 2000) -> Case:
    """Time ``admissions`` new-cohort admissions (``/verify`` registrations, in process) in a
    registry that already holds ``active_groups`` collecting groups and more idle watermarks
    than ``max_terminal_cohorts`` (``cap``) keeps, so every admission prunes. Reports
    microseconds per admission (the synchronous registration) and watermark visits per
    admission (constant when pruning never walks active groups). Ours alone; ``nemo`` skipped."""
    from genrm_trio.config import Config as ServerConfig
    from genrm_trio.server.cohort import CohortRegistry
    from genrm_trio.wire import decode_verify

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        if kind != "ours":
            return RunRecord({}, notes={"skipped": "in-process measure of our registry"})
        cfg = ServerConfig(num_rollouts_per_prompt=2, max_terminal_cohorts=cap,
                           cohort_collection_timeout_s=1e6, cohort_result_ttl_s=None)
        encode = msgspec.json.Encoder().encode

        def member(group: str, slot: int) -> Any:
            return decode_verify(encode({
                "responses_create_params": {"input": "admission bench prompt"},
                "response": {"id": "r", "output": [{"type": "message", "content": [
                    {"type": "output_text", "text": f"answer {slot}"}]}]},
                "_ng_group_id": group, "_ng_group_attempt": 0, "_ng_rollout_index": slot,
            }), 2)

        async with CohortRegistry.open(cfg, _InstantJudge()) as registry:
            async with trio.open_nursery() as done:  # completed groups: idle watermarks
                for g in range(2 * cap + 10):
                    for slot in (0, 1):
                        done.start_soon(registry.verify, member(f"idle{g}", slot))
            async with trio.open_nursery() as waiting:
                for g in range(active_groups):
                    waiting.start_soon(registry.verify, member(f"active{g}", 0))
                await trio.testing.wait_all_tasks_blocked()
                members = [member(f"new-{i}", 0) for i in range(admissions)]
                visits_before = registry.watermark_visits
                elapsed = 0.0
                # The collector is off while timing: with tens of thousands of live tasks in
                # this process its passes (``serve`` tunes and freezes it) would dominate.
                gc.collect()
                gc.disable()
                for i, one in enumerate(members):
                    # The synchronous admission step of /verify (what every request pays before
                    # it waits), timed alone: task scheduling is not admission cost.
                    start = time.perf_counter()
                    registry._admit(one)
                    elapsed += time.perf_counter() - start
                    if i % 100 == 99:
                        await trio.testing.wait_all_tasks_blocked()
                gc.enable()
                visits = registry.watermark_visits - visits_before
                registry.begin_shutdown()
        return RunRecord({
            "us_per_admission": elapsed / admissions * 1e6,
            "watermark_visits_per_admission": visits / admissions,
        })

    return Case("admission", f"active{active_groups}-cap{cap}", run,
                {"active_groups": active_groups, "max_terminal_cohorts": cap,
                 "admissions": admissions})
