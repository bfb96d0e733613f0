"""The journal's writer (server/journal.py): the loop never waits for the disk; answers of kept
cohorts go out once their commit is confirmed; one commit for everything queued; a stalled or
full writer degrades the journal, never the serving; the shutdown drain is bounded.

A slow disk is the writer's ``run_sync`` seam: every blocking call (a commit, a checkpoint, the
close) first waits ``delay_s`` of Trio time, then runs on the Trio thread, so the autojump clock
makes a 200 ms sync exact. One test uses the real worker thread (no mock clock) to show that a
commit blocked in the thread does not hold the loop. tests/test_journal_slow_disk.py does the
same against a real process whose every fdatasync is slowed by an LD_PRELOAD shim."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from genrm_trio.config import Config
from genrm_trio.server import journal as journal_module
from genrm_trio.server.cohort import Rewarded
from genrm_trio.server.journal import FILE_NAME, STALL_S, Journal
from tests.lifecycle_helpers import ScriptedJudge, member, open_registry

N = 3
SYNC_S = 0.2


class SlowDisk:
    """The writer's ``run_sync``: each blocking call waits ``delay_s`` (Trio time) first."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls += 1
        await trio.sleep(self.delay_s)
        return fn(*args)


def committed_groups(path: Path) -> set[str]:
    """Group ids of the records committed to the file, read by a connection of our own."""
    with sqlite3.connect(path / FILE_NAME) as db:
        rows = db.execute("SELECT key FROM records").fetchall()
    return {key.split('"')[1] for (key,) in rows}


async def cohort(registry: Any, cfg: Config, group: str, answers: list[tuple[str, float]],
                 path: Path, durable: list[bool]) -> None:
    """Send the N members of ``group`` at once; for each answer, note when it came and whether
    its record was committed by then."""

    async def one(slot: int) -> None:
        outcome = await registry.verify(member(cfg, slot, group=group))
        assert isinstance(outcome, Rewarded), outcome
        answers.append((group, trio.current_time()))
        durable.append(group in committed_groups(path))

    async with trio.open_nursery() as nursery:
        for slot in range(N):
            nursery.start_soon(one, slot)


@pytest.mark.parametrize("sync", ["full", "normal"])
async def test_answers_wait_for_one_group_commit_and_the_loop_goes_on(
    tmp_path: Path, autojump_clock: trio.abc.Clock, sync: str,
) -> None:
    """20 cohorts at once on a disk whose every commit takes 200 ms: each answer goes out
    only once its record is committed, after about one or two commits (the one in progress,
    then the one holding it), not after the 60 a commit per write would take."""
    cfg = Config(num_rollouts_per_prompt=N, state_dir=str(tmp_path), state_sync=sync)
    journal = Journal.open(str(tmp_path), sync)
    disk = SlowDisk(SYNC_S)
    answers: list[tuple[str, float]] = []
    durable: list[bool] = []
    async with open_registry(cfg, ScriptedJudge(), journal, run_sync=disk) as registry:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for g in range(20):
                nursery.start_soon(cohort, registry, cfg, f"g{g}", answers, tmp_path, durable)
        took = trio.current_time() - start
        assert journal.status()["degraded"] is False
    journal.close()
    assert len(answers) == 20 * N and all(durable), durable
    # One transaction for everything queued: 20 records, 20 finished watermarks and 20 opening
    # watermarks in a few commits (the opening ones, then the records).
    assert journal.commits <= 4, journal.commits
    assert journal.largest_batch >= 20
    assert all(at - start >= SYNC_S for _, at in answers)  # nothing answered before a commit
    assert took <= 3 * SYNC_S + 1e-6, took
    assert committed_groups(tmp_path) == {f"g{g}" for g in range(20)}


async def test_a_replayed_record_is_answered_once_committed(
    tmp_path: Path, autojump_clock: trio.abc.Clock,
) -> None:
    """A member of a completed cohort, read from memory while that cohort's record is still
    being committed, is answered once the commit is confirmed, not before."""
    cfg = Config(num_rollouts_per_prompt=N, state_dir=str(tmp_path), state_sync="full")
    journal = Journal.open(str(tmp_path), "full")
    answers: list[tuple[str, float]] = []
    durable: list[bool] = []
    async with open_registry(cfg, ScriptedJudge(), journal, run_sync=SlowDisk(SYNC_S)) \
            as registry:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cohort, registry, cfg, "second", answers, tmp_path, durable)
            # The opening watermark's commit ends at SYNC_S; the record's runs until 2 x SYNC_S.
            await trio.sleep(1.5 * SYNC_S)
            assert any(key.group_id == "second" for key in registry._records)
            assert "second" not in committed_groups(tmp_path)  # completed, not committed
            replay = await registry.verify(member(cfg, 0, group="second"))
            assert isinstance(replay, Rewarded)
            assert "second" in committed_groups(tmp_path)
            assert trio.current_time() == pytest.approx(2 * SYNC_S)
        # Nothing queued: a replay is answered at once.
        asked = trio.current_time()
        assert isinstance(await registry.verify(member(cfg, 1, group="second")), Rewarded)
        assert trio.current_time() == asked
    journal.close()
    assert all(durable) and len(durable) == N


