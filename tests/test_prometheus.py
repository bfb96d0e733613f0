"""``GET /metrics`` through prometheus_client's own parser: names, types, label sets, and values
that move as cohorts are driven through a real server and the mock judge on loopback."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx2
import trio
from prometheus_client.parser import text_string_to_metric_families

from genrm_trio.config import load_config
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.judge import JudgeStats
from genrm_trio.server.prometheus import ServerMetrics
from genrm_trio.server.serve import run_server
from tests.lifecycle_helpers import body

Families = dict[str, Any]


def parse(text: str) -> Families:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: Families, family: str, sample: str | None = None, **labels: str) -> float:
    """One sample's value (0.0 when the labelled sample is absent)."""
    name = sample or family
    for s in families[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    return 0.0


@asynccontextmanager
async def server_with_judge(n: int, *extra: str
                            ) -> AsyncIterator[tuple[httpx2.AsyncClient, str]]:
    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(
            partial(run_mock_judge, MockJudgeSettings(), state=MockJudgeState()))
        cfg = load_config(None, [
            f"num_rollouts_per_prompt={n}", "cohort_collection_timeout_s=0.5",
            "genrm_parse_retries=0", f'judge.base_urls=["{judge_url}"]', "port=0", *extra,
        ], {})
        url = await nursery.start(run_server, cfg)
        async with httpx2.AsyncClient(base_url=url) as client:
            yield client, judge_url
        nursery.cancel_scope.cancel()


async def post_group(client: httpx2.AsyncClient, group: str, slots: range) -> list[int]:
    statuses: list[int] = []

    async def one(slot: int) -> None:
        statuses.append((await client.post("/verify", json=body(slot, group=group))).status_code)

    async with trio.open_nursery() as nursery:
        for slot in slots:
            nursery.start_soon(one, slot)
    return statuses


async def scrape(client: httpx2.AsyncClient) -> Families:
    answer = await client.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    return parse(answer.text)


EXPECTED_TYPES = {
    "genrm_verify_duration_seconds": "histogram",
    "genrm_cohort_collection_seconds": "histogram",
    "genrm_cohort_evaluation_seconds": "histogram",
    "genrm_judge_call_duration_seconds": "histogram",
    "genrm_http_unauthorized": "counter",
    "genrm_active_cohorts": "gauge",
    "genrm_waiters": "gauge",
    "genrm_retained_records": "gauge",
    "genrm_active_bytes": "gauge",
    "genrm_cohorts_opened": "counter",
    "genrm_cohorts_completed": "counter",
    "genrm_cohorts_failed": "counter",
    "genrm_verify_answers": "counter",
    "genrm_judge_comparisons": "counter",
    "genrm_judge_calls": "counter",
    "genrm_judge_attempt_failures": "counter",
    "genrm_judge_endpoint_in_flight": "gauge",
    "genrm_judge_endpoint_consecutive_failures": "gauge",
    "genrm_judge_endpoint_cooling": "gauge",
    "genrm_judge_endpoint_failures": "counter",
    "genrm_judge_limiter_in_use": "gauge",
}


async def test_metrics_parse_and_move_as_cohorts_are_driven() -> None:
    n = 3
    async with server_with_judge(n) as (client, judge_url):
        before = await scrape(client)
        for name, kind in EXPECTED_TYPES.items():
            assert name in before, name
            assert before[name].type == kind, (name, before[name].type)
        # Every counter sample is exposed with the _total suffix (the parser strips it from
        # the family name only).
        for family in before.values():
            if family.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in family.samples), (
                    family.name)
        assert value(before, "genrm_cohorts_opened", "genrm_cohorts_opened_total") == 0

        assert await post_group(client, "m-1", range(n)) == [200] * n
        assert await post_group(client, "m-2", range(n)) == [200] * n
        assert await post_group(client, "m-3", range(n - 1)) == [503] * (n - 1)  # incomplete
        after = await scrape(client)

    assert value(after, "genrm_cohorts_opened", "genrm_cohorts_opened_total") == 3
    assert value(after, "genrm_cohorts_completed", "genrm_cohorts_completed_total") == 2
    assert value(after, "genrm_cohorts_failed", "genrm_cohorts_failed_total",
                 kind="cohort_incomplete") == 1
    assert value(after, "genrm_verify_answers", "genrm_verify_answers_total",
                 outcome="rewarded") == 2 * n
    verify_count = "genrm_verify_duration_seconds_count"
    assert value(after, "genrm_verify_duration_seconds", verify_count, outcome="rewarded") == 2 * n
    assert value(after, "genrm_verify_duration_seconds", verify_count,
                 outcome="cohort_incomplete") == n - 1
    # Collection: two cohorts completed collecting, one ran out of its 0.5 s deadline.
    coll = "genrm_cohort_collection_seconds"
    assert value(after, coll, coll + "_count", outcome="complete") == 2
    assert value(after, coll, coll + "_count", outcome="cohort_incomplete") == 1
    assert value(after, coll, coll + "_sum", outcome="cohort_incomplete") >= 0.5
    assert value(after, coll, coll + "_bucket", outcome="cohort_incomplete", le="0.25") == 0
    assert value(after, coll, coll + "_bucket", outcome="cohort_incomplete", le="+Inf") == 1
    ev = "genrm_cohort_evaluation_seconds"
    assert value(after, ev, ev + "_count", outcome="completed") == 2
    # Judge: circular pairs, N calls per cohort, each observed under its endpoint label.
    judge_calls = "genrm_judge_call_duration_seconds_count"
    assert value(after, "genrm_judge_call_duration_seconds", judge_calls, endpoint=judge_url
                 + "/v1/responses", result="ok") == 2 * n
    assert value(after, "genrm_judge_calls", "genrm_judge_calls_total") == 2 * n
    endpoints = {s.labels["endpoint"] for s in after["genrm_judge_endpoint_cooling"].samples}
    assert endpoints == {judge_url + "/v1/responses"}
    assert value(after, "genrm_judge_endpoint_in_flight") == 0


