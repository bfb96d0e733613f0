"""``tracing``: what cohort-level traces cost (issue 20), and one cohort's trace as a picture.

One case, four servers side by side in one run, in interleaved rounds (off, on at sample
ratio 1.0, on at 0.1, off with the ``opentelemetry`` packages made unimportable, then again):
closed-loop cohorts against an instant judge, so the server's CPU is the limit and the tracing
work shows. The ratios are medians of each round's ratio to that round's off arm (the arms of a
round run back to back, so a neighbour's load drifting between rounds cancels out). The spans
go from the server's span export process over OTLP/HTTP to a sink on loopback (a thread of
this process) that accepts and discards them; that process's CPU during the measured window
(it lags by the batch processor's delay, at most 5 s) is reported per cohort beside the
server's (``export_process_cpu_ms_per_cohort_*``): the machine pays it, not the server's
loop. The no-extra arm (``off_no_otel``) runs the server with a ``sitecustomize`` first on its
``PYTHONPATH`` whose import hook refuses every ``opentelemetry`` module, as if the ``[otel]``
extra were not installed. Then a short traced run against a judge that fails a third of its
calls keeps the spans of a few cohorts, for the timeline plot (bench/plots.py:
``tracing_timeline.png``). Needs the ``[otel]`` extra (the picture decodes the protobuf with
``opentelemetry-proto``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec

from genrm_trio.bench.cases.measure import measured_load, warm_up_run
from genrm_trio.bench.loadgen import BodyFactory, LoadPlan, children_cpu_s
from genrm_trio.bench.records import (
    BenchContext,
    BenchError,
    Case,
    JudgeSettings,
    RunRecord,
    ServerSettings,
)
from genrm_trio.bench.rig import _rig

VARIANTS: tuple[tuple[str, float | None], ...] = (("off", None), ("on_1.0", 1.0),
                                                  ("on_0.1", 0.1), ("off_no_otel", None))
#: The no-extra arm's ``sitecustomize``: every ``opentelemetry`` import fails, as uninstalled.
_NO_OTEL_SITECUSTOMIZE = """\
import sys


