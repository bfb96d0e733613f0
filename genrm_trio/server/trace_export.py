"""The span export process (issue 20): OTLP encoding and export out of the server's process.

The tracing bridge's other half. server/tracing.py records spans and batches them with the
SDK's batch processor; this module carries each batch to a child process, which rebuilds the
SDK's ``ReadableSpan`` objects and exports them with the SDK's own OTLP/HTTP exporter. The two
are the only modules of the server that import ``opentelemetry``, and this one does so only in
the child (:func:`main`): the server process never builds the OTLP exporter, so its protobuf
encoding (about 80 us a span) no longer holds the GIL that the server's trio loop needs.

::

    server process                                      python -m genrm_trio.server.trace_export
    trio thread: a span ends -> a row (plain tuples)
    batch processor's thread: ExportProcess.export(rows)
        -- Hello (once), then [row, ...] -- stdin -->   rows -> ReadableSpans
                                                        OTLPSpanExporter(endpoint).export(...)
        <-- Answer(ok, spans) ------------- stdout --   one answer per frame

Frames: a 4-byte big-endian length, then msgspec msgpack. The server's first frame is a
:class:`Hello` (endpoint, resource, scope, log settings), which the child answers with an
:class:`Answer` (ready, or why not, before it exits 1); then every batch, a list of
:class:`SpanRow` (ids as ints, a 128-bit trace id as two 64-bit halves), gets one
:class:`Answer`: ``ok`` (the exporter's success) and the batch's span count. Rows are plain
tuples on the server's side (msgspec encodes them in C) and structs here, checked as they
are decoded. The child writes its frames to the descriptor that was its stdout and points
descriptor 1 at stderr, so nothing a library prints can corrupt them; it logs (with the
server's log format) only what the SDK has to say about its configuration: the exporter's
per-failure lines are dropped, the server counts failures from the answers.

Lifetimes: the tracer owns one :class:`ExportProcess`, which owns at most one child at a
time and reaps every child it started. The child lives as long as its stdin: on EOF (the
server closed the pipe, or exited or was killed) it shuts the exporter down and exits 0,
after the batch it is exporting, if any (bounded by the exporter's own timeout,
``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s by default). It ignores SIGINT and SIGTERM, so a
Ctrl-C or a stop signal sent to the whole process group does not cut the server's final
flush short.

Failures: a child that dies, answers out of turn or takes longer than
:data:`ANSWER_BOUND_S` for one batch is killed (SIGKILL) and reaped, and the batch counts
as failed; the next batch after :data:`RESTART_INTERVAL_S` starts a new child (never while
closing), the batches in between fail at once. One warning line per lost child, so at most
one per interval. A child that cannot start at all when the tracer opens fails the
server's start (:class:`ExportStartError`, turned into a one-line config error).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgspec

from genrm_trio.errors import ExportStartError

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

logger = logging.getLogger(__name__)

#: The child's module (``python -m ...``): what ``ps`` shows beside the server.
MODULE = "genrm_trio.server.trace_export"
#: How long the child may take to start (import the SDK, build the exporter) and say so.
STARTUP_BOUND_S = 15.0
#: How long one batch may take in the child, at most: above the exporter's own timeout
#: (10 s by default, retries included), so only a hung child meets it.
ANSWER_BOUND_S = 60.0
#: A lost child is replaced by the next batch this long after the last start, not sooner.
RESTART_INTERVAL_S = 30.0
#: How long closing waits for the child when no deadline was given.
CLOSE_BOUND_S = 2.0
#: Frames larger than this are refused (a batch of 512 spans is well under 10 MiB).
MAX_FRAME_BYTES = 64 * 2**20
#: The server asks for a pipe this large towards the child (Linux), so a batch is one write.
PIPE_BYTES = 2**20
_HEADER = struct.Struct(">I")
_EXITED = "exited"
_LATE = "late"
#: The OTLP/HTTP exporter's logger: one line per failed export (and per retry), dropped here.
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",)


# --------------------------------------------------------------------------- the frames


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The server's first frame: what the child's exporter and spans need from it."""

    endpoint: str | None
    """``tracing.otlp_endpoint`` (None: the ``OTEL_EXPORTER_OTLP_*`` variables decide)."""
    resource_attributes: dict[str, Any]
    resource_schema_url: str
    scope_name: str
    scope_version: str | None
    log_level: str
    log_format: str


