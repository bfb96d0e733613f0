"""Real TCP, end to end: collector -> genrm-trio server -> mock judge, with the mock policy.

Every test binds 127.0.0.1 port 0 and runs on the real clock with sub-second deadlines.
Online metrics (written by the collector) must equal offline ones (``genrm-trio aggregate``)
byte for byte, and aggregation must leave the sidecar untouched.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from click.testing import CliRunner

from genrm_trio.caller.aggregate import (
    aggregate_cli,
    failures_path_for,
    metrics_path_for,
    read_jsonl,
)
from genrm_trio.caller.collect import CollectionResult, CollectOptions, run_collection
from genrm_trio.caller.mock_policy import MockPolicySettings, MockPolicyState, run_mock_policy
from genrm_trio.config import load_config
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.serve import run_server


@dataclass
class Stack:
    server_url: str
    policy_url: str
    judge: MockJudgeState
    policy: MockPolicyState
    n: int


@asynccontextmanager
async def stack(
    n: int = 4,
    *,
    policy_settings: MockPolicySettings | None = None,
    # Long enough that a starved machine still collects every group (an eighth of a core
    # once missed 1 s); the tests of the deadline itself pass a short one.
    collection_timeout_s: float = 10.0,
    extra: tuple[str, ...] = (),
) -> AsyncIterator[Stack]:
    judge_state = MockJudgeState()
    policy_state = MockPolicyState()
    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(
            partial(run_mock_judge, MockJudgeSettings(), state=judge_state)
        )
        policy_url = await nursery.start(
            partial(run_mock_policy, policy_settings or MockPolicySettings(), state=policy_state)
        )
        cfg = load_config(
            None,
            [
                "port=0",  # not the default 8000: parallel test runs would collide
                f"num_rollouts_per_prompt={n}",
                "port=0",  # never the default 8000: other suites run at the same time
                f"cohort_collection_timeout_s={collection_timeout_s}",
                "cohort_evaluation_timeout_s=5",
                "judge_request_timeout_s=2",
                "genrm_parse_retries=0",
                "genrm_parse_retry_sleep_s=0.01",
                f'judge.base_urls=["{judge_url}"]',
                # An outage must not leave the one endpoint cooling down for the next run.
                "judge.endpoint_cooldown_s=0.01",
                *extra,
            ],
            {},
        )
        server_url = await nursery.start(run_server, cfg)
        yield Stack(server_url, policy_url, judge_state, policy_state, n)
        nursery.cancel_scope.cancel()


def write_tasks(path: Path, count: int) -> Path:
    rows = [
        {
            "responses_create_params": {
                "input": [{"role": "user", "content": f"Task {i}: add {i}+{i}"}]
            },
            "prompt_id": f"p{i}",
        }
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def opts(s: Stack, tmp: Path, tasks: int = 2, **kw: Any) -> CollectOptions:
    input_path = tmp / "tasks.jsonl"
    if not input_path.exists():
        write_tasks(input_path, tasks)
    base: dict[str, Any] = dict(
        input_path=str(input_path),
        output_path=str(tmp / "out.jsonl"),
        server_url=s.server_url,
        policy_url=s.policy_url,
        num_repeats=s.n,
        verify_timeout_s=10.0,
        policy_timeout_s=5.0,
    )
    base.update(kw)
    return CollectOptions(**base)


async def collect(options: CollectOptions) -> CollectionResult:
    return await run_collection(options, progress_stream=io.StringIO())


def offline(out: Path, classes: tuple[str, ...]) -> Any:
    args = [str(out)]
    for cls in classes:
        args += ["--count-failure-classes-as-zero", cls]
    return CliRunner().invoke(aggregate_cli, args)


def check_parity_and_guard(out: Path, result: CollectionResult, classes: tuple[str, ...]) -> None:
    """Online result vs offline recomputation, sidecar untouched, no-result guard on both."""
    sidecar_before = failures_path_for(out).read_bytes()
    metrics_file = metrics_path_for(out)
    if result.exit_code == 0:
        online = metrics_file.read_bytes()
        answer = offline(out, classes)
        assert answer.exit_code == 0, answer.output
        assert answer.output.encode() == online
        assert metrics_file.read_bytes() == online
    else:
        assert not metrics_file.exists()
        answer = offline(out, classes)
        assert answer.exit_code == 1
        assert not metrics_file.exists()
    assert failures_path_for(out).read_bytes() == sidecar_before


@pytest.mark.parametrize(
    ("classes", "exit_code"),
    [(("judge_failed",), 0), ((), 1), (("agent_run_error",), 1)],
)
async def test_judge_outage_masks_everything(
    tmp_path: Path, classes: tuple[str, ...], exit_code: int
) -> None:
    async with stack() as s:
        s.judge.set_fault(Fault.HTTP_503, None)
        result = await collect(opts(s, tmp_path, count_failure_classes_as_zero=classes))
    out = tmp_path / "out.jsonl"
    assert out.read_bytes() == b""
    sidecar = read_jsonl(failures_path_for(out))
    assert len(sidecar) == 8
    assert {r["_ng_failure_class"] for r in sidecar} == {"judge_failed"}
    assert all(r["mask_sample"] is True and r["reward"] == 0.0 for r in sidecar)
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in sidecar) == [
        (t, i) for t in range(2) for i in range(4)
    ]
    assert result.exit_code == exit_code
    if exit_code == 0:
        assert result.metrics is not None
        assert result.metrics["key_metrics"]["mean/reward"] == 0.0
        assert json.loads(metrics_path_for(out).read_bytes())["key_metrics"]["mean/reward"] == 0.0
    check_parity_and_guard(out, result, classes)


@pytest.mark.parametrize(
    ("classes", "exit_code"),
    [(("agent_request_failed", "agent_run_error"), 0), ((), 1), (("judge_failed",), 1)],
)
async def test_collection_timeout_when_a_member_never_arrives(
    tmp_path: Path, classes: tuple[str, ...], exit_code: int
) -> None:
    # The policy fails the first generation; that member is never sent, the cohort times out.
    async with stack(policy_settings=MockPolicySettings(fail_first_n=1),
                     collection_timeout_s=0.5) as s:
        result = await collect(opts(
            s, tmp_path, tasks=1, policy_retries=0, route_failures_to_sidecar=True,
            count_failure_classes_as_zero=classes,
        ))
        assert s.judge.calls == 0
    out = tmp_path / "out.jsonl"
    assert out.read_bytes() == b""
    sidecar = read_jsonl(failures_path_for(out))
    by_class = sorted((r["_ng_failure_class"], r["_ng_failure_stage"], r["_ng_failure_http_status"])
                      for r in sidecar)
    assert by_class == [("agent_request_failed", "verify", 503)] * 3 + [
        ("agent_run_error", "policy", 500)
    ]
    verify_rows = [r for r in sidecar if r["_ng_failure_stage"] == "verify"]
    assert all("cohort_incomplete" in r["_ng_failure_response_body"] for r in verify_rows)
    assert result.exit_code == exit_code
    if exit_code == 0:
        assert result.metrics is not None
        assert result.metrics["key_metrics"]["mean/reward"] == 0.0
        assert result.metrics["agent_metrics"]["rollouts/scored"] == 4
    check_parity_and_guard(out, result, classes)


@pytest.mark.parametrize("classes", [(), ("agent_run_error",)])
async def test_partial_groups_write_the_cohort_fields_and_metrics_match_offline(
    tmp_path: Path, classes: tuple[str, ...],
) -> None:
    # Two tasks with one prompt: the mock policy numbers their 8 generations 0..7 in order (one
    # group at a time), and the 8th, task 1's last, is a straggler 1.5 s late. Task 0's cohort
    # is full; task 1's is judged over its 3 members at the 0.5 s deadline and the straggler's
    # /verify gets 409 cohort_closed.
    prompt = {"input": [{"role": "user", "content": "Add 2+2 and explain."}]}
    (tmp_path / "tasks.jsonl").write_text("".join(
        json.dumps({"responses_create_params": prompt, "prompt_id": f"p{i}"}) + "\n"
        for i in range(2)))
    async with stack(policy_settings=MockPolicySettings(straggler_every=8, straggler_delay_s=1.5),
                     collection_timeout_s=0.5,
                     extra=("incomplete_cohort_policy=judge_present",)) as s:
        result = await collect(opts(s, tmp_path, max_concurrent_groups=1,
                                    route_failures_to_sidecar=True,
                                    count_failure_classes_as_zero=classes))
    out = tmp_path / "out.jsonl"
    rows = read_jsonl(out)
    scored = sorted((r["_ng_task_index"], r["_ng_rollout_index"], r["genrm_cohort_expected"],
                     r["genrm_cohort_scored"]) for r in rows)
    [straggler] = read_jsonl(failures_path_for(out))
    late = straggler["_ng_rollout_index"]  # whichever member asked the policy last
    assert straggler["_ng_task_index"] == 1
    assert [(t, i) for t, i, _e, _m in scored] == [(0, i) for i in range(4)] + [
        (1, i) for i in range(4) if i != late]
    assert [(e, m) for _t, _i, e, m in scored] == [(4, 4)] * 4 + [(4, 3)] * 3
    assert straggler["_ng_failure_http_status"] == 409
    assert straggler["_ng_failure_class"] == "agent_run_error"
    assert '"failure_kind":"cohort_closed"' in straggler["_ng_failure_response_body"]
    assert result.exit_code == 0 and result.metrics is not None
    by_task = {g["_ng_task_index"]: g for g in result.metrics["group_level_metrics"]}
    assert by_task[0]["mean/genrm_cohort_scored"] == 4.0
    assert by_task[1]["mean/genrm_cohort_scored"] == 3.0
    assert by_task[1]["mean/genrm_cohort_expected"] == 4.0
    agent = result.metrics["agent_metrics"]
    assert agent["rollouts/scored"] == (8 if classes else 7)
    check_parity_and_guard(out, result, classes)


@pytest.mark.parametrize("classes", [(), ("judge_failed",)])
async def test_mixed_success_parity(tmp_path: Path, classes: tuple[str, ...]) -> None:
    async with stack() as s:
        s.judge.set_fault(Fault.HTTP_503, 1)  # the first judge call fails: one group masked
        result = await collect(opts(
            s, tmp_path, tasks=4, max_concurrent_groups=1, count_failure_classes_as_zero=classes,
        ))
    out = tmp_path / "out.jsonl"
    assert result.exit_code == 0
    assert len(read_jsonl(out)) == 12
    assert len(read_jsonl(failures_path_for(out))) == 4
    assert result.metrics is not None
    agent = result.metrics["agent_metrics"]
    if classes:
        assert agent["rollouts/scored"] == 16 and "coverage/masked_rollouts" not in agent
    else:
        assert agent["rollouts/scored"] == 12
        assert agent["coverage/masked_rollouts"] == 4
        assert agent["coverage/fully_masked_tasks"] == 1
        assert len(result.metrics["group_level_metrics"]) == 3
    check_parity_and_guard(out, result, classes)


async def test_resume_legacy_failure_then_fresh_group_then_nothing_left(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    async with stack() as s:
        s.judge.set_fault(Fault.HTTP_503, None)
        first = await collect(opts(s, tmp_path, legacy_groups=True))
        assert first.exit_code == 1 and first.masked == 8
        assert {r.get("_ng_group_id") for r in read_jsonl(failures_path_for(out))} == {None}

        s.judge.set_fault(Fault.NONE, None)
        judge_calls = s.judge.calls
        # The retained legacy cohorts answer with their failure again: no judge call.
        again = await collect(opts(s, tmp_path, legacy_groups=True, resume=True))
        assert again.exit_code == 1 and again.masked == 8 and again.successes == 0
        assert s.judge.calls == judge_calls
        assert len(read_jsonl(failures_path_for(out))) == 16

        # A fresh explicit group id per task replaces them, and is judged.
        fresh = await collect(opts(s, tmp_path, resume=True))
        assert fresh.exit_code == 0 and fresh.successes == 8
        assert s.judge.calls > judge_calls
        rows = read_jsonl(out)
        assert len(rows) == 8 and all(isinstance(r["_ng_group_id"], str) for r in rows)
        assert len({r["_ng_group_id"] for r in rows}) == 2

        policy_calls = s.policy.generation_requests
        idle = await collect(opts(s, tmp_path, resume=True))
        assert s.policy.generation_requests == policy_calls
        assert idle.groups_planned == 0 and idle.groups_skipped == 2 and idle.exit_code == 0
    assert idle.metrics is not None
    assert idle.metrics["agent_metrics"]["rollouts/scored"] == 8
    check_parity_and_guard(out, idle, ())


async def test_replace_failed_groups_after_outage(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    async with stack() as s:
        s.judge.set_fault(Fault.HTTP_503, None)
        first = await collect(opts(s, tmp_path, tasks=3))
        assert first.exit_code == 1
        failed_ids = {r["_ng_task_index"]: r["_ng_group_id"]
                      for r in read_jsonl(failures_path_for(out))}
        assert len(set(failed_ids.values())) == 3
        sidecar_before = failures_path_for(out).read_bytes()

        s.judge.set_fault(Fault.NONE, None)
        replaced = await collect(opts(s, tmp_path, replace_failed_groups=True))
    assert replaced.exit_code == 0 and replaced.successes == 12
    rows = read_jsonl(out)
    assert len(rows) == 12
    assert all(r["_ng_group_attempt"] == 1 for r in rows)
    assert all(r["_ng_group_id"] == failed_ids[r["_ng_task_index"]] for r in rows)
    assert failures_path_for(out).read_bytes() == sidecar_before
    assert replaced.metrics is not None
    assert replaced.metrics["agent_metrics"]["rollouts/scored"] == 12
    assert "coverage/masked_rollouts" not in replaced.metrics["agent_metrics"]
    check_parity_and_guard(out, replaced, ())


async def test_group_admission_never_strands_a_cohort(tmp_path: Path) -> None:
    # One group at a time, N = 8, a short collection deadline and uneven policy latency:
    # all members of a group are admitted together, so no cohort can time out.
    policy = MockPolicySettings(
        latency_distribution="uniform", latency_mean_s=0.05, latency_spread_s=0.05
    )
    async with stack(8, policy_settings=policy, collection_timeout_s=0.5) as s:
        result = await collect(opts(
            s, tmp_path, tasks=4, max_concurrent_groups=1, route_failures_to_sidecar=True,
        ))
    out = tmp_path / "out.jsonl"
    assert result.exit_code == 0
    assert result.successes == 32 and result.failed == 0 and result.masked == 0
    assert read_jsonl(failures_path_for(out)) == []
    check_parity_and_guard(out, result, ())


async def test_chat_policy_and_server_aggregate_metrics_agree(tmp_path: Path) -> None:
    # A chat-completions policy works too; and the server's /aggregate_metrics (what NeMo Gym's
    # own collector calls) gives the same metrics for the same rows.
    async with stack(2) as s:
        result = await collect(opts(s, tmp_path, tasks=2, policy_api="chat"))
        rows = read_jsonl(tmp_path / "out.jsonl")
        async with httpx2.AsyncClient(timeout=None, trust_env=False) as client:
            with trio.fail_after(5):
                answer = await client.post(
                    f"{s.server_url}/aggregate_metrics", json={"verify_responses": rows}
                )
    assert result.exit_code == 0 and len(rows) == 4
    assert all(r["response"]["output"][0]["content"][0]["text"] for r in rows)
    assert answer.status_code == 200
    assert answer.json() == json.loads(metrics_path_for(tmp_path / "out.jsonl").read_bytes())
