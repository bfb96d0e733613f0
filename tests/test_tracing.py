"""Cohort-level traces (issue 20): the span model, statuses, propagation both ways, export.

Tests that need the SDK skip without the ``[otel]`` extra (``pytest.importorskip``); the
config checks and the missing-extra exit run either way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx2
import pytest
import trio

from genrm_trio.config import Config, JudgeConfig, TracingConfig, load_config
from genrm_trio.errors import ConfigError
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server import tracing
from genrm_trio.server.cohort import CohortRegistry
from genrm_trio.server.judge import open_judge
from tests.lifecycle_helpers import PROMPT, answer, body, member
from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import running_server

INBOUND_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
INBOUND_SPAN = "00f067aa0ba902b7"


def _sdk() -> Any:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter


def traced_cfg(judge_url: str, n: int = 4, **keys: Any) -> Config:
    sets = [
        "port=0", f"num_rollouts_per_prompt={n}", f'judge.base_urls=["{judge_url}"]',
        "judge.model=judge-7b", "genrm_parse_retries=1", "genrm_parse_retry_sleep_s=0.01",
        "judge.endpoint_cooldown_s=0.01", "judge_request_timeout_s=5",
        "cohort_collection_timeout_s=10", "cohort_evaluation_timeout_s=10",
        "tracing.enabled=true",
    ] + [f"{k}={v}" for k, v in keys.items()]
    return load_config(None, sets, {})


@dataclass
class Stack:
    url: str
    judge: MockJudgeState
    exporter: Any


@asynccontextmanager
async def traced_stack(judge_state: MockJudgeState, n: int = 4,
                       **keys: Any) -> AsyncIterator[Stack]:
    """Mock judge + server with tracing on, exporting synchronously to memory. The spans are
    complete once the block has exited (the server has shut down)."""
    exporter = _sdk()()
    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(partial(run_mock_judge, MockJudgeSettings(),
                                                state=judge_state))
        cfg = traced_cfg(judge_url, n, **keys)
        tracer = tracing.open_tracer(cfg, exporter=exporter, synchronous=True)
        stop = trio.Event()
        async with trio.open_nursery() as server:
            url = await server.start(partial(_serve, cfg, stop, tracer))
            try:
                yield Stack(url, judge_state, exporter)
            finally:
                stop.set()  # the server shuts down; 10 s at most, then it is cancelled
                server.cancel_scope.deadline = trio.current_time() + 10
        nursery.cancel_scope.cancel()  # the mock judge


async def _serve(cfg: Config, stop: trio.Event, tracer: tracing.Tracer,
                 task_status: trio.TaskStatus[str]) -> None:
    from genrm_trio.server.serve import run_server

    await run_server(cfg, shutdown=stop, tracer=tracer, task_status=task_status)


def by_name(spans: Any, name: str) -> list[Any]:
    return [s for s in spans if s.name == name]


def all_text(spans: Any) -> str:
    """Every attribute, event attribute and link attribute value of ``spans``, as one text."""
    parts: list[str] = []
    for s in spans:
        parts += [s.name, *map(str, s.attributes.values())]
        for e in s.events:
            parts += [e.name, *map(str, e.attributes.values())]
        for link in s.links:
            parts += map(str, link.attributes.values())
    return "\n".join(parts)


async def post_members(url: str, group: str, n: int, headers: dict[int, dict[str, str]] | None
                       = None, paths: dict[int, str] | None = None) -> list[httpx2.Response]:
    answers: list[httpx2.Response] = []
    async with httpx2.AsyncClient(base_url=url, timeout=30) as client:
        async def one(slot: int) -> None:
            answers.append(await client.post((paths or {}).get(slot, "/verify"),
                                             json=body(slot, group=group, attempt=0),
                                             headers=(headers or {}).get(slot)))

        async with trio.open_nursery() as nursery:
            for slot in range(n):
                nursery.start_soon(one, slot)
    return answers


# --------------------------------------------------------------------------- the span model


async def test_cohort_of_four_in_one_picture() -> None:
    # The first judge call gets a 503: that comparison is retried once.
    state = MockJudgeState("503", 1)
    traceparent = f"00-{INBOUND_TRACE}-{INBOUND_SPAN}-01"
    async with traced_stack(state) as stack:
        answers = await post_members(stack.url, "g-four", 4,
                                     headers={1: {"traceparent": traceparent}},
                                     paths={2: "/ng-rollout/r-2/verify"})
        assert sorted(a.status_code for a in answers) == [200] * 4
    spans = stack.exporter.get_finished_spans()
    from opentelemetry.trace import SpanKind, StatusCode

    (cohort,) = by_name(spans, "genrm.cohort")
    requests = by_name(spans, "POST /verify")
    judges = by_name(spans, "chat judge-7b")
    cohort_trace = cohort.context.trace_id
    # One SERVER span per request, each linked to the cohort and carrying its trace id.
    assert len(requests) == 4 and {s.kind for s in requests} == {SpanKind.SERVER}
    assert sorted(s.attributes["genrm.rollout_index"] for s in requests) == [0, 1, 2, 3]
    for s in requests:
        assert s.attributes["genrm.group_id"] == "g-four"
        assert s.attributes["genrm.group_attempt"] == 0
        assert s.attributes["genrm.outcome"] == "rewarded"
        assert s.attributes["genrm.mask_sample"] is False
        assert s.attributes["http.response.status_code"] == 200
        assert s.attributes["genrm.cohort.trace_id"] == f"{cohort_trace:032x}"
        assert [link.context.span_id for link in s.links] == [cohort.context.span_id]
        assert s.status.status_code is StatusCode.UNSET
    by_slot = {s.attributes["genrm.rollout_index"]: s for s in requests}
    assert by_slot[2].attributes["genrm.rollout_id"] == "r-2"
    assert "genrm.rollout_id" not in by_slot[0].attributes
    # The inbound traceparent is continued; the others start traces of their own.
    assert f"{by_slot[1].context.trace_id:032x}" == INBOUND_TRACE
    assert f"{by_slot[1].parent.span_id:016x}" == INBOUND_SPAN
    assert by_slot[1].parent.is_remote
    assert by_slot[0].parent is None and by_slot[0].context.trace_id != cohort_trace
    # The cohort: its own trace (a root), one link per member, its lifecycle as events.
    assert cohort.parent is None
    assert sorted(link.context.span_id for link in cohort.links) == sorted(
        s.context.span_id for s in requests)
    assert sorted(link.attributes["genrm.rollout_index"] for link in cohort.links) == [0, 1, 2, 3]
    assert not any("genrm.duplicate" in link.attributes for link in cohort.links)
    assert [e.name for e in cohort.events] == [
        "genrm.cohort.collected", "genrm.cohort.evaluation_started", "genrm.cohort.published"]
    assert cohort.attributes["genrm.outcome"] == "completed"
    assert cohort.attributes["genrm.members"] == 4 and cohort.attributes["genrm.judge_calls"] == 4
    assert cohort.status.status_code is StatusCode.UNSET
    # One CLIENT span per comparison (circular: 4), children of the cohort span.
    assert len(judges) == 4
    for s in judges:
        assert s.kind is SpanKind.CLIENT
        assert s.context.trace_id == cohort_trace
        assert s.parent.span_id == cohort.context.span_id
        assert s.attributes["gen_ai.operation.name"] == "chat"
        assert s.attributes["gen_ai.request.model"] == "judge-7b"
        assert s.attributes["gen_ai.usage.input_tokens"] > 0
        assert s.attributes["gen_ai.usage.output_tokens"] > 0
        assert s.attributes["gen_ai.response.finish_reasons"][-1] == "completed"
        assert s.attributes["genrm.judge.outcome"] == "verdict"
    # A comparison answered at its first attempt is that attempt: no events, its duration.
    single = [s for s in judges if s.attributes["genrm.judge.attempts"] == 1]
    assert len(single) == 3
    for s in single:
        assert s.events == ()
        assert 0 <= s.attributes["genrm.attempt.duration_s"] <= (s.end_time - s.start_time) / 1e9
        assert s.attributes["genrm.judge.endpoint"].startswith("http://127.0.0.1:")
    # The retried comparison shows both attempts and the backoff between them.
    (retried,) = [s for s in judges if s.attributes["genrm.judge.attempts"] == 2]
    assert "genrm.attempt.duration_s" not in retried.attributes
    events = [(e.name, dict(e.attributes)) for e in retried.events]
    assert [name for name, _ in events] == [
        "genrm.judge.attempt", "genrm.judge.backoff", "genrm.judge.attempt"]
    assert events[0][1]["genrm.attempt"] == 0 and events[0][1]["error.type"] == "http_503"
    assert events[1][1]["genrm.attempt"] == 1 and events[1][1]["genrm.backoff_s"] >= 0
    assert events[2][1]["genrm.attempt.outcome"] == "answer"
    assert "error.type" not in retried.attributes
    # The judge got each comparison's traceparent (the retry the same one).
    sent = list(state.traceparents)
    assert len(sent) == 5
    expected = {f"00-{cohort_trace:032x}-{s.context.span_id:016x}-{s.context.trace_flags:02x}"
                for s in judges}
    assert set(sent) == expected
    # No prompt or answer text anywhere.
    text = all_text(spans)
    assert PROMPT not in text
    for slot in range(4):
        assert answer(slot)[:30] not in text


async def test_failed_cohort_ends_every_span_with_an_error() -> None:
    state = MockJudgeState("503")  # every call
    async with traced_stack(state, n=2) as stack:
        answers = await post_members(stack.url, "g-fail", 2)
        assert [a.json()["mask_sample"] for a in answers] == [True, True]
    spans = stack.exporter.get_finished_spans()
    from opentelemetry.trace import StatusCode

    (cohort,) = by_name(spans, "genrm.cohort")
    assert cohort.status.status_code is StatusCode.ERROR
    assert cohort.status.description == "judge_failed"
    assert cohort.events[-1].name == "genrm.cohort.failed"
    assert cohort.attributes["genrm.failure_kind"] == "judge_failed"
    for s in by_name(spans, "POST /verify"):
        assert s.status.status_code is StatusCode.ERROR
        assert s.attributes["genrm.mask_sample"] is True
        assert s.attributes["genrm.failure_kind"] == "judge_failed"
    judges = by_name(spans, "chat judge-7b")
    failed = [j for j in judges if j.attributes["genrm.judge.outcome"] == "failed"]
    assert failed and all(j.attributes["error.type"] == "http_503" for j in failed)
    assert all(j.status.status_code is StatusCode.ERROR for j in failed)
    # A sibling cancelled by the cohort's failure says so, without an error of its own.
    for j in judges:
        if j not in failed:
            assert j.attributes["genrm.judge.outcome"] == "cancelled"
            assert j.status.status_code is StatusCode.UNSET
    # The judge's error text (with its snippet of the body) is in no attribute.
    assert "Service Unavailable" not in all_text(spans)


async def test_compare_judge_spans_are_children_of_the_request() -> None:
    state = MockJudgeState()
    async with traced_stack(state, n=4) as stack:
        async with httpx2.AsyncClient(base_url=stack.url) as client:
            answer_ = await client.post("/compare", json={
                "conversation_history": [{"role": "user", "content": "q"}],
                "response_objs": [body(s)["response"] for s in range(3)]})
            assert answer_.status_code == 200
            assert (await client.get("/health")).status_code == 200
    spans = stack.exporter.get_finished_spans()
    (request,) = by_name(spans, "POST /compare")
    judges = by_name(spans, "chat judge-7b")
    assert len(judges) == 3
    assert {j.parent.span_id for j in judges} == {request.context.span_id}
    assert not by_name(spans, "GET /health")  # probes are not traced


# --------------------------------------------------------------------------- lifecycle statuses


@asynccontextmanager
async def traced_registry(cfg: Config) -> AsyncIterator[tuple[CohortRegistry, Any,
                                                            tracing.Tracer]]:
    exporter = _sdk()()
    tracer = tracing.open_tracer(cfg, exporter=exporter, synchronous=True)

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(503, json={"error": {"message": "busy"}})

    async with (open_judge(cfg, transport=httpx2.MockTransport(handler)) as judge,
                CohortRegistry.open(cfg, judge, tracer=tracer) as registry):
        yield registry, exporter, tracer


def lifecycle_cfg(sample_ratio: float = 1.0, **keys: Any) -> Config:
    return Config(num_rollouts_per_prompt=2, cohort_collection_timeout_s=60,
                  judge=JudgeConfig(base_urls=("http://judge.invalid",)),
                  tracing=TracingConfig(enabled=True, sample_ratio=sample_ratio), **keys)


async def test_superseded_and_shut_down_cohorts_end_with_their_kind(
        autojump_clock: trio.testing.MockClock) -> None:
    cfg = lifecycle_cfg()
    outcomes: dict[str, Any] = {}
    async with traced_registry(cfg) as (registry, exporter, tracer):

        async def verify(name: str, attempt: int, slot: int) -> None:
            span = tracer.request("POST", "/verify", [], None)
            outcomes[name] = await registry.verify(member(cfg, slot, attempt=attempt), span)
            span.outcome(outcomes[name].kind)
            span.end(outcomes[name].status)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(verify, "old", 0, 0)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(verify, "new", 1, 0)
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes["old"].kind == "superseded"
            registry.begin_shutdown()
    assert outcomes["new"].kind == "shutdown"
    from opentelemetry.trace import StatusCode

    spans = exporter.get_finished_spans()
    cohorts = {s.attributes["genrm.group_attempt"]: s for s in by_name(spans, "genrm.cohort")}
    assert cohorts[0].status.status_code is StatusCode.ERROR
    assert cohorts[0].status.description == "superseded"
    assert cohorts[1].status.description == "shutdown"
    assert cohorts[1].events[-1].attributes["genrm.failure_kind"] == "shutdown"
    (shutdown,) = by_name(spans, "genrm.shutdown")
    assert shutdown.attributes["genrm.active_cohorts"] == 1
    assert shutdown.attributes["genrm.waiters"] == 1
    requests = by_name(spans, "POST /verify")
    assert sorted(s.attributes["genrm.outcome"] for s in requests) == ["shutdown", "superseded"]
    assert all(s.status.status_code is StatusCode.ERROR for s in requests)


async def test_admission_refusal_is_an_event_of_the_request(
        autojump_clock: trio.testing.MockClock) -> None:
    cfg = lifecycle_cfg(max_active_cohorts=1)
    async with traced_registry(cfg) as (registry, exporter, tracer):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(registry.verify, member(cfg, 0, group="a"))
            await trio.testing.wait_all_tasks_blocked()
            span = tracer.request("POST", "/verify", [], None)
            outcome = await registry.verify(member(cfg, 0, group="b"), span)
            span.outcome(outcome.kind, False, outcome.detail)
            span.end(outcome.status)
            registry.begin_shutdown()
    (refused,) = [s for s in by_name(exporter.get_finished_spans(), "POST /verify")]
    assert refused.attributes["genrm.outcome"] == "overloaded"
    (event,) = refused.events
    assert event.name == "genrm.admission.refused"
    assert "max_active_cohorts (1) reached" in event.attributes["genrm.reason"]
    assert not refused.links  # refused before any cohort


async def test_unsampled_traces_record_nothing(autojump_clock: trio.testing.MockClock) -> None:
    cfg = lifecycle_cfg(sample_ratio=0.0)
    async with traced_registry(cfg) as (registry, exporter, tracer):
        assert tracer.request("POST", "/verify", [], None) is tracing.NO_REQUEST_SPAN
        # A caller's sampled flag is followed whatever the ratio.
        sampled = [(b"traceparent", f"00-{INBOUND_TRACE}-{INBOUND_SPAN}-01".encode())]
        span = tracer.request("POST", "/verify", sampled, None)
        assert span.recording
        span.end(200)
        registry.begin_shutdown()
    assert len(exporter.get_finished_spans()) == 1


async def test_a_retried_request_is_a_duplicate_link_and_links_are_bounded(
        autojump_clock: trio.testing.MockClock) -> None:
    cfg = lifecycle_cfg()
    async with traced_registry(cfg) as (registry, exporter, tracer):
        async with trio.open_nursery() as nursery:
            for _ in range(2):  # slot 0 twice: the second is a retried request on the slot
                nursery.start_soon(registry.verify, member(cfg, 0),
                                   tracer.request("POST", "/verify", [], None))
                await trio.testing.wait_all_tasks_blocked()
            registry.begin_shutdown()
        # Straight to the interface: a cohort joined by more requests than MAX_LINKS.
        busy = tracer.cohort("k", None, 0, 2)
        for _ in range(tracing.MAX_LINKS + 5):
            busy.joined(tracer.request("POST", "/verify", [], None), 1, True)
        busy.disposed("shutdown", {})
    cohorts = by_name(exporter.get_finished_spans(), "genrm.cohort")
    first = next(s for s in cohorts if "genrm.cohort.key" in s.attributes
                 and s.attributes["genrm.cohort.key"] != "k")
    assert [dict(link.attributes) for link in first.links] == [
        {"genrm.rollout_index": 0}, {"genrm.rollout_index": 0, "genrm.duplicate": True}]
    (bounded,) = [s for s in cohorts if s.attributes["genrm.cohort.key"] == "k"]
    assert len(bounded.links) == tracing.MAX_LINKS


def test_a_span_ended_twice_is_exported_once() -> None:
    _sdk()
    exporter = _sdk()()
    tracer = tracing.open_tracer(Config(tracing=TracingConfig(enabled=True)),
                                 exporter=exporter, synchronous=True)
    span = tracer.request("POST", "/verify", [], None)
    span.end(200)
    span.outcome("rewarded")  # too late: ignored, the exported span is unchanged
    span.end(503)
    (exported,) = exporter.get_finished_spans()
    assert exported.attributes["http.response.status_code"] == 200
    assert "genrm.outcome" not in exported.attributes


def test_a_callers_unsampled_flag_is_followed_and_a_bad_traceparent_ignored() -> None:
    exporter = _sdk()()
    tracer = tracing.open_tracer(lifecycle_cfg(), exporter=exporter, synchronous=True)
    unsampled = [(b"traceparent", f"00-{INBOUND_TRACE}-{INBOUND_SPAN}-00".encode())]
    assert tracer.request("POST", "/verify", unsampled, None) is tracing.NO_REQUEST_SPAN
    tracer.request("POST", "/verify", [(b"traceparent", b"00-not-a-trace-01")], None).end(200)
    (root,) = exporter.get_finished_spans()
    assert root.parent is None and root.context.trace_flags.sampled
    assert f"{root.context.trace_id:032x}" != INBOUND_TRACE
    tracer.close(1.0)


# --------------------------------------------------------------------------- off, and export


def test_off_is_the_shared_no_op() -> None:
    cfg = Config()
    tracer = tracing.open_tracer(cfg)
    assert tracer is tracing.NO_TRACER and not tracer.enabled
    span = tracer.request("POST", "/verify", [(b"traceparent", b"00-x")], "r")
    assert span is tracing.NO_REQUEST_SPAN
    assert tracer.cohort("k", "g", 0, 4) is tracing.NO_COHORT_TRACE
    assert tracing.NO_COHORT_TRACE.judge_call(0) is tracing.NO_JUDGE_SPAN
    assert tracing.NO_JUDGE_SPAN.headers() == ()


def test_off_never_imports_opentelemetry() -> None:
    # The whole server's modules, and a request's, cohort's and judge call's spans with
    # tracing off: nothing of the SDK (or the API) is loaded, so off costs the same with the
    # extra installed or not.
    code = (
        "import sys\n"
        "import genrm_trio.cli, genrm_trio.server.serve\n"
        "from genrm_trio.config import Config\n"
        "from genrm_trio.server import tracing\n"
        "tracer = tracing.open_tracer(Config())\n"
        "span = tracer.request('POST', '/verify', [(b'traceparent', b'00-x')], None)\n"
        "judge = tracer.cohort('k', 'g', 0, 4).judge_call(0)\n"
        "judge.attempt(0, None, 0.1); judge.end('verdict', None, 1, 1); span.end(200)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry')\n"
        "print(loaded)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_otel_sdk_disabled_turns_tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    _sdk()
    monkeypatch.setenv("OTEL_SDK_DISABLED", " True")
    assert tracing.open_tracer(Config(tracing=TracingConfig(enabled=True))) is tracing.NO_TRACER
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    tracer = tracing.open_tracer(Config(tracing=TracingConfig(enabled=True)),
                                 exporter=_sdk()(), synchronous=True)
    assert tracer.enabled
    tracer.close(1.0)


_BLOCK_OTEL = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Block())
from genrm_trio.cli import main
sys.argv = ["genrm-trio", "serve", "--port", "0", "--set", "tracing.enabled=true"]
main()
"""