async def test_judge_failures_and_cooling_show_per_endpoint() -> None:
    n = 2
    async with server_with_judge(n, "judge.endpoint_failure_threshold=1",
                                 "judge.endpoint_cooldown_s=600") as (client, judge_url):
        async with httpx2.AsyncClient() as admin:
            await admin.post(judge_url + "/admin/fault", json={"fault": "503", "count": None})
        statuses = await post_group(client, "fail-1", range(n))
        assert statuses == [200] * n  # masked: judge_failed
        after = await scrape(client)
    endpoint = judge_url + "/v1/responses"
    assert value(after, "genrm_judge_endpoint_failures", "genrm_judge_endpoint_failures_total",
                 endpoint=endpoint) >= 1
    assert value(after, "genrm_judge_endpoint_cooling", endpoint=endpoint) == 1.0
    assert value(after, "genrm_judge_endpoint_consecutive_failures", endpoint=endpoint) >= 1
    assert value(after, "genrm_judge_attempt_failures", "genrm_judge_attempt_failures_total",
                 reason="http_503") >= 1
    assert value(after, "genrm_judge_call_duration_seconds",
                 "genrm_judge_call_duration_seconds_count", endpoint=endpoint,
                 result="error") >= 1
    assert value(after, "genrm_cohorts_failed", "genrm_cohorts_failed_total",
                 kind="judge_failed") == 1
    assert value(after, "genrm_verify_duration_seconds", "genrm_verify_duration_seconds_count",
                 outcome="masked") == n