class Answer(msgspec.Struct, frozen=True, array_like=True):
    """The child's answer to the hello (``spans`` 0; ``detail`` says why it cannot start)
    and to each batch (``ok``: the exporter's success; ``spans``: the batch's count)."""

    ok: bool
    spans: int
    detail: str = ""


class EventRow(msgspec.Struct, frozen=True, array_like=True):
    name: str
    time_ns: int
    attributes: dict[str, Any] | None


class LinkRow(msgspec.Struct, frozen=True, array_like=True):
    trace_id_high: int
    trace_id_low: int
    span_id: int
    trace_flags: int
    is_remote: bool
    attributes: dict[str, Any] | None


class SpanRow(msgspec.Struct, frozen=True, array_like=True):
    """One finished span as the server sends it (server/tracing.py builds it as a tuple of
    these fields, in this order)."""

    name: str
    trace_id_high: int
    trace_id_low: int
    span_id: int
    trace_flags: int
    trace_state: str
    """The W3C ``tracestate`` header value ("" for none)."""
    parent_span_id: int | None
    parent_is_remote: bool
    kind: int
    """``SpanKind``'s value: 0 internal, 1 server, 2 client."""
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[EventRow]
    links: list[LinkRow]
    status_code: int
    """``StatusCode``'s value: 0 unset, 2 error."""
    status_description: str | None


def _frame_into(encoder: msgspec.msgpack.Encoder, buffer: bytearray, message: Any) -> None:
    """``message`` encoded into ``buffer`` behind its length."""
    encoder.encode_into(message, buffer, _HEADER.size)
    _HEADER.pack_into(buffer, 0, len(buffer) - _HEADER.size)


# --------------------------------------------------------------------------- the server's end


def child_command() -> list[str]:
    """The child's command line: this interpreter, this module."""
    return [sys.executable, "-m", MODULE]


