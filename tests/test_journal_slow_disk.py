"""A real ``genrm-trio serve`` with ``state_dir`` on a slow disk: every fdatasync/fsync of the
process delayed by an LD_PRELOAD shim compiled here (genrm_trio/bench/sync_shim.py).

- 200 ms per sync, ``state_sync: full``: cohorts sent together are all rewarded, in a few
  group commits (one per batch, not one per write); a restart replays every one of them with
  no judge call (each answer went out after its record was durable).
- A stalled disk (20 s per sync): the answer goes out after the journal's stall bound with the
  journal degraded, and SIGTERM ends the process within the shutdown grace plus the cleanup
  allowance, not after the stall (the records not yet durable are lost, as documented).

Timing goals (probe latency, throughput) live in the ``slow_disk`` bench preset."""

from __future__ import annotations

import json
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from genrm_trio.bench.sync_shim import ShimUnavailable, build_sync_shim, shim_env
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.journal import STALL_S, Journal
from tests.process_helpers import ServeProcess, get_json, http_call, serve_process

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD shim")

N = 2
COHORTS = 12


def _member(group: str, slot: int) -> bytes:
    return json.dumps({
        "responses_create_params": {"input": f"Prompt of {group}"},
        "response": {"output": [{"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": f"{group} answer {slot} " + "why " * slot}]}]},
        "_ng_group_id": group, "_ng_group_attempt": 0, "_ng_rollout_index": slot,
    }).encode()


async def _cohorts(server: ServeProcess, groups: list[str]) -> dict[str, list[Any]]:
    """Every member of every group at once; (status, reward) by group, in slot order."""
    answers: dict[str, list[Any]] = {g: [None] * N for g in groups}

    async def one(group: str, slot: int) -> None:
        status, _, raw = await http_call(server.host, server.port, "POST", "/verify",
                                         _member(group, slot))
        body = json.loads(raw)
        answers[group][slot] = (status, None if body.get("mask_sample") else body["reward"])

    async with trio.open_nursery() as nursery:
        for group in groups:
            for slot in range(N):
                nursery.start_soon(one, group, slot)
    return answers


def _shim(tmp_path: Path) -> Path:
    try:
        return build_sync_shim(tmp_path / "shim")
    except ShimUnavailable as exc:
        pytest.skip(str(exc))


async def test_a_slow_disk_with_full_sync_answers_every_cohort_durably(tmp_path: Path) -> None:
    library = _shim(tmp_path)
    count = tmp_path / "syncs"
    state = tmp_path / "state"
    Journal.open(str(state)).close()  # created before the shim slows the process
    settings = [f"num_rollouts_per_prompt={N}", f"state_dir={state}", "state_sync=full",
                "log_level=WARNING", "shutdown_grace_s=2"]
    log = tmp_path / "serve.log"
    judge = MockJudgeState()
    groups = [f"slow-{i}" for i in range(COHORTS)]
    async with trio.open_nursery() as judge_nursery:
        judge_url = await judge_nursery.start(
            partial(run_mock_judge, MockJudgeSettings(), state=judge))
        with trio.fail_after(120):
            async with serve_process(settings, log, judge_urls=(judge_url,),
                                     extra_env=shim_env(library, 200, count)) as first:
                answers = await _cohorts(first, groups)
                status = (await get_json(first.host, first.port, "/status"))["journal"]
                first.proc.send_signal(signal.SIGTERM)
                assert await first.proc.wait() == 0, first.log_tail()
            for group, got in answers.items():
                assert [s for s, _ in got] == [200] * N and None not in [r for _, r in got], (
                    group, got)
            assert status["degraded"] is False, status
            # 12 opening watermarks, 12 records and 12 finished watermarks (and the kept
            # verdicts): far fewer commits than writes, several writes per commit.
            assert status["commits"] < 2 * COHORTS, status
            assert status["largest_batch"] > 1, status
            assert count.stat().st_size > 0  # the shim did slow this process's syncs
            calls = judge.calls

            # A new process on the same state_dir (no shim): every answer was durable.
            async with serve_process(settings, log, judge_urls=(judge_url,)) as second:
                replayed = await _cohorts(second, groups)
                second.proc.send_signal(signal.SIGTERM)
                assert await second.proc.wait() == 0, second.log_tail()
            assert replayed == answers
            assert judge.calls == calls
        judge_nursery.cancel_scope.cancel()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


async def test_a_stalled_disk_degrades_the_journal_and_never_holds_the_exit(
    tmp_path: Path,
) -> None:
    library = _shim(tmp_path)
    state = tmp_path / "state"
    Journal.open(str(state)).close()
    grace_s = 1.0
    settings = [f"num_rollouts_per_prompt={N}", f"state_dir={state}", "state_sync=full",
                "log_level=WARNING", f"shutdown_grace_s={grace_s}"]
    log = tmp_path / "serve.log"
    async with trio.open_nursery() as judge_nursery:
        judge_url = await judge_nursery.start(partial(run_mock_judge, MockJudgeSettings()))
        with trio.fail_after(120):
            async with serve_process(settings, log, judge_urls=(judge_url,),
                                     extra_env=shim_env(library, 20_000)) as server:
                started = time.monotonic()
                answers = await _cohorts(server, ["stalled"])
                waited = time.monotonic() - started
                status = (await get_json(server.host, server.port, "/status"))["journal"]
                signalled = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                assert await server.proc.wait() == 0, server.log_tail()
                exit_s = time.monotonic() - signalled
        judge_nursery.cancel_scope.cancel()
    assert [s for s, _ in answers["stalled"]] == [200] * N
    assert waited >= STALL_S - 0.5  # it waited for the disk, then for no longer than the bound
    assert waited < 20.0
    assert status["degraded"] is True and "stalled" in status["last_error"], status
    assert exit_s < grace_s + 5.0, exit_s  # the deadline bounds the exit, not the 20 s sync
    text = log.read_text()
    assert text.count("degraded, memory stays the truth") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