def test_counters_past_a_million_keep_full_precision() -> None:
    class Registry:
        counters = Counter({"cohorts_opened": 1_234_567})
        shutting_down = False
        draining = False
        rejoining_s = 0.0
        groups_elsewhere = 0
        journal = None

        def snapshot(self) -> dict[str, int]:
            return {k: 0 for k in ("collecting", "evaluating", "waiters", "retained_records",
                                   "watermarks", "active_bytes", "unsent_answer_bytes",
                                   "send_timeouts", "body_bytes", "body_refusals",
                                   "bodies_waiting")}

        def verdict_status(self) -> dict[str, Any]:
            return {"mode": "off", "entries": 0, "cap": 0, "ttl_s": None}

    class Judge:
        stats = JudgeStats()

        def status(self) -> dict[str, Any]:
            return {"limiter": {"in_use": 0, "total": 4}, "endpoints": []}

    metrics = ServerMetrics()
    registry = Registry()
    metrics.read_from(registry, Judge())  # type: ignore[arg-type]
    first = parse(metrics.render()[0].decode())
    registry.counters["cohorts_opened"] += 1
    second = parse(metrics.render()[0].decode())
    assert value(first, "genrm_cohorts_opened", "genrm_cohorts_opened_total") == 1_234_567
    assert value(second, "genrm_cohorts_opened", "genrm_cohorts_opened_total") == 1_234_568


def test_each_server_has_its_own_registry() -> None:
    a, b = ServerMetrics(), ServerMetrics()
    a.observe_verify("rewarded", 0.1)
    assert value(parse(a.render()[0].decode()), "genrm_verify_duration_seconds",
                 "genrm_verify_duration_seconds_count", outcome="rewarded") == 1
    assert value(parse(b.render()[0].decode()), "genrm_verify_duration_seconds",
                 "genrm_verify_duration_seconds_count", outcome="rewarded") == 0


async def test_builtin_judge_calls_are_observed() -> None:
    cfg = load_config(None, ["num_rollouts_per_prompt=2", "port=0"], {})
    async with trio.open_nursery() as nursery:
        url = await nursery.start(run_server, cfg)
        async with httpx2.AsyncClient(base_url=url) as client:
            assert await post_group(client, "b-1", range(2)) == [200, 200]
            after = await scrape(client)
        nursery.cancel_scope.cancel()
    assert value(after, "genrm_judge_call_duration_seconds",
                 "genrm_judge_call_duration_seconds_count", endpoint="builtin", result="ok") == 2


async def test_partial_cohorts_are_counted_and_their_members_scored_observed() -> None:
    n = 4
    async with server_with_judge(n, "incomplete_cohort_policy=judge_present") as (client, _):
        assert await post_group(client, "full", range(n)) == [200] * n
        answers: list[Any] = []

        async def one(slot: int) -> None:
            answers.append((await client.post("/verify", json=body(slot, group="p"))).json())

        async with trio.open_nursery() as nursery:
            for slot in (0, 1, 3):
                nursery.start_soon(one, slot)
        late = await client.post("/verify", json=body(2, group="p"))
        replay = await client.post("/verify", json=body(1, group="p"))
        after = await scrape(client)
    assert sorted(a["_ng_rollout_index"] for a in answers) == [0, 1, 3]
    for a in answers:
        assert a["mask_sample"] is False and isinstance(a["reward"], float)
        assert (a["genrm_cohort_expected"], a["genrm_cohort_scored"]) == (n, 3)
    assert late.status_code == 409
    assert late.json()["failure_kind"] == "cohort_closed"
    assert replay.status_code == 200 and replay.json()["genrm_cohort_scored"] == 3
    assert value(after, "genrm_cohorts_partial", "genrm_cohorts_partial_total") == 1
    assert value(after, "genrm_cohorts_completed", "genrm_cohorts_completed_total") == 2
    scored = "genrm_cohort_members_scored"
    assert after[scored].type == "histogram"
    assert value(after, scored, scored + "_count") == 2
    assert value(after, scored, scored + "_sum") == n + 3
    assert value(after, scored, scored + "_bucket", le="3.0") == 1
    assert value(after, scored, scored + "_bucket", le="4.0") == 2
    coll = "genrm_cohort_collection_seconds"
    assert value(after, coll, coll + "_count", outcome="partial") == 1
    assert value(after, coll, coll + "_count", outcome="complete") == 1
    ev = "genrm_cohort_evaluation_seconds"
    assert value(after, ev, ev + "_count", outcome="partial") == 1
    assert value(after, "genrm_verify_answers", "genrm_verify_answers_total",
                 outcome="cohort_closed") == 1