def _child_env() -> dict[str, str]:
    """The server's environment (the ``OTEL_*`` variables included), with this package's
    folder first on ``PYTHONPATH``: the child runs the very code the server runs."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class ExportProcess:
    """The server's end of the span export process: starts the child, sends it batches and
    reads its answers, replaces a lost child (at most once per ``restart_interval_s``), and
    closes it within a deadline. Owned by the tracer.

    Called from the batch processor's export thread (:meth:`export`) and from the thread
    that closes the tracer (:meth:`begin_close`, :meth:`close`); a lock serialises them.
    Every wait is a ``poll`` (the GIL released) bounded by ``answer_bound_s`` per batch and
    by the close deadline once :meth:`begin_close` has set one (it wakes a wait already
    under way). Nothing here raises into the caller but :meth:`start`.
    """

    def __init__(self, hello: Hello, *, command: Sequence[str] | None = None,
                 startup_bound_s: float = STARTUP_BOUND_S,
                 answer_bound_s: float = ANSWER_BOUND_S,
                 restart_interval_s: float = RESTART_INTERVAL_S) -> None:
        self._hello = hello
        self._command = list(command) if command is not None else child_command()
        self._startup_bound_s = startup_bound_s
        self._answer_bound_s = answer_bound_s
        self._restart_interval_s = restart_interval_s
        self._encoder = msgspec.msgpack.Encoder()
        self._answers = msgspec.msgpack.Decoder(Answer)
        self._frame = bytearray()
        self._received = bytearray()
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._started_at = -float("inf")
        self._closing_at: float | None = None
        self._closed = False
        # begin_close's way into a wait already under way: one byte on this pipe.
        self._wake_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def pid(self) -> int | None:
        """The running child's pid (None: none running)."""
        child = self._child
        return None if child is None else child.pid

    def start(self) -> None:
        """Start the first child and wait (at most ``startup_bound_s``) until it is ready.
        Blocks. Raises :class:`ExportStartError` (the child reaped) if it cannot."""
        with self._lock:
            self._start()

    def export(self, rows: Sequence[Sequence[Any]]) -> bool:
        """Send one batch of span rows and wait for the child's answer: True if it exported
        them. False (never an exception) if the exporter failed, the child is gone (it is
        then reaped, and replaced by a later batch), late, or closing has begun. Blocks."""
        with self._lock:
            if self._closed:
                return False
            if self._child is None and not self._restart():
                return False
            child = self._child
            assert child is not None and child.stdin is not None and child.stdout is not None
            deadline = time.monotonic() + self._answer_bound_s
            _frame_into(self._encoder, self._frame, rows)
            problem = self._send(child.stdin.fileno(), self._frame, deadline)
            answer = None
            if problem is None:
                answer, problem = self._receive(child.stdout.fileno(), deadline)
            if answer is not None and answer.spans != len(rows):
                problem = f"answered {answer.spans} spans for a batch of {len(rows)}"
            if problem is not None:
                self._lose(f"did not answer within {self._answer_bound_s:g} s"
                           if problem == _LATE else problem)
                return False
            assert answer is not None
            return answer.ok

    def begin_close(self, deadline: float) -> None:
        """From now on every wait ends at ``deadline`` (``time.monotonic()`` seconds) at the
        latest, one under way included, and no child is started any more. Never blocks."""
        with self._wake_lock:
            if self._closing_at is None or deadline < self._closing_at:
                self._closing_at = deadline
            if not self._closed:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:  # a wake-up is pending already
                    pass

    def close(self, deadline: float | None = None) -> None:
        """Close the child's stdin and wait for it to exit, until ``deadline`` (else the one
        :meth:`begin_close` set, else :data:`CLOSE_BOUND_S` from now); SIGKILL it if it is
        late; reap it. Idempotent. Blocks until then (a batch under way ends by it too)."""
        if deadline is None:
            deadline = self._closing_at
        self.begin_close(time.monotonic() + CLOSE_BOUND_S if deadline is None else deadline)
        with self._lock:
            if self._closed:
                return
            child = self._child
            if child is not None:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.close()
                if not self._wait_for_eof(child.stdout.fileno()):
                    logger.warning("tracing: the span export process did not finish within "
                                   "the flush bound: killed; what it was exporting is lost")
                self._reap(child)
            with self._wake_lock:
                self._closed = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    # The rest runs under self._lock.

    def _start(self) -> None:
        self._started_at = time.monotonic()
        try:
            child = subprocess.Popen(self._command, bufsize=0, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=_child_env(), close_fds=True)
        except OSError as exc:
            raise ExportStartError(f"cannot run {self._command[0]}: "
                                   f"{exc.strerror or exc}") from exc
        assert child.stdin is not None and child.stdout is not None
        _grow_pipe(child.stdin.fileno())
        os.set_blocking(child.stdin.fileno(), False)
        os.set_blocking(child.stdout.fileno(), False)
        self._received.clear()
        deadline = time.monotonic() + self._startup_bound_s
        _frame_into(self._encoder, self._frame, self._hello)
        problem = self._send(child.stdin.fileno(), self._frame, deadline)
        answer = None
        if problem is None:
            answer, problem = self._receive(child.stdout.fileno(), deadline)
        if answer is not None and not answer.ok:
            problem = answer.detail or "not ready"
        if problem is not None:
            self._reap(child)
            if problem == _EXITED:
                problem = f"exited with code {child.returncode} before it was ready"
            elif problem == _LATE:
                problem = f"was not ready within {self._startup_bound_s:g} s"
            raise ExportStartError(problem)
        self._child = child

    def _restart(self) -> bool:
        """A new child, if closing has not begun and the interval since the last start has
        passed; one warning line if it cannot start."""
        if self._closing_at is not None:
            return False
        if time.monotonic() - self._started_at < self._restart_interval_s:
            return False
        try:
            self._start()
        except ExportStartError as exc:
            logger.warning("tracing: the span export process did not restart: %s; the next "
                           "batch after %g s tries again", exc, self._restart_interval_s)
            return False
        logger.info("tracing: span export process restarted (pid %d)", self.pid)
        return True

    def _lose(self, problem: str) -> None:
        """The child failed a batch: kill and reap it, and say so once."""
        child = self._child
        assert child is not None
        self._reap(child)
        if self._closing_at is not None and time.monotonic() >= self._closing_at:
            logger.warning("tracing: the span export process did not finish within the flush "
                           "bound: killed; the spans still queued are counted as failed")
            return
        logger.warning(
            "tracing: the span export process (pid %d) %s; its spans are counted as failed "
            "exports, and a new one starts with a batch at least %g s after the last start",
            child.pid, problem, self._restart_interval_s)

    def _reap(self, child: subprocess.Popen[bytes]) -> None:
        if child.poll() is None:
            child.kill()  # SIGKILL: its batch is counted as failed either way
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
        if child is self._child:
            self._child = None

    def _wait(self, fd: int, events: int, deadline: float) -> bool:
        """Until ``fd`` is ready for ``events`` (or hung up): False at ``deadline`` or at
        the close deadline, whichever comes first."""
        poller = select.poll()
        poller.register(fd, events)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            until = deadline if self._closing_at is None else min(deadline, self._closing_at)
            left_s = until - time.monotonic()
            if left_s <= 0:
                return False
            ready = poller.poll(max(1, int(left_s * 1000 + 1)))
            if any(found == self._wake_r for found, _ in ready):
                try:  # begin_close: drained, then the new deadline applies
                    while os.read(self._wake_r, 64):
                        pass
                except BlockingIOError:
                    pass
            if any(found == fd for found, _ in ready):
                return True

    def _send(self, fd: int, data: bytearray, deadline: float) -> str | None:
        """Write all of ``data``; None, or what went wrong."""
        view = memoryview(data)
        try:
            while view:
                if not self._wait(fd, select.POLLOUT, deadline):
                    return _LATE
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    continue
        except OSError as exc:  # EPIPE: it is gone
            return _EXITED if exc.errno == errno.EPIPE else f"cannot be written to: {exc}"
        finally:
            view.release()
        return None

    def _receive(self, fd: int, deadline: float) -> tuple[Answer | None, str | None]:
        """Read one answer frame: (the answer, None) or (None, what went wrong)."""
        buffer = self._received
        while True:
            if len(buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer)
                if size > 1024:
                    return None, "answered a frame that is not an answer"
                if len(buffer) >= _HEADER.size + size:
                    payload = bytes(buffer[_HEADER.size:_HEADER.size + size])
                    del buffer[:_HEADER.size + size]
                    try:
                        return self._answers.decode(payload), None
                    except msgspec.DecodeError:
                        return None, "answered a frame that is not an answer"
            if not self._wait(fd, select.POLLIN, deadline):
                return None, _LATE
            try:
                data = os.read(fd, 4096)
            except BlockingIOError:
                continue
            except OSError as exc:
                return None, f"cannot be read from: {exc}"
            if not data:
                return None, _EXITED
            buffer += data

    def _wait_for_eof(self, fd: int) -> bool:
        """Until the child closes its stdout (it exits): False at the close deadline."""
        assert self._closing_at is not None
        while self._wait(fd, select.POLLIN, self._closing_at):
            try:
                if not os.read(fd, 4096):
                    return True
            except BlockingIOError:
                continue
        return False


