"""The span export process (server/trace_export.py, issue 20): the server's end with stand-in
children speaking the frames (no SDK needed), then the real child with the SDK (skipped
without the ``[otel]`` extra): what it exports, its lifetime, a lost child, a stalled
collector at shutdown, a child that cannot start.

Every test ends with no export process left behind: neither running nor a zombie.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from genrm_trio.config import Config, load_config
from genrm_trio.errors import ExportStartError
from genrm_trio.server import trace_export, tracing
from genrm_trio.server.trace_export import ExportProcess, Hello
from tests.lifecycle_helpers import member
from tests.otlp_receiver import OtlpReceiver

INBOUND_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
INBOUND_SPAN = "00f067aa0ba902b7"
_PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux
HELLO = Hello(endpoint=None, resource_attributes={"service.name": "t"}, resource_schema_url="",
              scope_name="genrm_trio", scope_version=None, log_level="WARNING",
              log_format="json")


def export_children() -> list[tuple[int, str]]:
    """This process's children running the export module: (pid, state), zombies included."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and (trace_export.MODULE.encode() in cmdline
                                              or b"FAKE_EXPORT_CHILD" in cmdline):
            found.append((int(entry.name), fields[0]))
    return found


@pytest.fixture(autouse=True)
def no_child_left() -> Iterator[None]:
    assert export_children() == []
    yield
    assert export_children() == []


# --------------------------------------------------------------------------- stand-in children

#: A child speaking the frames without the SDK. argv[1] says how it behaves: ``ok`` (answers
#: every batch, failing those with a row named "refuse"), ``refuse`` (not ready),
#: ``mute`` (never answers, exits at EOF), ``stall`` (ready, never answers a batch, exits at
#: EOF; with ``signal``, sends its parent SIGUSR1 0.2 s after it read the batch),
#: ``miscount`` (answers a wrong span count), ``stubborn`` (ready, then ignores EOF).
FAKE = textwrap.dedent("""
    # FAKE_EXPORT_CHILD
    import os, signal, struct, sys, time
    import msgspec
    mode = sys.argv[1]
    stdin = sys.stdin.buffer
    def read():
        header = stdin.read(4)
        if len(header) < 4:
            return None
        return stdin.read(struct.unpack(">I", header)[0])
    def write(message):
        data = msgspec.msgpack.encode(message)
        os.write(1, struct.pack(">I", len(data)) + data)
    read()
    if mode == "refuse":
        write([False, 0, "no exporter here"])
        sys.exit(1)
    if mode == "mute":
        while stdin.read(65536):
            pass
        sys.exit(0)
    write([True, 0, ""])
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(3600)
    while (payload := read()) is not None:
        rows = msgspec.msgpack.decode(payload)
        if mode == "stall":
            if sys.argv[2:] == ["signal"]:  # tell the test, once its server waits for sure
                time.sleep(0.2)
                os.kill(os.getppid(), signal.SIGUSR1)
            while stdin.read(65536):
                pass
            break
        count = len(rows) + (mode == "miscount")
        write([all(row[0] != "refuse" for row in rows), count, ""])
""")


def fake(mode: str, *flags: str, **kw: Any) -> ExportProcess:
    return ExportProcess(HELLO, command=[sys.executable, "-c", FAKE, mode, *flags], **kw)


def row(name: str = "span") -> tuple[Any, ...]:
    """A span row as server/tracing.py builds it."""
    return (name, 1, 2, 3, 1, "", None, False, 0, 10, 20, {"a": 1}, [], [], 0, None)


def test_batches_get_their_answers() -> None:
    process = fake("ok")
    process.start()
    assert process.pid is not None
    assert process.export([row(), row()]) is True
    assert process.export([row(), row("refuse")]) is False  # the exporter's failure
    assert process.export([row()]) is True  # the same child: a failure is not a loss
    process.close()
    assert process.pid is None
    assert process.export([row()]) is False  # closed: fails at once


@pytest.mark.parametrize(("command", "problem"), [
    ([sys.executable, "-c", "import sys; sys.exit(3)"], "exited with code 3 before it was ready"),
    ([sys.executable, "-c", FAKE, "refuse"], "no exporter here"),
    (["/nonexistent/python3"], "cannot run /nonexistent/python3"),
])
def test_a_child_that_cannot_start_fails_the_start(command: list[str], problem: str) -> None:
    process = ExportProcess(HELLO, command=command)
    with pytest.raises(ExportStartError, match=problem):
        process.start()
    assert process.pid is None
    process.close()