def test_enabled_without_the_extra_exits_2_naming_the_install() -> None:
    done = subprocess.run([sys.executable, "-c", _BLOCK_OTEL], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "tracing.enabled" in lines[0] and "pip install -e '.[otel]'" in lines[0]


@pytest.mark.parametrize(("setting", "key"), [
    ("tracing.sample_ratio=1.5", "tracing.sample_ratio"),
    ("tracing.sample_ratio=-0.1", "tracing.sample_ratio"),
    ("tracing.sample_ratio=.nan", "tracing.sample_ratio"),
    ("tracing.otlp_endpoint=grpc://c:4317", "tracing.otlp_endpoint"),
    ("tracing.otlp_endpoint=http://c:4318/v1/traces?x=1", "tracing.otlp_endpoint"),
    ("tracing.enabled=maybe", "tracing.enabled"),
    ("tracing.colour=red", "tracing.colour"),
])
def test_bad_tracing_keys_name_the_key(setting: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [setting], {})
    assert caught.value.key == key


def test_endpoint_without_a_path_gets_v1_traces() -> None:
    assert load_config(None, ["tracing.otlp_endpoint=http://c:4318"], {}).tracing \
        .otlp_endpoint == "http://c:4318/v1/traces"
    assert load_config(None, ["tracing.otlp_endpoint=https://c/otlp/v1/traces"], {}).tracing \
        .otlp_endpoint == "https://c/otlp/v1/traces"




async def test_otlp_round_trip_to_a_loopback_receiver(
        receiver: tuple[str, type[OtlpReceiver]]) -> None:
    _sdk()
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    url, handler = receiver
    state = MockJudgeState()
    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(partial(run_mock_judge, MockJudgeSettings(),
                                                state=state))
        cfg = traced_cfg(judge_url, 2, **{"tracing.otlp_endpoint": url})
        async with running_server(cfg) as server_url:
            answers = await post_members(server_url, "g-otlp", 2)
            assert [a.status_code for a in answers] == [200, 200]
        nursery.cancel_scope.cancel()
    # run_server flushed the batch processor on its way out.
    names: dict[str, int] = {}
    cohort_ids, judge_parents = set(), set()
    services = set()
    for data in handler.bodies:
        request = ExportTraceServiceRequest.FromString(data)
        for resource_spans in request.resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes
                         if a.key == "service.name"}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    names[span.name] = names.get(span.name, 0) + 1
                    if span.name == "genrm.cohort":
                        cohort_ids.add(span.span_id)
                        assert len(span.links) == 2
                    if span.name == "chat judge-7b":
                        judge_parents.add(span.parent_span_id)
    assert names == {"POST /verify": 2, "genrm.cohort": 1, "chat judge-7b": 2,
                     "genrm.shutdown": 1}
    assert judge_parents == cohort_ids
    assert services == {"genrm-trio"}