async def test_a_stalled_disk_degrades_after_the_bound_and_answers_go_out(
    tmp_path: Path, autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture,
) -> None:
    """Every commit hangs (a stalled disk): the first answers wait STALL_S, then the journal
    is degraded (logged once) and nothing waits for it any more; leaving the writer takes its
    drain bound, not the stall, and what was not committed is counted as lost."""
    cfg = Config(num_rollouts_per_prompt=N, state_dir=str(tmp_path), state_sync="full")
    journal = Journal.open(str(tmp_path), "full")
    answers: list[tuple[str, float]] = []
    durable: list[bool] = []
    async with open_registry(cfg, ScriptedJudge(), journal, run_sync=SlowDisk(10_000.0)) \
            as registry:
        await cohort(registry, cfg, "stuck", answers, tmp_path, durable)
        assert [at for _, at in answers] == [pytest.approx(STALL_S)] * N
        assert journal.degraded and "stalled" in (journal.last_error or "")
        before = trio.current_time()
        await cohort(registry, cfg, "after", answers, tmp_path, durable)
        assert trio.current_time() == before  # degraded: nothing waits for the disk
        left = trio.current_time()
    assert trio.current_time() - left == pytest.approx(journal_module.FLUSH_S)
    assert not any(durable) and len(answers) == 2 * N
    assert "lost" in (journal.last_error or "")
    degraded_logs = [r for r in caplog.records if r.levelno == logging.ERROR
                     and "degraded" in r.getMessage()]
    assert len(degraded_logs) == 1
    assert journal._abandoned  # its call was left running: `close` must not wait for it
    assert journal.put_watermark("late", 0, "a" * 64, 0.0) is None  # dropped, never waited
    journal.close()  # does nothing: the abandoned call may still hold the connection
    journal._db.close()


async def test_a_full_queue_degrades_at_once_and_never_blocks_an_answer(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(journal_module, "MAX_QUEUED_STATEMENTS", 4)
    cfg = Config(num_rollouts_per_prompt=N, state_dir=str(tmp_path), state_sync="full")
    journal = Journal.open(str(tmp_path), "full")
    answers: list[tuple[str, float]] = []
    durable: list[bool] = []
    async with open_registry(cfg, ScriptedJudge(), journal, run_sync=SlowDisk(10_000.0)) \
            as registry:
        async with trio.open_nursery() as nursery:
            for g in range(6):
                nursery.start_soon(cohort, registry, cfg, f"g{g}", answers, tmp_path, durable)
        assert [at for _, at in answers] == [0.0] * (6 * N)
        state = journal.status()
        assert state["degraded"] is True
        assert "waiting for the disk" in state["last_error"]
        assert state["queued_statements"] <= 4
    journal._db.close()


async def test_a_commit_blocked_in_the_worker_thread_does_not_hold_the_loop(
    tmp_path: Path,
) -> None:
    """Real worker thread, real clock: while a commit is held inside its call (as a disk that
    does not return from fdatasync would hold it), the loop answers a cohort that keeps no
    record, and the kept cohort's answer waits until the commit returns."""
    cfg = Config(num_rollouts_per_prompt=2, state_dir=str(tmp_path), state_sync="full")
    journal = Journal.open(str(tmp_path), "full")
    entered, release = threading.Event(), threading.Event()
    transaction = journal._transaction

    def held(statements: Any) -> BaseException | None:
        entered.set()
        if not release.wait(30):
            raise AssertionError("never released")
        return transaction(statements)

    journal._transaction = held  # type: ignore[method-assign]
    kept: list[Any] = []
    legacy: list[Any] = []

    async def one(out: list[Any], slot: int, **kw: Any) -> None:
        out.append(await registry.verify(member(cfg, slot, **kw)))

    with trio.fail_after(30):
        async with open_registry(cfg, ScriptedJudge(), journal, run_sync=None) as registry:
            async with trio.open_nursery() as nursery:
                for slot in range(2):
                    nursery.start_soon(partial(one, kept, slot, group="kept"))
                # The opening watermark's commit is held in the worker thread.
                assert await trio.to_thread.run_sync(entered.wait, 30)
                async with trio.open_nursery() as legacy_cohort:
                    for slot in range(2):
                        legacy_cohort.start_soon(
                            partial(one, legacy, slot, group=None, attempt=None, task=7))
                assert [type(o) for o in legacy] == [Rewarded, Rewarded]
                assert kept == []  # its record waits behind the held commit
                release.set()
            assert [type(o) for o in kept] == [Rewarded, Rewarded]
    journal.close()
    assert "kept" in committed_groups(tmp_path)
    assert journal.degraded is False
