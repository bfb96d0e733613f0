"""The collector under backpressure, against a real server with ``max_active_cohorts`` small on
loopback: 429s are waited out within the cap, a refused group is never half sent (so it can
never strand a cohort until the collection deadline), and the bearer token is sent."""

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
from prometheus_client.parser import text_string_to_metric_families

from genrm_trio.caller.aggregate import failures_path_for, read_jsonl
from genrm_trio.caller.collect import (
    CollectError,
    CollectionResult,
    CollectOptions,
    _CallFailed,
    _Collector,
    parse_retry_after,
    run_collection,
)
from genrm_trio.caller.mock_policy import MockPolicySettings, run_mock_policy
from genrm_trio.config import load_config
from genrm_trio.server.serve import run_server
from tests.lifecycle_helpers import body

TOKEN = "collector-token-abc"


@dataclass
class Stack:
    server_url: str
    policy_url: str
    client: httpx2.AsyncClient


@asynccontextmanager
async def stack(n: int, *extra: str) -> AsyncIterator[Stack]:
    async with trio.open_nursery() as nursery:
        policy_url = await nursery.start(partial(run_mock_policy, MockPolicySettings()))
        cfg = load_config(None, [
            f"num_rollouts_per_prompt={n}", "max_active_cohorts=1", "port=0",
            "cohort_collection_timeout_s=30", *extra,
        ], {})
        server_url = await nursery.start(run_server, cfg)
        headers = {"authorization": f"Bearer {TOKEN}"}
        async with httpx2.AsyncClient(base_url=server_url, headers=headers) as client:
            yield Stack(server_url, policy_url, client)
        nursery.cancel_scope.cancel()


def options(s: Stack, tmp: Path, n: int, tasks: int, **kw: Any) -> CollectOptions:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "tasks.jsonl"
    path.write_text("".join(
        json.dumps({"responses_create_params": {"input": f"Task {i}: say {i}"}}) + "\n"
        for i in range(tasks)))
    base: dict[str, Any] = dict(
        input_path=str(path), output_path=str(tmp / "out.jsonl"), server_url=s.server_url,
        policy_url=s.policy_url, num_repeats=n, verify_timeout_s=30.0, policy_timeout_s=10.0,
        retry_after_cap_s=0.05, max_concurrent_groups=tasks,
    )
    base.update(kw)
    return CollectOptions(**base)


async def collect(options: CollectOptions) -> CollectionResult:
    return await run_collection(options, progress_stream=io.StringIO())


async def counters(client: httpx2.AsyncClient) -> dict[tuple[str, str], float]:
    """``(sample name, label value)`` -> value for the registry's counters."""
    text = (await client.get("/metrics")).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_total"):
                label = next(iter(s.labels.values()), "")
                out[(s.name, label)] = float(s.value)
    return out


async def wait_until(predicate: Any, client: httpx2.AsyncClient) -> None:
    """Poll the server (another party here) until ``predicate(counters)``, bounded."""
    with trio.fail_after(20):
        while not predicate(await counters(client)):  # noqa: ASYNC110
            await trio.sleep(0.02)


async def test_429s_are_waited_out_and_every_group_completes(tmp_path: Path) -> None:
    n, tasks = 4, 5
    async with stack(n) as s:
        result = await collect(options(s, tmp_path, n, tasks))
        got = await counters(s.client)
    assert (result.exit_code, result.successes, result.failed) == (0, n * tasks, 0)
    assert result.backpressure_retries > 0  # one cohort at a time: the others were refused
    assert got[("genrm_cohorts_completed_total", "")] == tasks
    assert got.get(("genrm_cohorts_failed_total", "cohort_incomplete"), 0) == 0
    # Every refusal the server gave was waited out and retried by the collector.
    assert got[("genrm_verify_answers_total", "overloaded")] == result.backpressure_retries


async def test_a_refused_group_is_never_half_sent(tmp_path: Path) -> None:
    n = 3
    async with stack(n) as s, trio.open_nursery() as nursery:
        nursery.start_soon(partial(s.client.post, "/verify", json=body(0, group="holder")))
        await wait_until(lambda c: c.get(("genrm_cohorts_opened_total", "")) == 1, s.client)
        # A long probe: a loaded machine may take longer than the default to answer the 429,
        # and this test is about what happens to a refused leader, not about that timing.
        result = await collect(options(s, tmp_path, n, 1, backpressure_give_up_s=0.3,
                                       route_failures_to_sidecar=True, admission_probe_s=5.0))
        got = await counters(s.client)
        status = (await s.client.get("/status")).json()["cohorts"]
        nursery.cancel_scope.cancel()
    assert (result.exit_code, result.successes, result.failed) == (1, 0, n)
    rows = read_jsonl(failures_path_for(tmp_path / "out.jsonl"))
    stages = sorted((r["_ng_failure_stage"], r["_ng_failure_http_status"]) for r in rows)
    assert stages == [("admission", 429)] * (n - 1) + [("verify", 429)]
    assert all(r["_ng_failure_class"] == "agent_request_failed" for r in rows)
    # Only the leader ever reached the server; the group opened nothing.
    assert got[("genrm_verify_answers_total", "overloaded")] == result.backpressure_retries + 1
    assert got[("genrm_cohorts_opened_total", "")] == 1
    assert status["active_cohorts"] == 1  # the holder alone


