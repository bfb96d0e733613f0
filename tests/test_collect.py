"""Collector units: metrics input from artifacts, group planning, CLIs, the mock policy."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from click.testing import CliRunner

from genrm_trio.caller.aggregate import (
    aggregate_cli,
    build_metrics_input,
    failures_path_for,
    metrics_path_for,
    split_classes,
)
from genrm_trio.caller.collect import (
    CollectOptions,
    Progress,
    collect_cli,
    plan_groups,
)
from genrm_trio.caller.mock_policy import (
    MockPolicyApp,
    MockPolicySettings,
    MockPolicyState,
    run_mock_policy,
)
from genrm_trio.caller.progress import show_progress
from genrm_trio.metrics import aggregate_metrics, encode_metrics


def success(task: int, rollout: int, reward: float, **extra: Any) -> dict[str, Any]:
    return {
        "_ng_task_index": task, "_ng_rollout_index": rollout, "reward": reward,
        "mask_sample": False, "failure_kind": None, "failure_reason": None,
        "_ng_group_id": f"g{task}", "_ng_group_attempt": 0, **extra,
    }


def judge_failed(
    task: int, rollout: int, gid: str | None = None, attempt: int = 0
) -> dict[str, Any]:
    return {
        "_ng_task_index": task, "_ng_rollout_index": rollout, "reward": 0.0, "mask_sample": True,
        "failure_kind": "judge_failed", "failure_reason": "judge down",
        "_ng_failure_class": "judge_failed", "_ng_failure_judge_error": "judge down",
        "_ng_group_id": gid, "_ng_group_attempt": attempt,
    }


def http_failure(task: int, rollout: int, cls: str, status: int | None) -> dict[str, Any]:
    return {
        "_ng_task_index": task, "_ng_rollout_index": rollout, "_ng_failure_class": cls,
        "_ng_failure_http_status": status, "_ng_group_id": f"g{task}", "_ng_group_attempt": 0,
    }


# -- metrics input ---------------------------------------------------------------------------


def test_counted_failures_enter_as_unmasked_zero_without_failure_fields() -> None:
    mi = build_metrics_input([], [judge_failed(0, 0), judge_failed(0, 1)], ["judge_failed"])
    assert mi.has_result and mi.counted_failures == 2 and mi.failed_rollouts == 0
    for r in mi.rows:
        assert r["reward"] == 0.0 and r["mask_sample"] is False
        assert not any(k.startswith("_ng_failure_") for k in r)


def test_uncounted_masked_rows_are_coverage_and_other_failures_are_failed() -> None:
    failures = [judge_failed(0, 0), http_failure(1, 0, "agent_request_failed", 503)]
    mi = build_metrics_input([success(2, 0, 1.0)], failures, ["agent_run_error"])
    assert mi.failed_rollouts == 1
    assert [r["mask_sample"] for r in mi.rows] == [False, True]


def test_no_success_and_no_counted_failure_has_no_result() -> None:
    assert not build_metrics_input([], [judge_failed(0, 0)], ["agent_run_error"]).has_result
    assert not build_metrics_input([], [], []).has_result


def test_latest_sidecar_row_stands_and_success_wins() -> None:
    failures = [
        http_failure(0, 0, "agent_request_failed", 503),
        judge_failed(0, 0),  # later attempt of the same rollout: this one stands
        judge_failed(1, 0),
    ]
    mi = build_metrics_input([success(1, 0, 2.0)], failures, ["agent_request_failed"])
    # (0, 0)'s latest row is judge_failed (not counted) -> masked; (1, 0) succeeded.
    assert mi.counted_failures == 0 and mi.successes == 1
    assert sorted((r["_ng_task_index"], r["mask_sample"]) for r in mi.rows) == [
        (0, True), (1, False)
    ]


def test_last_success_per_rollout_wins() -> None:
    mi = build_metrics_input([success(0, 0, 1.0), success(0, 0, 5.0)], [], [])
    assert [r["reward"] for r in mi.rows] == [5.0]


def test_split_classes() -> None:
    assert split_classes(["judge_failed,agent_run_error", "judge_failed"]) == (
        "judge_failed", "agent_run_error",
    )


# -- planning --------------------------------------------------------------------------------


def options(**kw: Any) -> CollectOptions:
    base: dict[str, Any] = dict(
        input_path="in.jsonl", output_path="out.jsonl", server_url="http://x", num_repeats=2,
        policy_url="http://p",
    )
    base.update(kw)
    return CollectOptions(**base)


TASKS = [{"responses_create_params": {"input": f"q{i}"}, "group_id": "stale"} for i in range(3)]


def test_fresh_run_mints_one_group_id_per_task() -> None:
    plans, skipped = plan_groups(TASKS, [], [], options(), "run1")
    assert skipped == 0
    assert [(p.task_index, p.group_id, p.attempt) for p in plans] == [
        (0, "run1-0", 0), (1, "run1-1", 0), (2, "run1-2", 0)
    ]
    assert all("group_id" not in p.task for p in plans)
    legacy, _ = plan_groups(TASKS, [], [], options(legacy_groups=True), "run1")
    assert [p.group_id for p in legacy] == [None, None, None]


def test_resume_skips_done_tasks_and_honours_the_retry_cap() -> None:
    successes = [success(0, 0, 1.0), success(0, 1, 1.0), success(1, 0, 1.0)]
    failures = [judge_failed(2, 0), judge_failed(2, 0)]
    plans, skipped = plan_groups(TASKS, successes, failures, options(resume=True), "run2")
    assert [(p.task_index, p.group_id) for p in plans] == [(1, "run2-1"), (2, "run2-2")]
    assert skipped == 1
    plans, skipped = plan_groups(
        TASKS, successes, failures, options(resume=True, max_attempts=2), "run2"
    )
    assert [p.task_index for p in plans] == [1] and skipped == 2


def test_replace_failed_groups_advances_the_attempt_of_the_same_group() -> None:
    failures = [judge_failed(0, 0, "old-0", 0), judge_failed(0, 1, "old-0", 0),
                judge_failed(1, 0, "old-1", 2), judge_failed(1, 1, "old-1", 2)]
    plans, _ = plan_groups(TASKS, [], failures, options(replace_failed_groups=True), "run3")
    assert [(p.task_index, p.group_id, p.attempt) for p in plans] == [
        (0, "old-0", 1), (1, "old-1", 3), (2, "run3-2", 0)
    ]


# -- command lines (no server needed) --------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_aggregate_cli_recomputes_and_guards(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    write_jsonl(out, [])
    write_jsonl(failures_path_for(out), [judge_failed(0, 0), judge_failed(0, 1)])
    sidecar_before = failures_path_for(out).read_bytes()
    runner = CliRunner()

    result = runner.invoke(aggregate_cli, [str(out)])
    assert result.exit_code == 1
    assert "no result" in result.output
    assert not metrics_path_for(out).exists()

    result = runner.invoke(
        aggregate_cli, [str(out), "--count-failure-classes-as-zero", "judge_failed"]
    )
    assert result.exit_code == 0, result.output
    data = metrics_path_for(out).read_bytes()
    assert json.loads(data)["key_metrics"]["mean/reward"] == 0.0
    assert result.output.encode() == data
    assert failures_path_for(out).read_bytes() == sidecar_before


def test_aggregate_cli_matches_the_metrics_function(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    rows = [success(t, r, float(t + r)) for t in range(2) for r in range(2)]
    write_jsonl(out, rows)
    result = CliRunner().invoke(aggregate_cli, [str(out)])
    assert result.exit_code == 0
    expected = encode_metrics(aggregate_metrics(rows))
    assert metrics_path_for(out).read_bytes() == expected


def test_collect_cli_refuses_to_clobber_and_bad_combinations(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    write_jsonl(tasks, TASKS)
    out = tmp_path / "out.jsonl"
    out.write_text("")
    runner = CliRunner()
    base = ["--input", str(tasks), "--output", str(out), "--server", "http://127.0.0.1:9",
            "--num-repeats", "2", "--policy-url", "http://127.0.0.1:9"]
    result = runner.invoke(collect_cli, base)
    assert result.exit_code == 2 and "--resume" in result.output
    result = runner.invoke(collect_cli, [*base, "--replace-failed-groups", "--legacy-groups"])
    assert result.exit_code == 2 and "explicit group ids" in result.output
    result = runner.invoke(collect_cli, [*base, "--overwrite", "--num-repeats", "0"])
    assert result.exit_code == 2


# -- mock policy ----------------------------------------------------------------------------


async def call_app(app: MockPolicyApp, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    raw = json.dumps(body).encode() if body is not None else b""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": path}, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


def text_of(response: dict[str, Any]) -> str:
    return str(response["output"][-1]["content"][0]["text"])


async def test_mock_policy_is_varied_and_deterministic(autojump_clock: trio.abc.Clock) -> None:
    settings = MockPolicySettings(seed=3, latency_mean_s=2.0)
    first = MockPolicyApp(settings, MockPolicyState())
    second = MockPolicyApp(settings, MockPolicyState())
    body = {"input": [{"role": "user", "content": "hello"}]}
    start = trio.current_time()
    answers_a = [text_of((await call_app(first, "POST", "/v1/responses", body))[1])
                 for _ in range(4)]
    assert trio.current_time() - start == pytest.approx(8.0)
    answers_b = [text_of((await call_app(second, "POST", "/v1/responses", body))[1])
                 for _ in range(4)]
    assert answers_a == answers_b
    assert len(set(answers_a)) == 4
    # OpenAI's usage schema requires both detail objects (NeMo Gym's model servers check it).
    usage = (await call_app(second, "POST", "/v1/responses", body))[1]["usage"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    other = MockPolicyApp(MockPolicySettings(seed=4), MockPolicyState())
    assert text_of((await call_app(other, "POST", "/v1/responses", body))[1]) != answers_a[0]
    assert first.state.generation_requests == 4


async def test_mock_policy_chat_faults_and_errors() -> None:
    state = MockPolicyState()
    app = MockPolicyApp(MockPolicySettings(fail_first_n=1, fail_status=503), state)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert (await call_app(app, "POST", "/v1/chat/completions", body))[0] == 503
    status, answer = await call_app(app, "POST", "/v1/chat/completions", body)
    assert status == 200 and answer["choices"][0]["message"]["content"]
    assert answer["usage"]["total_tokens"] > 0
    assert (await call_app(app, "POST", "/v1/responses", [1]))[0] == 400
    assert (await call_app(app, "GET", "/nope"))[0] == 404
    assert state.generation_requests == 2 and state.failed_requests == 1


async def test_run_mock_policy_on_a_real_socket(nursery: trio.Nursery) -> None:
    state = MockPolicyState()
    url = await nursery.start(
        partial(run_mock_policy, MockPolicySettings(with_reasoning=True), state=state)
    )
    async with httpx2.AsyncClient(timeout=None, trust_env=False) as client:
        response = await client.post(f"{url}/v1/responses", json={"input": "x"})
        assert response.status_code == 200
        kinds = [item["type"] for item in response.json()["output"]]
        assert kinds == ["reasoning", "message"]
        assert (await client.get(f"{url}/health")).status_code == 200
    assert state.generation_requests == 1


def test_mock_policy_cli_prints_one_line_and_exits_on_sigterm() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", "from genrm_trio.mock.policy import mock_policy_cli; "
         "mock_policy_cli()", "--port", "0", "--set", "seed=5"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("genrm-trio mock-policy listening on http://127.0.0.1:")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            assert proc.stdout.read() == ""
        finally:
            if proc.poll() is None:
                proc.kill()


async def test_progress_prints_plain_lines_off_a_terminal(autojump_clock: trio.abc.Clock) -> None:
    progress = Progress(total_rollouts=8, started_at=trio.current_time())
    stream = io.StringIO()
    progress.done, progress.masked, progress.failed, progress.in_flight = 3, 1, 0, 4
    with trio.move_on_after(25):
        await show_progress(progress, stream, 10.0)
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text  # no terminal control off a terminal
    lines = text.splitlines()
    assert len(lines) == 2
    assert lines[0] == (
        "collect: 4/8 rollouts | done 3 masked 1 failed 0 in flight 4 "
        "backpressure retries 0 | 0.4/s"
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_progress_is_a_bar_with_rate_and_eta_on_a_terminal(
    autojump_clock: trio.abc.Clock,
) -> None:
    progress = Progress(total_rollouts=100, started_at=trio.current_time())
    stream = _Terminal()

    async def advance() -> None:
        for _ in range(20):
            await trio.sleep(1.0)
            progress.done += 2

    async with trio.open_nursery() as nursery:
        nursery.start_soon(show_progress, progress, stream, 10.0)
        await advance()
        progress.failed, progress.in_flight = 1, 3
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    frames = [f for f in stream.getvalue().split("\r") if f.strip()]
    last = frames[-1]
    assert "41/100" in last  # 40 done + 1 failed
    assert "done 40 masked 0 failed 1 in flight 3" in last
    assert "rollout/s" in last and "<" in last  # a rate and an elapsed<remaining ETA
    assert len(frames) > 5  # redrawn, not printed once
