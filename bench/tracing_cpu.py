"""CPU of cohort-level tracing per cohort (issue 20): the tracer's calls for N=8 cohorts
(circular: 8 judge comparisons, each answered at its first attempt), exactly as the server
makes them, with the server's real export path: the SDK's batch processor, whose export
thread hands each batch to the span export process (server/trace_export.py), which
OTLP-encodes it and posts it to a sink (its own process, answering 200 on loopback).

    PYTHONPATH=. python bench/tracing_cpu.py [--cohorts 1000] [--rate 100] [--ratio 1.0] ...

Cohorts are paced at ``--rate`` per second (about the server's own in the ``tracing`` preset),
so the batch processor's queue and its export thread behave as in the server; the same loop
with tracing off is the baseline. Prints, per sample ratio, the CPU per cohort over that
baseline of the trio thread (``time.thread_time``: the calls, building and ending spans), of
the export thread (this process's CPU minus the trio thread's: rows to msgpack, the pipe),
both in the server's process, and of the export process (its CPU once reaped, less what its
start took: rebuilding the SDK's spans, the OTLP encoding and the HTTP post), which the
machine pays but the server's loop no longer does. Unlike the preset's verifies/s this is CPU
time, which a machine busy with other work changes less: the number to compare two versions
of server/tracing.py by. The gc thresholds are the server's (serve.py). Needs the ``[otel]``
extra.
"""

from __future__ import annotations

import argparse
import gc
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from genrm_trio.bench.loadgen import read_proc_stats
from genrm_trio.config import load_config
from genrm_trio.server import tracing

#: The sink: an OTLP/HTTP receiver in its own process that reads each body and answers 200.
_SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohorts", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="cohorts per second")
    parser.add_argument("--ratio", type=float, action="append")
    args = parser.parse_args()
    with otlp_sink() as url:
        base_ms, _, _, _ = measure(None, url, args.cohorts, args.rate)
        print(f"tracing off: {base_ms:.3f} ms CPU per cohort (the loop itself)")
        for ratio in args.ratio or [1.0, 0.1]:
            main_ms, export_ms, child_ms, spans = measure(ratio, url, args.cohorts, args.rate)
            main_ms -= base_ms
            print(f"sample ratio {ratio:g}: {main_ms:.3f} ms trio thread + {export_ms:.3f} ms "
                  f"export thread = {main_ms + export_ms:.3f} ms CPU per cohort in the server's "
                  f"process, + {child_ms:.3f} ms in the export process = "
                  f"{main_ms + export_ms + child_ms:.3f} ms ({spans:.1f} spans)")


@contextmanager
def otlp_sink() -> Iterator[str]:
    """The sink's ``/v1/traces`` URL, its process running for the block (then ended)."""
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        yield f"http://127.0.0.1:{int(sink.stdout.readline())}/v1/traces"
    finally:
        sink.terminate()
        sink.wait()


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(ratio: float | None, url: str, cohorts: int,
            rate: float) -> tuple[float, float, float, float]:
    """CPU ms per cohort of the trio thread, of the export thread and of the export process,
    and spans per cohort; ``ratio`` None: tracing off."""
    sets = ["judge.model=judge-7b", "log_level=WARNING", f"tracing.otlp_endpoint={url}"]
    if ratio is not None:
        sets += ["tracing.enabled=true", f"tracing.sample_ratio={ratio!r}"]
    cfg = load_config(None, sets, {})
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)
    tracer = tracing.open_tracer(cfg)
    for _ in range(100):
        one_cohort(tracer)
    tracer.close(10.0)  # flushed, its export process reaped: the warm-up is not counted
    children0 = _children_cpu_s()
    tracer = tracing.open_tracer(cfg)
    pid = tracer.export_pid
    started_s = read_proc_stats(pid).cpu_s if pid is not None else 0.0  # its imports
    spans = 0
    thread0, process0 = time.thread_time(), time.process_time()
    start = time.monotonic()
    for index in range(cohorts):
        spans += one_cohort(tracer)
        ahead = start + (index + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)  # the export thread runs meanwhile, as between requests
    thread1 = time.thread_time()
    tracer.close(60.0)  # the export thread and process export what is left
    process1 = time.process_time()
    child_s = _children_cpu_s() - children0 - started_s
    if tracer.export_failures:
        raise SystemExit(f"{tracer.export_failures} spans failed to export")
    main_s = thread1 - thread0
    return (1000 * main_s / cohorts, 1000 * (process1 - process0 - main_s) / cohorts,
            1000 * child_s / cohorts, spans / cohorts)


class _Member:
    def __init__(self, slot: int) -> None:
        self.attempt = 0
        self.group_id = "r7-1796169055-g4"
        self.rollout_index = slot


_MEMBERS = [_Member(slot) for slot in range(8)]
_HEADERS = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
            (b"content-length", b"2048")]
_ANSWER: dict[str, Any] = {
    "model": "judge-7b", "choices": [{"finish_reason": "stop", "message": {"content": "x"}}],
    "usage": {"prompt_tokens": 900, "completion_tokens": 40}}
_FIELDS = {"members": 8, "size": 8, "collection_s": 0.01, "evaluation_s": 0.02,
           "judge_calls": 8, "judge_results": 8, "defaulted_comparisons": 0,
           "judge_input_tokens": 7200, "judge_output_tokens": 320, "judge_cached_tokens": 0,
           "scored": 8}


def one_cohort(tracer: tracing.Tracer) -> int:
    """One cohort's tracer calls; how many spans it recorded."""
    requests = [tracer.request("POST", "/verify", _HEADERS, None) for _ in range(8)]
    for span, member in zip(requests, _MEMBERS, strict=True):
        span.member(member)  # type: ignore[arg-type]
    cohort = tracer.cohort("g:r7-1796169055-g4:0", "r7-1796169055-g4", 0, 8)
    for slot, span in enumerate(requests):
        cohort.joined(span, slot, False)
    cohort.collected()
    cohort.evaluation_started(8)
    spans = sum(span.recording for span in requests) + (cohort is not tracing.NO_COHORT_TRACE)
    for idx in range(8):
        judge = cohort.judge_call(idx)
        spans += judge.recording
        judge.headers()
        judge.endpoint("http://127.0.0.1:8001")
        judge.answer(_ANSWER)
        judge.attempt(0, None, 0.004)
        judge.end("verdict", None, 900, 40)
    cohort.disposed("completed", _FIELDS)
    for span in requests:
        span.outcome("rewarded", False, None)
        span.end(200)
    return spans


if __name__ == "__main__":
    main()