async def test_a_slot_freed_mid_wait_admits_the_whole_group(tmp_path: Path) -> None:
    n = 3
    async with stack(n) as s:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(s.client.post, "/verify", json=body(0, group="holder")))
            await wait_until(lambda c: c.get(("genrm_cohorts_opened_total", "")) == 1, s.client)
            outcome: list[CollectionResult] = []

            async def run() -> None:
                outcome.append(await collect(options(s, tmp_path, n, 1)))

            nursery.start_soon(run)
            await wait_until(
                lambda c: c.get(("genrm_verify_answers_total", "overloaded"), 0) >= 2, s.client)
            for slot in (1, 2):  # the holder's cohort completes: the slot frees
                nursery.start_soon(partial(s.client.post, "/verify",
                                           json=body(slot, group="holder")))
        got = await counters(s.client)
    result = outcome[0]
    assert (result.exit_code, result.successes, result.failed) == (0, n, 0)
    assert got[("genrm_cohorts_completed_total", "")] == 2
    assert got.get(("genrm_cohorts_failed_total", "cohort_incomplete"), 0) == 0


async def test_the_server_token_is_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 2
    monkeypatch.setenv("GENRM_TEST_COLLECT_TOKEN", TOKEN)
    async with stack(n, "auth_token_env=GENRM_TEST_COLLECT_TOKEN") as s:
        monkeypatch.delenv("GENRM_AUTH_TOKEN", raising=False)
        refused = await collect(options(s, tmp_path / "a", n, 1, route_failures_to_sidecar=True))
        assert (refused.successes, refused.failed) == (0, n)
        rows = read_jsonl(failures_path_for(tmp_path / "a" / "out.jsonl"))
        assert {r["_ng_failure_http_status"] for r in rows} == {401}
        assert all(TOKEN not in json.dumps(r) for r in rows)
        monkeypatch.setenv("GENRM_AUTH_TOKEN", TOKEN)  # the default variable
        ok = await collect(options(s, tmp_path / "b", n, 1))
        assert (ok.successes, ok.failed) == (n, 0)
        ok = await collect(options(s, tmp_path / "c", n, 1,
                                   server_token_env="GENRM_TEST_COLLECT_TOKEN"))
        assert (ok.successes, ok.failed) == (n, 0)
    with pytest.raises(CollectError, match="GENRM_TEST_NOT_SET"):
        await collect(options(s, tmp_path / "d", n, 1, server_token_env="GENRM_TEST_NOT_SET"))


def test_retry_after_parsing() -> None:
    assert parse_retry_after("3", 0.0) == 3.0
    assert parse_retry_after(None, 0.0) is None
    assert parse_retry_after("soon", 0.0) is None
    assert parse_retry_after("-1", 0.0) is None
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:40 GMT", 40.0) == 60.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:40 GMT", 400.0) == 0.0


def test_backpressure_waits_honour_the_hint_within_the_cap() -> None:
    def collector(cap: float) -> Any:
        c = object.__new__(_Collector)
        c.options = CollectOptions(input_path="i", output_path="o", server_url="u",
                                   num_repeats=2, retry_after_cap_s=cap)
        import random

        c.rng = random.Random(0)
        return c

    c = collector(30.0)
    for _ in range(50):
        wait = c._backpressure_wait_s(_CallFailed("x", 429, None, 2.0), 0)
        assert 2.0 <= wait <= 2.4
    assert c._backpressure_wait_s(_CallFailed("x", 503, None, 5.0), 0) >= 5.0
    assert c._backpressure_wait_s(_CallFailed("x", 503, None, None), 0) is None  # no hint
    assert c._backpressure_wait_s(_CallFailed("x", 409, None, 1.0), 0) is None
    assert c._backpressure_wait_s(_CallFailed("x", None, None), 0) is None
    assert 0.5 <= c._backpressure_wait_s(_CallFailed("x", 429, None, None), 0) <= 0.6
    assert collector(3.0)._backpressure_wait_s(_CallFailed("x", 429, None, 600.0), 0) == 3.0