def test_a_child_not_ready_in_time_is_killed() -> None:
    process = fake("mute", startup_bound_s=0.2)
    with pytest.raises(ExportStartError, match="was not ready within 0.2 s"):
        process.start()
    process.close()


def test_a_lost_child_is_replaced_by_a_batch_after_the_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    process = fake("ok", restart_interval_s=0.0)
    process.start()
    first = process.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert process.export([row()]) is False  # lost: killed, reaped, counted by the caller
    assert process.pid is None
    assert process.export([row()]) is True  # a new child
    assert process.pid not in (None, first)
    process.close()
    lost = [r for r in caplog.records if "span export process (pid" in r.getMessage()]
    assert len(lost) == 1 and f"(pid {first}) exited" in lost[0].getMessage()
    assert any("restarted" in r.getMessage() for r in caplog.records)


def test_within_the_interval_batches_fail_at_once() -> None:
    process = fake("ok", restart_interval_s=3600.0)
    process.start()
    pid = process.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert process.export([row()]) is False
    assert process.export([row()]) is False
    assert process.pid is None  # no new child yet
    process.close()


def test_a_miscounting_child_is_lost() -> None:
    process = fake("miscount", restart_interval_s=3600.0)
    process.start()
    assert process.export([row()]) is False
    assert process.pid is None
    process.close()


def test_a_child_late_past_the_answer_bound_is_killed() -> None:
    process = fake("stall", answer_bound_s=0.2, restart_interval_s=3600.0)
    process.start()
    assert process.export([row()]) is False
    assert process.pid is None
    process.close()


def test_begin_close_cuts_a_wait_under_way() -> None:
    process = fake("stall", "signal", answer_bound_s=60.0)
    process.start()
    results: list[bool] = []
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # the export thread's too
    try:
        exporting = threading.Thread(target=lambda: results.append(process.export([row()])))
        exporting.start()
        # The child has had the batch for 0.2 s: the export thread waits for its answer.
        assert signal.sigtimedwait({signal.SIGUSR1}, 30) is not None
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    start = time.monotonic()
    process.begin_close(time.monotonic() + 0.3)
    exporting.join(10)
    assert results == [False]
    assert time.monotonic() - start < 5  # the close deadline, not the 60 s answer bound
    process.close()


def test_close_kills_a_child_that_outlives_its_stdin(caplog: pytest.LogCaptureFixture) -> None:
    process = fake("stubborn")
    process.start()
    closing = threading.Thread(target=process.close, args=(time.monotonic() + 0.3,),
                               daemon=True)
    closing.start()
    closing.join(5)
    assert not closing.is_alive()
    assert any("did not finish within the flush bound" in r.getMessage()
               for r in caplog.records)


# --------------------------------------------------------------------------- the real child


def otlp_url(receiver: tuple[str, type[OtlpReceiver]]) -> tuple[str, type[OtlpReceiver]]:
    """test_tracing's loopback OTLP receiver, by its full ``/v1/traces`` URL."""
    base, handler = receiver
    return base + "/v1/traces", handler


def _sdk() -> None:
    pytest.importorskip("opentelemetry.sdk")
    pytest.importorskip("opentelemetry.proto")




def traced(endpoint: str, *sets: str) -> Config:
    return load_config(None, ["tracing.enabled=true", f"tracing.otlp_endpoint={endpoint}",
                              "judge.model=judge-7b", "num_rollouts_per_prompt=2", *sets], {})


def every_kind_of_span(tracer: tracing.Tracer, cfg: Config) -> None:
    """Spans with everything the server's have: a remote parent with a trace state, local
    parents, links with attributes, events with attributes, attributes of every type, error
    and unset statuses."""
    inbound = [(b"traceparent", f"00-{INBOUND_TRACE}-{INBOUND_SPAN}-01".encode()),
               (b"tracestate", b"vendor=abc,other=1")]
    first = tracer.request("POST", "/ng-rollout/r-1/verify", inbound, "r-1")
    first.member(member(cfg, 0, group="g-every"))
    second = tracer.request("POST", "/verify", [], None)
    second.member(member(cfg, 1, group="g-every"))
    cohort = tracer.cohort("g:g-every:0", "g-every", 0, 2)
    cohort.joined(first, 0, False)
    cohort.joined(second, 1, False)
    cohort.joined(second, 1, True)
    cohort.collected()
    cohort.evaluation_started(2)
    retried = cohort.judge_call(0)
    retried.endpoint("http://127.0.0.1:1")
    retried.attempt(0, "http_503", 0.012)
    retried.backoff(1, 0.05)
    retried.answer({"model": "judge-7b", "choices": [{"finish_reason": "stop"}],
                    "usage": {"prompt_tokens_details": {"cached_tokens": 7}}})
    retried.attempt(1, None, 0.02)
    retried.end("verdict", None, 900, 40)
    failed = cohort.judge_call(1)
    failed.attempt(0, "timeout", 1.5)
    failed.end("failed", "timeout", 450, 0)
    cohort.disposed("judge_failed", {"members": 2, "size": 2, "collection_s": 0.25,
                                     "judge_calls": 2})
    first.outcome("judge_failed", True)
    first.end(503)
    second.outcome("rewarded")
    second.end(200)
    tracer.shutdown_began(0, 0)