class _NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoOpenTelemetry())
"""
_KEPT_BYTES = 8 * 2**20  # what the picture's sink keeps, at most


class _Sink:
    """An OTLP/HTTP ``/v1/traces`` receiver: answers 200; keeps bodies only when asked."""

    def __init__(self, url: str, handler: type[_SinkHandler]) -> None:
        self.url = url
        self._handler = handler

    def keep(self, on: bool) -> None:
        self._handler.keeping = on

    @property
    def kept(self) -> list[bytes]:
        return self._handler.bodies

    @property
    def received(self) -> int:
        return self._handler.requests


class _SinkHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector would
    bodies: list[bytes]
    keeping = False
    requests = 0
    kept_bytes = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        data = self.rfile.read(int(self.headers.get("content-length") or 0))
        cls = type(self)
        cls.requests += 1
        if cls.keeping and cls.kept_bytes + len(data) <= _KEPT_BYTES:
            cls.bodies.append(data)
            cls.kept_bytes += len(data)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def otlp_sink() -> Iterator[_Sink]:
    """The sink, served from a daemon thread on 127.0.0.1 (any free port) for the block."""
    handler = type("SinkHandler", (_SinkHandler,), {"bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield _Sink(f"http://127.0.0.1:{server.server_address[1]}/v1/traces", handler)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def no_otel_pythonpath() -> Iterator[str]:
    """A ``PYTHONPATH`` (this one's, behind a temporary folder holding the no-extra
    ``sitecustomize``) under which no ``opentelemetry`` module imports, for the block."""
    with tempfile.TemporaryDirectory(prefix="genrm-no-otel-") as folder:
        Path(folder, "sitecustomize.py").write_text(_NO_OTEL_SITECUSTOMIZE)
        yield os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)


def _tracing_sets(url: str, ratio: float | None) -> tuple[tuple[str, str], ...]:
    if ratio is None:
        return ()
    return (("tracing.enabled", "true"), ("tracing.otlp_endpoint", url),
            ("tracing.sample_ratio", repr(ratio)))


def tracing_case(*, n: int = 8, k: int = 16, judge_ms: float = 0.0, duration_s: float = 8.0,
                 rounds: int = 3) -> Case:
    """verifies/s with tracing off, on at 1.0, on at 0.1 and off without the extra (median of
    ``rounds`` each), the medians of the per-round ratios to off, and one cohort's spans
    (``notes["timeline"]``) for the plot."""

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        if kind != "ours":
            raise BenchError("tracing: a genrm-trio case")
        try:
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: F401
        except ImportError as exc:
            raise BenchError("tracing: needs the otel extra: pip install -e '.[otel]'") from exc
        rates: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
        cpu: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
        export_cpu: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
        with otlp_sink() as sink, no_otel_pythonpath() as path:
            for _ in range(rounds):
                for name, ratio in VARIANTS:
                    server = ServerSettings(
                        n=n, ours_extra=_tracing_sets(sink.url, ratio),
                        ours_env=(("PYTHONPATH", path),) if name == "off_no_otel" else ())
                    judge = JudgeSettings(latency_ms=judge_ms)
                    async with _rig(ctx, kind, judge, server, f"{tag}-{name}") as rig:
                        bodies = BodyFactory(seed=7, run_tag=rig.run_tag)
                        await warm_up_run(rig, bodies, n)
                        plan = LoadPlan(n=n, k=k, max_cohorts=1_000_000, duration_s=duration_s)
                        exporter0 = children_cpu_s(rig.server.pid)
                        record = await measured_load(rig, bodies, plan, judge_ms)
                        exporter_s = children_cpu_s(rig.server.pid) - exporter0
                    rates[name].append(record.metrics["verifies_per_s"])
                    cpu[name].append(record.metrics["cpu_ms_per_cohort"])
                    cohorts = record.metrics["cohorts"]
                    export_cpu[name].append(1000 * exporter_s / cohorts if cohorts else 0.0)
            exported = sink.received
            timeline = await _timeline_run(ctx, kind, tag, sink)
        metrics: dict[str, float] = {}
        for name, _ in VARIANTS:
            metrics[f"verifies_per_s_{name}"] = statistics.median(rates[name])
            metrics[f"cpu_ms_per_cohort_{name}"] = statistics.median(cpu[name])
        for name in ("on_1.0", "on_0.1"):  # the machine pays it, the server's loop does not
            metrics[f"export_process_cpu_ms_per_cohort_{name}"] = statistics.median(
                export_cpu[name])
        for name in ("on_1.0", "on_0.1"):
            metrics[f"ratio_{name}"] = statistics.median(
                on / off for on, off in zip(rates[name], rates["off"], strict=True))
        # Off with the extra installed over off without it (the goal: 1.0x).
        metrics["ratio_off_over_no_otel"] = statistics.median(
            off / bare for off, bare in zip(rates["off"], rates["off_no_otel"], strict=True))
        metrics["otlp_requests"] = float(exported)
        samples = {f"verifies_per_s_{name}": values for name, values in rates.items()}
        return RunRecord(metrics, samples, {"timeline": timeline})

    params = {"n": n, "k": k, "judge_ms": judge_ms, "duration_s": duration_s,
              "rounds": rounds}
    return Case("tracing", f"n{n}-k{k}-judge{int(judge_ms)}ms", run, params, kinds=("ours",))


async def _timeline_run(ctx: BenchContext, kind: str, tag: str,
                        sink: _Sink) -> list[dict[str, Any]]:
    """A few traced cohorts of 4 against a 40 ms judge that answers a third of its calls with
    503 (retried): the spans of the cohort with the most judge attempts, as plain dicts."""
    server = ServerSettings(n=4, ours_extra=(
        *_tracing_sets(sink.url, 1.0), ("genrm_parse_retry_sleep_s", "0.05")))
    sink.keep(True)
    async with _rig(ctx, kind, JudgeSettings(latency_ms=40.0, jitter_ms=30.0), server,
                    f"{tag}-timeline") as rig:
        await rig.judge_client.request("POST", "/admin/fault", msgspec.json.encode(
            {"fault": "503", "count": None, "rate": 0.33}))
        bodies = BodyFactory(seed=9, run_tag=rig.run_tag)
        plan = LoadPlan(n=4, k=1, max_cohorts=6, duration_s=30.0)
        await measured_load(rig, bodies, plan, 40.0)
    sink.keep(False)  # the server flushed its spans as it stopped
    return pick_cohort(decode_spans(sink.kept))


def decode_spans(bodies: list[bytes]) -> list[dict[str, Any]]:
    """Every span of OTLP/HTTP protobuf request bodies, as dicts (ids in hex, times in ns)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    def value(v: Any) -> Any:
        field = v.WhichOneof("value")
        return getattr(v, field) if field in ("string_value", "int_value", "double_value",
                                              "bool_value") else None

    out: list[dict[str, Any]] = []
    for data in bodies:
        request = ExportTraceServiceRequest.FromString(data)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    out.append({
                        "name": span.name,
                        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_id": span.parent_span_id.hex(),
                        "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                        "attributes": {a.key: value(a.value) for a in span.attributes},
                        "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                    "attributes": {a.key: value(a.value) for a in e.attributes}}
                                   for e in span.events],
                        "links": [link.span_id.hex() for link in span.links],
                    })
    return out


def pick_cohort(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One completed cohort's spans: its member requests, the cohort span and its judge
    calls; the cohort whose judge calls made the most attempts (retries show)."""
    by_id = {s["span_id"]: s for s in spans}
    best: list[dict[str, Any]] = []
    best_attempts = -1
    for cohort in (s for s in spans if s["name"] == "genrm.cohort"
                   and s["attributes"].get("genrm.outcome") == "completed"):
        judges = [s for s in spans if s["parent_id"] == cohort["span_id"]]
        attempts = sum(int(s["attributes"].get("genrm.judge.attempts") or 0) for s in judges)
        if attempts > best_attempts:
            members = [by_id[i] for i in cohort["links"] if i in by_id]
            best, best_attempts = [*members, cohort, *judges], attempts
    return best
