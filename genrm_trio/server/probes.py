"""The probe listener: liveness and readiness on a port of their own (``probe_port``).

Why a port of its own: under a flood of uploads the main port's accept queue holds hundreds of
connections the server has not accepted yet (Hypercorn's backlog is 2048), and a probe that
connects there waits behind all of them, each a body to read and decode: 5 to 7 s with 330
queued (bench/README.md, "flood"). The kernel keeps one accept queue per listening socket, so
the probe listener's connections wait behind nobody.

Why so little code between the socket and the answer: under that flood every pass of the event
loop runs every runnable upload's next step first, so a probe takes as long as the passes it
needs. Hypercorn and Quart would need a dozen (a task per connection, another per request,
channel hops); trio's socket streams yield once after every successful call. Here the
listening socket and the connections are plain non-blocking sockets: when the listening socket
becomes readable, one step of one task accepts every pending connection, reads what each has
sent, and answers every complete request at once. A probe whose request has not arrived yet
gets a task of its own that waits for it (at most :data:`MAX_WAITING_PROBES` at once, each for
at most :data:`PROBE_CONNECTION_S`). So a probe is answered in the first pass after the kernel
has its request.

::

    serve_probes(sock, ready)             in serve's root nursery, cancelled with it
      +-- the accept loop                 wait until readable, then accept and answer every
      |                                   pending connection without yielding
      +-- a task per slow connection      wait for its request (bounded), answer, close

HAProxy's agent check (``agent-check agent-port <probe_port> agent-send "agent\\n"``) is
answered here too: a connection whose first bytes are the line ``agent`` gets one line of
HAProxy's agent protocol (``up``, ``down`` once shutdown has begun, so HAProxy stops sending
before the health check notices; README "Rolling restart") and is closed. It is not HTTP: an
HTTP answer's status line would read to HAProxy as a weight.

Served: ``GET``/``HEAD`` of ``/``, ``/health``, ``/healthz``, ``/livez`` (liveness: 200
``{"status": "ok"}`` while the event loop runs) and ``/readyz`` (200 ``{"status": "ready"}``,
503 ``shutdown`` once shutdown has begun), the bodies of the main port. Any other path is a 404
and another method a 405: the probe port never reaches the app. Every answer closes its
connection. No auth: the probes are exempt on the main port too.

Errors: a request that breaks HTTP gets a 400; a connection that fails, or whose answer does
not fit its socket's send buffer at once (a 200-byte answer on a fresh connection always
does), is closed; neither reaches the accept loop. Running out of file descriptors pauses
accepting (as ``trio.serve_listeners`` does) instead of failing the server; any other accept
error ends :func:`serve_probes` with it.
"""

from __future__ import annotations

import errno
import http
import logging
import socket
from collections.abc import Callable

import h11
import trio

from genrm_trio import wire

logger = logging.getLogger(__name__)

LIVENESS_PATHS = frozenset({"/", "/health", "/healthz", "/livez"})
READINESS_PATH = "/readyz"
#: Connections accepted whose request has not arrived whole; past this, accepting pauses.
MAX_WAITING_PROBES = 64
#: A probe connection must have sent its request within this.
PROBE_CONNECTION_S = 5.0
#: Longest request head (request line and headers) read.
MAX_PROBE_HEAD_BYTES = 8192
PROBE_BACKLOG = 128
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# What accept() may report about one connection that went away before it was accepted.
_GONE_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ECONNRESET})
_CAPACITY_PAUSE_S = 0.1
_NOT_FOUND = ("not found: the probe port serves only GET /, /health, /healthz, /livez and "
              "/readyz")

Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]
#: What HAProxy's ``agent-send`` must send (the shipped configs/haproxy.cfg does).
AGENT_REQUEST = b"agent\n"
AgentLine = Callable[[], bytes]


def probe_answer(method: bytes, target: bytes, ready: bool) -> Answer:
    """The answer to one probe request: status, JSON body, extra headers. Pure."""
    path = target.split(b"?", 1)[0].decode("latin-1")
    encode = wire.JSON_ENCODER.encode
    if path not in LIVENESS_PATHS and path != READINESS_PATH:
        return 404, encode(wire.error_body(_NOT_FOUND, "bad_request")), []
    if method not in (b"GET", b"HEAD"):
        detail = f"method {method.decode('latin-1')[:16]} not allowed on {path}; use GET"
        return 405, encode(wire.error_body(detail, "bad_request")), [(b"allow", b"GET, HEAD")]
    if path in LIVENESS_PATHS:
        return 200, encode({"status": "ok"}), []
    if not ready:
        return 503, encode(wire.error_body("the server is shutting down", "shutdown")), []
    return 200, encode({"status": "ready"}), []


