"""``kill -9`` durability: a real ``genrm-trio serve`` with ``state_dir`` is killed mid-run with
cohorts completed, failed (masked judge failure) and still active; a new process on the same
``state_dir`` must replay completed explicit members with zero judge calls, hold failure records
and stale-attempt 409s, and have forgotten the active cohorts (a member of one opens a fresh
cohort)."""

from __future__ import annotations

import json
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from tests.process_helpers import ServeProcess, get_json, http_call, serve_process

N = 2
DEFAULTED = "genrm_defaulted_comparisons"
REUSED = "genrm_reused_comparisons"
COMPLETED = 4
FAILED = 3


def _member(group: str, slot: int, text: str, attempt: int = 0) -> bytes:
    return json.dumps({
        "responses_create_params": {"input": f"Prompt of {group}"},
        "response": {"output": [{"type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": text}]}]},
        "_ng_group_id": group,
        "_ng_group_attempt": attempt,
        "_ng_rollout_index": slot,
        "instance_config": {"tag": group},
    }).encode()


async def _verify(server: ServeProcess, body: bytes) -> tuple[int, dict[str, Any]]:
    status, _, raw = await http_call(server.host, server.port, "POST", "/verify", body)
    return status, (json.loads(raw) if raw else {})


async def _cohort(server: ServeProcess, group: str, *, attempt: int = 0,
                  texts: tuple[str, ...] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """Send every member of one cohort at once; the answers by slot."""
    answers: list[tuple[int, dict[str, Any]]] = [(0, {})] * N

    async def one(slot: int) -> None:
        text = texts[slot] if texts else f"{group} answer {slot} " + "why " * slot
        answers[slot] = await _verify(server, _member(group, slot, text, attempt))

    async with trio.open_nursery() as nursery:
        for slot in range(N):
            nursery.start_soon(one, slot)
    return answers


def _without_defaulted(answer: tuple[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    status, body = answer
    return status, {k: v for k, v in body.items() if k not in (DEFAULTED, REUSED)}


async def _status(server: ServeProcess) -> dict[str, Any]:
    snapshot: dict[str, Any] = (await get_json(server.host, server.port, "/status"))["cohorts"]
    return snapshot


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
async def test_kill_9_keeps_records_and_fencing_and_forgets_active_cohorts(
    tmp_path: Path,
) -> None:
    judge = MockJudgeState()
    settings = [
        f"num_rollouts_per_prompt={N}", f"state_dir={tmp_path / 'state'}",
        "cohort_collection_timeout_s=600", "cohort_evaluation_timeout_s=600",
        "genrm_parse_retries=1", "genrm_parse_retry_sleep_s=0", "log_level=WARNING",
    ]
    log = tmp_path / "serve.log"
    async with trio.open_nursery() as judge_nursery:
        judge_url = await judge_nursery.start(
            partial(run_mock_judge, MockJudgeSettings(), state=judge))

        # ---- first process: build up every kind of state, then SIGKILL it mid-run
        completed: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        failed: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        async with serve_process(settings, log, judge_urls=(judge_url,)) as first:
            for index in range(COMPLETED):
                completed[f"done-{index}"] = await _cohort(first, f"done-{index}")
            # Fencing: attempt 1 of `fenced` completes, so attempt 0 is stale from now on.
            await _cohort(first, "fenced", attempt=0)
            completed["fenced@1"] = await _cohort(first, "fenced", attempt=1)
            judge.set_fault(Fault.HTTP_503, None)
            for index in range(FAILED):
                failed[f"failed-{index}"] = await _cohort(first, f"failed-{index}")
            judge.set_fault(Fault.NONE, None)
            for answers in completed.values():
                assert [status for status, _ in answers] == [200] * N, answers
                assert all(not body["mask_sample"] for _, body in answers)
            for answers in failed.values():
                assert [status for status, _ in answers] == [200] * N, answers
                assert all(body["failure_kind"] == "judge_failed" for _, body in answers)
            stale_before = await _verify(first, _member("fenced", 0, "any", attempt=0))
            assert stale_before[0] == 409 and stale_before[1]["failure_kind"] == "stale_attempt"

            # Active cohorts: two collecting (one member each), one evaluating (judge hangs).
            lost: list[int] = []

            async def doomed(body: bytes) -> None:
                lost.append((await _verify(first, body))[0])

            async with trio.open_nursery() as clients:
                clients.start_soon(doomed, _member("collecting-0", 0, "first half"))
                clients.start_soon(doomed, _member("collecting-1", 1, "second half"))
                judge.set_fault(Fault.HANG, None)
                for slot in range(N):
                    clients.start_soon(doomed, _member("evaluating", slot, f"e{slot}"))
                with trio.fail_after(30):
                    while True:  # real process: poll until all four wait
                        snapshot = await _status(first)
                        if snapshot["waiters"] == 4 and snapshot["evaluating"] == 1:
                            break
                        await trio.sleep(0.05)
                before_kill = snapshot
                first.proc.send_signal(signal.SIGKILL)
                with trio.fail_after(10):
                    await first.proc.wait()
            assert lost == [0, 0, 0, 0]  # connections dropped, no answer: the process died
        assert first.proc.returncode == -signal.SIGKILL
        assert before_kill["active_cohorts"] == 3

        # ---- second process on the same state_dir
        judge.reset()
        async with serve_process(settings, log, judge_urls=(judge_url,)) as second:
            snapshot = await _status(second)
            assert snapshot["active_cohorts"] == 0 and snapshot["waiters"] == 0, snapshot
            # Completed explicit members replay, identical bodies, no judge call.
            for group, answers in completed.items():
                name, _, attempt = group.partition("@")
                replayed = await _cohort(second, name, attempt=int(attempt or 0))
                assert [_without_defaulted(a) for a in replayed] == [
                    _without_defaulted(a) for a in answers], (group, replayed, answers)
                # The count of defaulted comparisons is not journaled (cohort.py: unknown
                # after a restart): null, never a wrong number.
                assert all(body[DEFAULTED] is None for _, body in replayed)
                assert all(body[REUSED] is None for _, body in replayed)
            # Failure records hold: the same masked answer, even for a regenerated response.
            for group, answers in failed.items():
                again = await _cohort(second, group, texts=("new text 0", "new text 1"))
                for (status, body), (_, old_body) in zip(again, answers, strict=True):
                    assert status == 200 and body["mask_sample"] is True
                    assert body["failure_kind"] == "judge_failed"
                    assert body["failure_reason"] == old_body["failure_reason"]
                    assert body["instance_config"] == {"tag": group, "mask_sample": True}
            # Stale attempts stay fenced.
            assert await _verify(second, _member("fenced", 0, "any", attempt=0)) == stale_before
            assert judge.calls == 0, judge.snapshot()

            # The active cohorts are gone: a member of each opens a fresh cohort, which then
            # completes with judge calls of its own.
            async with trio.open_nursery() as clients:
                fresh: list[tuple[int, dict[str, Any]]] = []

                async def member(body: bytes) -> None:
                    fresh.append(await _verify(second, body))

                clients.start_soon(member, _member("collecting-0", 1, "other half"))
                with trio.fail_after(30):
                    while True:
                        snapshot = await _status(second)
                        if snapshot["collecting"] == 1 and snapshot["waiters"] == 1:
                            break
                        await trio.sleep(0.05)
                assert judge.calls == 0
                clients.start_soon(member, _member("collecting-0", 0, "first half"))
            assert [status for status, _ in fresh] == [200, 200], fresh
            assert judge.calls == N
            for group in ("collecting-1", "evaluating"):
                answers = await _cohort(second, group)
                assert [status for status, _ in answers] == [200] * N, (group, answers)
            assert judge.calls == 3 * N
            second.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await second.proc.wait() == 0, second.log_tail()
        judge_nursery.cancel_scope.cancel()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