def _grow_pipe(fd: int) -> None:
    """Ask for a :data:`PIPE_BYTES` pipe (Linux; elsewhere, or when refused, the default)."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        try:
            fcntl.fcntl(fd, set_size, PIPE_BYTES)
        except OSError:
            pass


# --------------------------------------------------------------------------- the child


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _read_frame(stream: IO[bytes]) -> bytes | None:
    """One frame's payload; None at EOF (a frame cut short by EOF is EOF too)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
    payload = stream.read(size)
    return payload if len(payload) == size else None


class _Rebuilder:
    """Span rows into the SDK's ``ReadableSpan`` objects, with the server's resource."""

    def __init__(self, hello: Hello) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import (
            Link,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            TraceState,
        )

        self._resource = _hashed_resource(Resource(hello.resource_attributes,
                                                   hello.resource_schema_url))
        self._scope: InstrumentationScope = InstrumentationScope(hello.scope_name,
                                                                 hello.scope_version)
        self._readable = ReadableSpan
        self._event = Event
        self._link = Link
        self._context = SpanContext
        self._flags = TraceFlags
        self._state = TraceState
        self._kinds = {kind.value: kind for kind in SpanKind}
        self._unset = Status(StatusCode.UNSET)
        self._error = partial(Status, StatusCode.ERROR)

    def span(self, row: SpanRow) -> ReadableSpan:
        trace_id = row.trace_id_high << 64 | row.trace_id_low
        state = self._state.from_header([row.trace_state]) if row.trace_state else None
        context = self._context(trace_id, row.span_id, is_remote=False,
                                trace_flags=self._flags(row.trace_flags), trace_state=state)
        parent = None
        if row.parent_span_id is not None:
            parent = self._context(trace_id, row.parent_span_id, is_remote=row.parent_is_remote)
        events = [self._event(e.name, e.attributes, e.time_ns) for e in row.events]
        links = [self._link(self._context(link.trace_id_high << 64 | link.trace_id_low,
                                          link.span_id, is_remote=link.is_remote,
                                          trace_flags=self._flags(link.trace_flags)),
                            link.attributes) for link in row.links]
        status = self._unset if row.status_code == 0 else self._error(row.status_description)
        return self._readable(
            name=row.name, context=context, parent=parent, resource=self._resource,
            attributes=row.attributes, events=events, links=links,
            kind=self._kinds[row.kind], status=status, start_time=row.start_ns,
            end_time=row.end_ns, instrumentation_scope=self._scope)