async def open_probe_socket(host: str, port: int) -> socket.socket:
    """Bind and listen on ``host:port`` (0: any free port; the first address ``host``
    resolves to). Raises ``OSError`` when it cannot be bound (in use, no such address). The
    caller owns the socket: :func:`serve_probes` closes it."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                          flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(PROBE_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def bound_url(sock: socket.socket) -> str:
    """``http://host:port`` of the probe socket, with the port the kernel chose."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def serve_probes(sock: socket.socket, ready: Callable[[], bool], *,
                       after: trio.Event | None = None, agent: AgentLine | None = None,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer probes on the listening ``sock`` until cancelled (``serve`` cancels its root
    nursery once Hypercorn has shut down), then close it and every connection. The socket is
    this task's from the call on, closed however it ends; ``nursery.start`` returns at once,
    and accepting begins once ``after`` is set (connections wait in the backlog until then).
    ``ready()`` says whether ``/readyz`` answers 200; it is called in the event loop, once per
    readiness probe. ``agent()`` (None: no agent answers) is the line an agent check gets.
    Raises the ``OSError`` of an accept that failed for another reason than
    capacity or a connection that went away."""
    waiting = trio.Semaphore(MAX_WAITING_PROBES)
    try:
        task_status.started()
        if after is not None:
            await after.wait()
        async with trio.open_nursery() as nursery:
            while True:
                if waiting.value == 0:
                    await waiting.acquire()  # a slow probe must finish first
                    waiting.release()
                await trio.lowlevel.wait_readable(sock)
                paused = _accept_pending(sock, ready, waiting, nursery, agent)
                if paused:
                    logger.error("probe port: accept failed (out of file descriptors or "
                                 "memory): pausing %g s", _CAPACITY_PAUSE_S)
                    await trio.sleep(_CAPACITY_PAUSE_S)
    finally:
        sock.close()


def _accept_pending(sock: socket.socket, ready: Callable[[], bool], waiting: trio.Semaphore,
                    nursery: trio.Nursery, agent: AgentLine | None = None) -> bool:
    """Accept and answer every connection pending on ``sock``, without yielding; a connection
    whose request has not arrived whole goes to a task of its own. Returns True when accept
    ran out of capacity (the caller pauses)."""
    while waiting.value > 0:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in _GONE_ERRNOS:
                continue
            if exc.errno in _CAPACITY_ERRNOS:
                return True
            raise
        conn.setblocking(False)
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_PROBE_HEAD_BYTES)
        if _answer_if_complete(conn, parser, ready, agent):
            conn.close()
        else:
            waiting.acquire_nowait()
            nursery.start_soon(_answer_when_complete, conn, parser, ready, waiting, agent)
    return False


async def _answer_when_complete(conn: socket.socket, parser: h11.Connection,
                                ready: Callable[[], bool], waiting: trio.Semaphore,
                                agent: AgentLine | None = None) -> None:
    """A connection whose request is still to come: its own task and error boundary."""
    try:
        with trio.move_on_after(PROBE_CONNECTION_S):
            while True:
                await trio.lowlevel.wait_readable(conn)
                if _answer_if_complete(conn, parser, ready, agent):
                    break
    finally:
        waiting.release()
        conn.close()


def _answer_if_complete(conn: socket.socket, parser: h11.Connection,
                        ready: Callable[[], bool], agent: AgentLine | None = None) -> bool:
    """Read what ``conn`` has received; once the request head is whole, answer it. True when
    the connection is done with (answered, closed by the client, or failed)."""
    try:
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = conn.recv(MAX_PROBE_HEAD_BYTES)
                except BlockingIOError:
                    return False
                if (agent is not None and data.startswith(AGENT_REQUEST)
                        and parser.their_state is h11.IDLE and not parser.trailing_data[0]):
                    conn.send(agent())  # one short line: fits a fresh socket's buffer
                    return True
                parser.receive_data(data)
                continue
            if not isinstance(event, h11.Request):
                return True  # closed before a whole request head
            status, body, extra = probe_answer(event.method, event.target, ready())
            _send_answer(conn, parser, status, body, extra, head_only=event.method == b"HEAD")
            return True
    except h11.RemoteProtocolError as exc:
        detail = f"bad request: {str(exc)[:200]}"
        body = wire.JSON_ENCODER.encode(wire.error_body(detail, "bad_request"))
        _send_answer(conn, parser, exc.error_status_hint, body, [], head_only=False)
        return True
    except (OSError, h11.LocalProtocolError):
        return True


def _send_answer(conn: socket.socket, parser: h11.Connection, status: int, body: bytes,
                 extra: list[tuple[bytes, bytes]], *, head_only: bool) -> None:
    """Write the whole answer with one non-blocking send; on a short write or a full buffer
    the connection is simply closed (a probe's answer fits a fresh socket's buffer)."""
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close"), *extra]
    try:
        reason = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    out = parser.send(h11.Response(status_code=status, headers=headers, reason=reason)) or b""
    if not head_only:
        out += parser.send(h11.Data(data=body)) or b""
    out += parser.send(h11.EndOfMessage()) or b""
    try:
        conn.send(out)
    except OSError:
        pass  # BlockingIOError included: the client gets a closed connection, not an answer


__all__ = ["AGENT_REQUEST", "LIVENESS_PATHS", "READINESS_PATH", "bound_url", "open_probe_socket",
           "probe_answer", "serve_probes"]