def decoded(bodies: list[bytes], names: dict[bytes, str] | None = None) -> list[dict[str, Any]]:
    """Every span of OTLP/HTTP bodies, with its resource and scope, as comparable dicts:
    ids renamed by first appearance (in ``names``), times left out (checked for order)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    names = {} if names is None else names

    def name(raw: bytes) -> str:
        return "" if not raw else names.setdefault(raw, f"id{len(names)}")

    def attrs(items: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for item in items:
            which = item.value.WhichOneof("value")
            value = getattr(item.value, which)
            if which == "array_value":
                value = [getattr(v, v.WhichOneof("value")) for v in value.values]
            if item.key == "genrm.cohort.trace_id":  # an id too, in hex
                value = name(bytes.fromhex(value))
            out[item.key] = (which, value)
        return out

    spans = []
    for body in bodies:
        for resource in ExportTraceServiceRequest.FromString(body).resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    assert span.start_time_unix_nano <= span.end_time_unix_nano
                    for event in span.events:
                        assert span.start_time_unix_nano <= event.time_unix_nano \
                            <= span.end_time_unix_nano
                    spans.append({
                        "resource": attrs(resource.resource.attributes),
                        "scope": scope.scope.name, "name": span.name, "kind": span.kind,
                        "trace_id": name(span.trace_id), "span_id": name(span.span_id),
                        "parent": name(span.parent_span_id), "flags": span.flags,
                        "trace_state": span.trace_state,
                        "attributes": attrs(span.attributes),
                        "events": [(e.name, attrs(e.attributes)) for e in span.events],
                        "links": [(name(link.trace_id), name(link.span_id), link.flags,
                                   attrs(link.attributes)) for link in span.links],
                        "status": (span.status.code, span.status.message),
                    })
    return spans


def test_the_export_process_exports_what_the_sdk_would(
        receiver: tuple[str, type[OtlpReceiver]]) -> None:
    # The same spans through the export process and, in this process, through the SDK's own
    # encoder (the path before the export process): the same OTLP, ids and times aside.
    _sdk()
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    url, handler = otlp_url(receiver)
    cfg = traced(url)
    tracer = tracing.open_tracer(cfg)
    assert tracer.export_pid is not None
    every_kind_of_span(tracer, cfg)
    tracer.close(10.0)
    assert tracer.export_failures == 0
    memory = InMemorySpanExporter()
    local = tracing.open_tracer(cfg, exporter=memory, synchronous=True)
    every_kind_of_span(local, cfg)
    local.close(1.0)
    ids: dict[bytes, str] = {}
    through_child = decoded(handler.bodies, ids)
    assert through_child == decoded([encode_spans(memory.get_finished_spans())
                                     .SerializeToString()])
    # And what that is, spelled out where it matters.
    by_name = {s["name"]: s for s in through_child}
    assert len(through_child) == 6
    first = by_name["POST /ng-rollout/r-1/verify"]
    assert first["resource"]["service.name"] == ("string_value", "genrm-trio")
    assert first["resource"]["telemetry.sdk.name"] == ("string_value", "opentelemetry")
    assert first["scope"] == "genrm_trio"
    assert first["trace_id"] == ids[bytes.fromhex(INBOUND_TRACE)]  # the caller's, continued
    assert first["parent"] == ids[bytes.fromhex(INBOUND_SPAN)]
    assert first["trace_state"] == "vendor=abc,other=1"
    assert first["flags"] & 0x200  # its parent is remote
    assert first["status"] == (2, "503")
    assert first["attributes"]["genrm.mask_sample"] == ("bool_value", True)
    assert first["attributes"]["genrm.group_attempt"] == ("int_value", 0)
    assert first["attributes"]["genrm.rollout_id"] == ("string_value", "r-1")
    cohort = by_name["genrm.cohort"]
    assert cohort["parent"] == "" and cohort["status"] == (2, "judge_failed")
    assert cohort["attributes"]["genrm.collection_s"] == ("double_value", 0.25)
    assert [e[0] for e in cohort["events"]] == [
        "genrm.cohort.collected", "genrm.cohort.evaluation_started", "genrm.cohort.failed"]
    assert cohort["events"][1][1] == {"genrm.comparisons": ("int_value", 2)}
    assert [link[3] for link in cohort["links"]] == [
        {"genrm.rollout_index": ("int_value", 0)}, {"genrm.rollout_index": ("int_value", 1)},
        {"genrm.rollout_index": ("int_value", 1), "genrm.duplicate": ("bool_value", True)}]
    assert cohort["links"][0][1] == first["span_id"]
    assert first["attributes"]["genrm.cohort.trace_id"] == ("string_value", cohort["trace_id"])
    (judge,) = [s for s in through_child if s["name"] == "chat judge-7b"
                and s["attributes"]["genrm.judge.idx"] == ("int_value", 0)]
    assert judge["kind"] == 3  # SPAN_KIND_CLIENT
    assert judge["parent"] == cohort["span_id"] and judge["trace_id"] == cohort["trace_id"]
    assert judge["attributes"]["gen_ai.response.finish_reasons"] == ("array_value", ["stop"])
    assert [e[0] for e in judge["events"]] == [
        "genrm.judge.attempt", "genrm.judge.backoff", "genrm.judge.attempt"]
    assert judge["status"] == (0, "")


def test_the_child_exits_0_at_eof_and_prints_nothing(
        receiver: tuple[str, type[OtlpReceiver]]) -> None:
    _sdk()
    url, handler = otlp_url(receiver)
    handler.status = 400  # refused: the exporter's failure line must not be printed
    child = subprocess.Popen(trace_export.child_command(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None

    def send(message: Any) -> None:
        data = msgspec.msgpack.encode(message)
        assert child.stdin is not None
        child.stdin.write(struct.pack(">I", len(data)) + data)
        child.stdin.flush()

    def receive() -> Any:
        assert child.stdout is not None
        (size,) = struct.unpack(">I", child.stdout.read(4))
        return msgspec.msgpack.decode(child.stdout.read(size))

    try:
        send(msgspec.structs.replace(HELLO, endpoint=url))
        assert receive() == [True, 0, ""]
        send([row(), row()])
        assert receive() == [False, 2, ""]
        handler.status = 200
        send([row()])
        assert receive() == [True, 1, ""]
        child.stdin.close()
        assert child.wait(30) == 0
        assert child.stdout.read() == b""
        assert child.stderr is not None and child.stderr.read() == b""
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None:
                stream.close()
    assert len(handler.bodies) == 2


def test_a_killed_server_leaves_no_export_process_behind(
        receiver: tuple[str, type[OtlpReceiver]]) -> None:
    _sdk()
    url, _ = otlp_url(receiver)
    code = textwrap.dedent(f"""
        import sys, time
        from genrm_trio.config import load_config
        from genrm_trio.server import tracing
        cfg = load_config(None, ["tracing.enabled=true", "tracing.otlp_endpoint={url}"], {{}})
        tracer = tracing.open_tracer(cfg)
        print(tracer.export_pid, flush=True)
        time.sleep(3600)
    """)
    # This process adopts the orphan (a subreaper), so it can reap it: no zombie is left.
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        server = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        assert server.stdout is not None
        try:
            pid = int(server.stdout.readline())
            gone = os.pidfd_open(pid)
        finally:
            server.kill()
            server.wait()
            server.stdout.close()
        try:
            # Its stdin's EOF ends it: the pidfd turns readable when it has exited.
            assert select.select([gone], [], [], 30)[0] == [gone]
        finally:
            os.close(gone)
        assert os.waitpid(pid, 0)[1] == 0  # adopted: reaped here; it exited 0
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


async def test_an_unreachable_collector_costs_a_counter_and_one_line(
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _sdk()
    from tests.test_tracing import post_members, traced_cfg

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")  # no retry backoffs
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    from genrm_trio.mock.judge import run_mock_judge
    from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState

    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(partial(run_mock_judge, MockJudgeSettings(),
                                                state=MockJudgeState()))
        cfg = traced_cfg(judge_url, 2, **{"tracing.otlp_endpoint":
                                          f"http://127.0.0.1:{port}/v1/traces"})
        tracer = tracing.open_tracer(cfg)
        stop = trio.Event()
        async with trio.open_nursery() as server:
            url = await server.start(partial(_serve, cfg, stop, tracer))
            for group in ("g-a", "g-b"):
                answers = await post_members(url, group, 2)
                assert [a.status_code for a in answers] == [200, 200]  # the server stays up
            stop.set()
        nursery.cancel_scope.cancel()
    # 2 cohorts of 2 requests, 1 cohort span and 2 judge spans each, and the shutdown span.
    assert tracer.export_failures == 11
    lines = [r for r in caplog.records if "span export failed" in r.getMessage()]
    assert len(lines) == 1
    assert "Failed to export" not in capfd.readouterr().err  # nothing from the exporter


async def _serve(cfg: Config, stop: trio.Event, tracer: tracing.Tracer,
                 task_status: trio.TaskStatus[str]) -> None:
    from genrm_trio.server.serve import run_server

    await run_server(cfg, shutdown=stop, tracer=tracer, task_status=task_status)


async def test_a_killed_export_process_costs_only_its_spans(
        receiver: tuple[str, type[OtlpReceiver]], caplog: pytest.LogCaptureFixture) -> None:
    _sdk()
    from genrm_trio.mock.judge import run_mock_judge
    from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
    from tests.test_tracing import post_members, traced_cfg

    otlp, handler = otlp_url(receiver)
    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(partial(run_mock_judge, MockJudgeSettings(),
                                                state=MockJudgeState()))
        cfg = traced_cfg(judge_url, 2, **{"tracing.otlp_endpoint": otlp})
        tracer = tracing.open_tracer(cfg, synchronous=True)  # each span exported as it ends
        stop = trio.Event()
        async with trio.open_nursery() as server:
            url = await server.start(partial(_serve, cfg, stop, tracer))
            answers = await post_members(url, "g-before", 2)
            assert [a.status_code for a in answers] == [200, 200]
            await trio.testing.wait_all_tasks_blocked()  # the requests' spans ended too
            assert len(handler.bodies) == 5 and tracer.export_failures == 0
            pid = tracer.export_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            for group in ("g-after", "g-later"):
                answers = await post_members(url, group, 2)
                assert [a.status_code for a in answers] == [200, 200]
            stop.set()
        nursery.cancel_scope.cancel()
    assert len(handler.bodies) == 5  # nothing more arrived, and nothing raised
    assert tracer.export_failures == 11  # two cohorts' 5 spans each, and the shutdown span
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "span export failed" in m]) == 1
    assert len([m for m in messages if f"span export process (pid {pid}) exited" in m]) == 1


async def test_closing_with_a_stalled_collector_keeps_its_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    _sdk()
    with socket.socket() as stalled:  # accepts connections (the backlog), never answers
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(8)
        cfg = traced(f"http://127.0.0.1:{stalled.getsockname()[1]}/v1/traces")
        tracer = tracing.open_tracer(cfg)  # the batch processor, as in the server
        for _ in range(3):
            tracer.request("POST", "/verify", [], None).end(200)
        start = time.monotonic()
        await tracing.close_tracer(tracer, 0.5)
        took = time.monotonic() - start
    # The 0.5 s bound, not the exporter's 10 s timeout or the 60 s answer bound; the slack
    # is a starved machine's late wake-up (the kill and reap inside the bound is the next
    # assertion's: nothing was abandoned).
    assert took < 0.5 + 2.0
    assert tracer.export_failures == 3
    assert any("did not finish within the flush bound" in r.getMessage()
               for r in caplog.records)
    assert not any("took over" in r.getMessage() for r in caplog.records)  # not abandoned


_BLOCK_PROTO = """\
import sys


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry.proto" or name.startswith("opentelemetry.proto."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Block())
"""


def test_an_export_process_that_cannot_start_stops_the_server_in_one_line(
        tmp_path: Path) -> None:
    # opentelemetry-proto missing: the server's process never needs it, the export process
    # does, so this is found as the export process starts, before anything is bound.
    _sdk()
    (tmp_path / "sitecustomize.py").write_text(_BLOCK_PROTO)
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).parents[1])])
    done = subprocess.run(
        [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
         "--set", "tracing.enabled=true", "--set", "log_level=WARNING"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "tracing.enabled" in lines[0] and "span export process did not start" in lines[0]
    assert "opentelemetry.proto" in lines[0] and "pip install -e '.[otel]'" in lines[0]
