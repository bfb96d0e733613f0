"""veRL 0.9.1's own reward code rewarded by genrm-trio (opt-in: ``-m verl``; needs the ``[verl]``
extra, not in CI).

``genrm-trio mock-judge`` and ``genrm-trio serve`` (``num_rollouts_per_prompt: 4``, JSON logs,
``unparseable_verdict_policy: mask`` with no parse retries, so a garbage verdict masks its
cohort) run as subprocesses on 127.0.0.1 port 0; ``tests/verl_reward_loop.py`` runs veRL in a
subprocess of this Python (see its docstring for what of veRL it calls): the reward loop's
``RewardLoopWorker`` loading :class:`GenRMRewardLoopManager` from a Hydra-composed
``ppo_trainer`` config, the legacy :class:`GenRMRewardManager` on a batch reordered by the
trainer's ``_balance_batch``, and 48 members waiting at once on a loop with a 32-thread default
executor. Checked against the server's own log: every reward comes from a completed 4-member
cohort keyed by the row's uid, each at the row's last valid response token (where veRL's
``assemble_rm_scores`` puts it) and equal to the server's reward for the row's slot.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.process_helpers import REPO, completed_cohort_rewards, mock_judge, serve_process

# Looked up, not imported: veRL runs only in the subprocess.
MISSING = [name for name in ("verl", "torch", "cachetools", "fastapi")
           if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.verl, pytest.mark.skipif(
    bool(MISSING), reason=f"needs {', '.join(MISSING)}: python3 -m pip install torch "
    "'genrm-trio[verl]'")]

N = 4
SCRIPT = REPO / "tests" / "verl_reward_loop.py"
SETTINGS = ["num_rollouts_per_prompt=4", "log_format=json", "unparseable_verdict_policy=mask",
            "genrm_parse_retries=0", "cohort_collection_timeout_s=120",
            "cohort_evaluation_timeout_s=120", "comparison_strategy=all_pairs"]


async def run_mode(tmp_path: Path, mode: str, *extra: str) -> tuple[dict[str, Any],
                                                                    list[dict[str, Any]]]:
    """Run the script in ``mode``: its result and the server's cohort lines."""
    out = tmp_path / mode
    async with trio.open_nursery() as nursery:
        judge = await mock_judge(nursery, tmp_path / "judge.log")
        async with serve_process(SETTINGS, tmp_path / "serve.log",
                                 judge_urls=(judge,)) as server:
            with trio.fail_after(600):
                done = await trio.run_process(
                    [sys.executable, str(SCRIPT), mode, "--url", server.url, "--judge-url",
                     judge, "--out", str(out), *extra],
                    cwd=REPO, check=False, capture_stdout=True, capture_stderr=True)
            assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
            server_log = server.log_path.read_text()
        nursery.cancel_scope.cancel()
    lines = [json.loads(line) for line in server_log.splitlines() if '"event":"cohort"' in line]
    return json.loads((out / "result.json").read_text()), lines


def check_rewarded(rows: list[dict[str, Any]], lines: list[dict[str, Any]]) -> dict[
        str, list[int]]:
    """Every row rewarded from its uid's completed cohort at its slot, the score at its last
    valid response token; the blank answer ('None') lowest of its group. The slots by group."""
    rewards = completed_cohort_rewards(lines, N)
    slots: dict[str, list[int]] = defaultdict(list)
    by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        extra = row["extra"]
        assert extra["genrm_masked"] == 0.0 and extra["genrm_failure_kind"] == ""
        group, slot = extra["genrm_member"].rsplit("#", 1)
        assert group == "verl:" + row["uid"]
        slots[group].append(int(slot))
        by_group[group].append(row)
        # the log rounds to 4 decimals
        assert row["score"] == pytest.approx(rewards[group][int(slot)], abs=1e-4)
        if row["score"] != 0.0:
            assert row["nonzero"] == [row["valid_response_length"] - 1]
    assert set(slots) == set(rewards)
    assert all(sorted(s) == list(range(N)) for s in slots.values())
    for members in by_group.values():
        blank = [r["score"] for r in members if r["response"] == "None"]
        others = [r["score"] for r in members if r["response"] != "None"]
        if blank:
            assert blank[0] < min(others)
    return dict(slots)


async def test_reward_loop_rewards_two_cohorts_and_masks_a_third(tmp_path: Path) -> None:
    result, lines = await run_mode(tmp_path, "loop")
    assert result["manager_class"] == "genrm_trio.integrations.verl.GenRMRewardLoopManager"
    rows = result["rows"]
    assert len(rows) == 2 * N and len({r["uid"] for r in rows}) == 2
    slots = check_rewarded(rows, lines)
    assert len(slots) == 2

    masked = result["masked_rows"]
    assert len(masked) == N
    assert {r["extra"]["genrm_masked"] for r in masked} == {1.0}
    assert {r["extra"]["genrm_failure_kind"] for r in masked} == {"judge_failed"}
    assert all("no parseable verdict" in r["extra"]["genrm_failure_reason"] for r in masked)
    assert {r["score"] for r in masked} == {0.0}
    assert sorted(int(r["extra"]["genrm_member"].rsplit("#", 1)[1]) for r in masked) == [
        0, 1, 2, 3]
    assert [x["kind"] for x in lines].count("judge_failed") == 1
    assert [x["kind"] for x in lines].count("completed") == 2


async def test_legacy_manager_restores_the_balanced_order(tmp_path: Path) -> None:
    result, lines = await run_mode(tmp_path, "legacy")
    assert result["manager_class"] == "genrm_trio.integrations.verl.GenRMRewardManager"
    permutation = result["permutation"]
    assert sorted(permutation) == list(range(2 * N)) and permutation != sorted(permutation)
    rows = result["rows"]
    slots = check_rewarded(rows, lines)
    # Slots in the order each group's rows appear in the balanced batch.
    assert all(s == list(range(N)) for s in slots.values())
    assert len(lines) == 2


async def test_more_members_waiting_than_the_default_executors_threads(tmp_path: Path) -> None:
    result, lines = await run_mode(tmp_path, "pool", "--prompts", "12")
    assert result["executor_threads"] == 32
    rows = result["rows"]
    assert len(rows) == 12 * N > 32
    check_rewarded(rows, lines)
    assert [x["kind"] for x in lines] == ["completed"] * 12
