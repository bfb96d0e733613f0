"""CPU of cohort-level tracing per cohort, in process (issue 20): the tracer's calls for N=8
cohorts (circular: 8 judge comparisons, each answered at its first attempt), exactly as the
server makes them, spans to the SDK's batch processor whose exporter OTLP-encodes each batch
(protobuf, as the OTLP/HTTP exporter does) and drops it.

    PYTHONPATH=. python bench/tracing_cpu.py [--cohorts 1000] [--rate 100] [--ratio 1.0] ...

Cohorts are paced at ``--rate`` per second (about the server's own in the ``tracing`` preset),
so the batch processor's queue and its export thread behave as in the server; the same loop
with tracing off is the baseline. Prints, per sample ratio, the CPU per cohort over that
baseline of the trio thread (``time.thread_time``: the calls, building and ending spans) and
of the export thread (the process's CPU minus the trio thread's: encoding). Unlike the
preset's verifies/s this is CPU time, which a machine busy with other work changes less: the
number to compare two versions of server/tracing.py by. The gc thresholds are the server's
(serve.py). Needs the ``[otel]`` extra.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from typing import Any

from genrm_trio.config import load_config
from genrm_trio.server import tracing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohorts", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="cohorts per second")
    parser.add_argument("--ratio", type=float, action="append")
    args = parser.parse_args()
    base_ms, _, _ = measure(None, args.cohorts, args.rate)
    print(f"tracing off: {base_ms:.3f} ms CPU per cohort (the loop itself)")
    for ratio in args.ratio or [1.0, 0.1]:
        main_ms, export_ms, spans = measure(ratio, args.cohorts, args.rate)
        main_ms -= base_ms
        print(f"sample ratio {ratio:g}: {main_ms:.3f} ms trio thread + {export_ms:.3f} ms export "
              f"thread = {main_ms + export_ms:.3f} ms CPU per cohort ({spans:.1f} spans)")


def measure(ratio: float | None, cohorts: int, rate: float) -> tuple[float, float, float]:
    """CPU ms per cohort of the trio thread and of the export thread, spans per cohort;
    ``ratio`` None: tracing off."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Encoding(SpanExporter):
        spans = 0

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            encode_spans(spans).SerializePartialToString()
            Encoding.spans += len(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    sets = ["judge.model=judge-7b"]
    if ratio is not None:
        sets += ["tracing.enabled=true", f"tracing.sample_ratio={ratio!r}"]
    cfg = load_config(None, sets, {})
    tracer = tracing.open_tracer(cfg, exporter=Encoding())
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)
    for _ in range(100):
        one_cohort(tracer)
    tracer.close(10.0)  # flushed: the warm-up's spans are not counted
    tracer = tracing.open_tracer(cfg, exporter=Encoding())
    Encoding.spans = 0
    thread0, process0 = time.thread_time(), time.process_time()
    start = time.monotonic()
    for index in range(cohorts):
        one_cohort(tracer)
        ahead = start + (index + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)  # the export thread runs meanwhile, as between requests
    thread1 = time.thread_time()
    tracer.close(60.0)  # the export thread encodes what is left
    process1 = time.process_time()
    main_s = thread1 - thread0
    return (1000 * main_s / cohorts, 1000 * (process1 - process0 - main_s) / cohorts,
            Encoding.spans / cohorts)


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


def one_cohort(tracer: tracing.Tracer) -> None:
    requests = [tracer.request("POST", "/verify", _HEADERS, None) for _ in range(8)]
    for span, member in zip(requests, _MEMBERS, strict=True):
        span.member(member)  # type: ignore[arg-type]
    cohort = tracer.cohort("g:r7-1796169055-g4:0", "r7-1796169055-g4", 0, 8)
    for slot, span in enumerate(requests):
        cohort.joined(span, slot, False)
    cohort.collected()
    cohort.evaluation_started(8)
    for idx in range(8):
        judge = cohort.judge_call(idx)
        judge.headers()
        judge.endpoint("http://127.0.0.1:8001")
        judge.answer(_ANSWER)
        judge.attempt(0, None, 0.004)
        judge.end("verdict", None, 900, 40)
    cohort.disposed("completed", _FIELDS)
    for span in requests:
        span.outcome("rewarded", False, None)
        span.end(200)


if __name__ == "__main__":
    main()