async def test_an_unreachable_collector_costs_a_counter_and_one_line(
        receiver: tuple[str, type[OtlpReceiver]], caplog: pytest.LogCaptureFixture) -> None:
    _sdk()
    url, handler = receiver
    handler.status = 400  # refused, not retried: fast
    cfg = load_config(None, ["tracing.enabled=true", f"tracing.otlp_endpoint={url}"], {})
    tracer = tracing.open_tracer(cfg, synchronous=True)
    for _ in range(3):
        tracer.request("POST", "/verify", [], None).end(200)
    assert tracer.export_failures == 3
    await tracing.close_tracer(tracer)
    lines = [r for r in caplog.records if "span export failed" in r.getMessage()]
    assert len(lines) == 1
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert len(handler.bodies) == 3


async def test_export_failures_are_in_metrics() -> None:
    _sdk()
    from genrm_trio.server.prometheus import ServerMetrics

    class Refusing:
        def export(self, spans: Any) -> Any:
            from opentelemetry.sdk.trace.export import SpanExportResult

            return SpanExportResult.FAILURE

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 0) -> bool:
            return True

    cfg = Config(tracing=TracingConfig(enabled=True))
    tracer = tracing.open_tracer(cfg, exporter=Refusing(), synchronous=True)  # type: ignore[arg-type]
    tracer.request("POST", "/verify", [], None).end(200)
    metrics = ServerMetrics()
    async with open_judge(cfg) as judge, CohortRegistry.open(cfg, judge) as registry:
        metrics.read_from(registry, judge, tracer)
        text = metrics.render()[0].decode()
    assert "genrm_trace_export_failures_total 1.0" in text
    await tracing.close_tracer(tracer)
    json.dumps(text)  # plain text
