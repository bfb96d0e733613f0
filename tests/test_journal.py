"""state_dir: terminal records and watermarks survive a restart of the registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trio

from genrm_trio.config import Config
from genrm_trio.server.cohort import Failure, Rewarded
from genrm_trio.server.journal import Journal
from tests.lifecycle_helpers import Outcomes, ScriptedJudge, member, open_registry

N = 3


async def run_group(registry, cfg, **kw):  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot in range(N):
            out.send(f"m{slot}", member(cfg, slot, **kw))
    return out


async def test_records_and_fencing_survive_a_restart(
    tmp_path: Path, autojump_clock: trio.abc.Clock,
) -> None:
    cfg = Config(num_rollouts_per_prompt=N, state_dir=str(tmp_path))
    judge = ScriptedJudge()
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, judge, journal=journal) as registry:
        done = await run_group(registry, cfg, group="explicit")
        judge.mode = "fail"
        failed = await run_group(registry, cfg, group=None, attempt=None, task=4)
        judge.mode = "ok"
        await run_group(registry, cfg, group="fenced", attempt=2)
    journal.close()
    calls = judge.calls

    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, judge, journal=journal) as registry:
        assert registry.snapshot()["retained_records"] == 3
        replay = await registry.verify(member(cfg, 1, group="explicit"))
        assert replay == Rewarded(done.reward("m1"))
        recorded = await registry.verify(
            member(cfg, 0, group=None, attempt=None, task=4, text="regenerated"))
        assert recorded == failed.failure("m0") and recorded.masked
        stale = await registry.verify(member(cfg, 0, group="fenced", attempt=1))
        assert isinstance(stale, Failure) and stale.kind == "stale_attempt"
        assert judge.calls == calls  # nothing was judged again
    journal.close()


async def test_evictions_reach_the_journal(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    cfg = Config(num_rollouts_per_prompt=N, max_terminal_cohorts=2)
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, ScriptedJudge(), journal=journal) as registry:
        for g in range(6):
            await run_group(registry, cfg, group=f"g{g}")
    assert [r.key.group_id for r in journal.records(N)] == ["g4", "g5"]
    # Watermarks are kept for twice the record cap (result_expired needs them).
    assert [w.group_id for w in journal.watermarks()] == ["g2", "g3", "g4", "g5"]
    journal.close()


def test_unusable_state_dir_exits_2_with_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = subprocess.run(
        [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
         "--set", f"state_dir={blocker}/sub"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "state_dir" in result.stderr