def _hashed_resource(resource: Resource) -> Resource:
    """``resource`` with its hash computed once: the OTLP encoder groups spans by resource,
    hashing it once per span (a JSON dump of its attributes each time)."""
    from opentelemetry.sdk.resources import Resource

    class HashedResource(Resource):
        def __init__(self, attributes: Any, schema_url: str | None) -> None:
            super().__init__(attributes, schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    return HashedResource(resource.attributes, resource.schema_url)


def main() -> int:
    """The child: answer the hello, then export every batch and answer it, until stdin's
    EOF; then shut the exporter down. Exit 0, or 1 when it cannot start (the hello's answer
    says why) or a frame cannot be read (one log line)."""
    # Its lifetime is its stdin: signals meant for the server's process group are not its.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.dup(1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the frames
    stdin = sys.stdin.buffer
    encoder = msgspec.msgpack.Encoder()
    frame = bytearray()

    def answer(message: Answer) -> bool:
        _frame_into(encoder, frame, message)
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(out, view):]
        except BrokenPipeError:  # the server is gone: its stdin's EOF follows
            return False
        return True

    try:
        payload = _read_frame(stdin)
        if payload is None:
            return 0
        hello = msgspec.msgpack.decode(payload, type=Hello)
    except (ValueError, msgspec.DecodeError) as exc:
        answer(Answer(False, 0, f"bad hello: {exc}"[:500]))
        return 1
    from genrm_trio.logs import setup_logging

    setup_logging(hello.log_level, hello.log_format)
    drop = _DropRecords()
    for name in _EXPORTER_LOGGERS:
        logging.getLogger(name).addFilter(drop)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import SpanExportResult

        rebuild = _Rebuilder(hello)
        exporter = OTLPSpanExporter(endpoint=hello.endpoint)
    except Exception as exc:  # the start's answer says why, in one line
        answer(Answer(False, 0, f"{type(exc).__name__}: {exc}"[:500]))
        return 1
    rows = msgspec.msgpack.Decoder(list[SpanRow])
    code = 0
    if answer(Answer(True, 0)):
        while True:
            try:
                payload = _read_frame(stdin)
                if payload is None:
                    break
                batch = rows.decode(payload)
            except (ValueError, msgspec.DecodeError) as exc:
                logger.error("tracing: the span export process cannot read its batch: %s", exc)
                code = 1
                break
            try:
                ok = exporter.export([rebuild.span(row) for row in batch]) \
                    is SpanExportResult.SUCCESS
            except Exception:  # the exporter's (or a row's) fault: the batch failed
                ok = False
            if not answer(Answer(ok, len(batch))):
                break
    exporter.shutdown()  # type: ignore[no-untyped-call]
    return code


__all__ = [
    "ANSWER_BOUND_S",
    "MODULE",
    "RESTART_INTERVAL_S",
    "STARTUP_BOUND_S",
    "Answer",
    "EventRow",
    "ExportProcess",
    "Hello",
    "LinkRow",
    "SpanRow",
    "child_command",
    "main",
]


if __name__ == "__main__":
    sys.exit(main())
