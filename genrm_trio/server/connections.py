"""Hypercorn's trio server with leaner connections: what a waiting request costs (issue 21).

The one module that knows Hypercorn's trio internals (serve.py configures Hypercorn and calls
:func:`serve`; server/shutdown.py knows a single fact about it). Written against Hypercorn
0.18: on any other version :func:`serve` is Hypercorn's own ``hypercorn.trio.serve``.

With thousands of ``/verify`` requests waiting for their cohorts, what each open connection
holds is most of the server's memory. Three parts of Hypercorn's trio connection
(``hypercorn.trio.tcp_server.TCPServer``) hold more than serving needs while a connection
waits, and :class:`LeanTCPServer` changes only these:

- its read loop keeps the last chunk it received referenced while it waits for the next one:
  for a waiting member that is its whole request, headers and body;
- each read waits inside a fresh ``trio.fail_after`` (a generator and a context manager on
  top of the cancel scope) and inside ``SocketStream.receive_some`` (two context-managed
  helpers, five coroutine frames). Here each read waits for the socket to be readable in a
  plain cancel scope with the same deadline, then reads (``receive_some`` returns at once);
- its keep-alive timer is a task, stopped when a request starts and started again when it
  ends (``TrioSingleTask``: a lock, a cancelled task and a new one through ``nursery.start``,
  about 100 us a request, a sixth of a K=1 cohort's time over its judge call: issue 27). Here
  the timer is the deadline of the read loop's wait while the connection is idle, moved by
  the same ``Updated`` events; shutdown (``context.terminated``) closes idle connections at
  once, as Hypercorn's timer does;
- each request's ASGI ``receive`` is a trio memory channel (a deque with its first block, two
  ordered dicts, two channel objects), and the app runs below an extra wrapper frame. Here the
  channel is :class:`AppQueue` (a list and at most one waiting receiver: an HTTP request has
  one), and the ASGI app is called directly.

Measured in the bench's release preset's shape (10,000 members waiting on their own
connections): about 7 KB less per connection, RSS 318 -> 245 MB.

Everything else is Hypercorn's own code, called as Hypercorn calls it: HTTP/1.1 and h2c through
its protocol classes, ASGI semantics, keep-alive and its idle timeout, the read timeout
(``read_timeout``: a read that waits longer ends the connection), lifespan, graceful shutdown
(:func:`serve` runs them in the order Hypercorn's own ``serve`` does). A config with TLS or
QUIC binds is served by Hypercorn's own ``serve``: the lean read loop reads a plain socket.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from importlib.metadata import version
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIReceiveEvent, ASGISendEvent, ConnectionState
from hypercorn.utils import parse_socket_addr, repr_socket_addr

logger = logging.getLogger(__name__)

#: The Hypercorn releases whose internals this module follows.
SUPPORTED_HYPERCORN = ("0.18.",)

def lean_connections_supported() -> bool:
    """Whether the installed Hypercorn is one :class:`LeanTCPServer` was written against."""
    return version("hypercorn").startswith(SUPPORTED_HYPERCORN)


COMBINED_WRITE_BYTES = 65536
"""What Hypercorn writes for one of the app's messages up to this size is held and written in
one write (:meth:`LeanTCPServer.app_send`); a larger body is written by itself, never
copied."""

APP_QUEUE_BODY_BYTES = 65536
"""Body bytes a request's :class:`AppQueue` takes before :meth:`AppQueue.put` waits for the app
to read them: one read's worth (Hypercorn reads at most ``MAX_RECV``, 64 KiB, at a time).
Hypercorn's own queue bounds messages only (``max_app_queue_size``, 10 of up to 64 KiB each),
so a body the app does not read yet (a large ``/verify`` body waiting for room in
``max_active_bytes``) held up to 640 KiB in this process per connection, counted nowhere: 100
of them, 64 MB (the bench's ``slow_readers`` preset)."""


class AppQueue:
    """A request's ASGI messages, from Hypercorn's protocol (:meth:`put`) to the app
    (:meth:`get`): what ``trio.open_memory_channel(max_size)`` is in Hypercorn, with the same
    order and cancellation points but a schedule point only where a call waits (a channel's
    cost two task steps a message, three messages a request: issue 27), for one receiver at
    a time (the app task's, or the one task
    the app hands ``receive`` to; a second concurrent :meth:`get` raises
    ``trio.BusyResourceError``). :meth:`put` blocks while ``max_size`` messages, or
    ``max_body_bytes`` of body (:data:`APP_QUEUE_BODY_BYTES`) or more, are unread; a message
    of any size goes in once less than that is: the bound delays the connection's reader,
    it never stops a request."""

    __slots__ = ("_messages", "_max_size", "_max_body_bytes", "_body_bytes", "_receiver",
                 "_room")

    def __init__(self, max_size: int, max_body_bytes: int = APP_QUEUE_BODY_BYTES) -> None:
        self._messages: list[ASGIReceiveEvent] = []
        self._max_size = max_size
        self._max_body_bytes = max_body_bytes
        self._body_bytes = 0
        self._receiver: trio.lowlevel.Task | None = None
        self._room: trio.Event | None = None  # set when a message is taken off a full queue

    async def put(self, message: ASGIReceiveEvent) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        while (len(self._messages) >= self._max_size
               or self._body_bytes >= self._max_body_bytes):
            if self._room is None:
                self._room = trio.Event()
            await self._room.wait()
        self._messages.append(message)
        self._body_bytes += len(message.get("body", b""))  # type: ignore[arg-type]
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            trio.lowlevel.reschedule(receiver)

    async def get(self) -> ASGIReceiveEvent:
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._messages:
            if self._receiver is not None:
                raise trio.BusyResourceError("another task is already receiving this request")
            self._receiver = trio.lowlevel.current_task()

            def abort(_: Any) -> trio.lowlevel.Abort:
                self._receiver = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        message = self._messages.pop(0)
        self._body_bytes -= len(message.get("body", b""))  # type: ignore[arg-type]
        if self._room is not None:
            self._room.set()
            self._room = None
        return message


async def _run_app(app: Any, config: HypercornConfig, scope: Any,
                   receive: Callable[[], Awaitable[ASGIReceiveEvent]],
                   send: Callable[[ASGISendEvent | None], Awaitable[None]]) -> None:
    """One request's ASGI app, run in the connection's task group. Cancellation goes through;
    an error the app raises is logged as Hypercorn logs it ("Error in ASGI Framework") and the
    request is ended either way (``send(None)`` tells the protocol the app is done)."""
    try:
        await app(scope, receive, send)
    except trio.Cancelled:
        raise
    except BaseExceptionGroup as group:
        if group.split(trio.Cancelled)[1] is None:
            raise  # nothing but cancellation inside
        await config.log.exception("Error in ASGI Framework")
    except Exception:
        await config.log.exception("Error in ASGI Framework")
    finally:
        await send(None)


class _LeanTaskGroup(TaskGroup):
    """The connection's task group: the app's messages go through an :class:`AppQueue`, and
    its sends through the connection's :meth:`LeanTCPServer.app_send`."""

    def __init__(self, server: LeanTCPServer) -> None:
        super().__init__()
        self._server = server

    async def spawn_app(self, app: Any, config: HypercornConfig, scope: Any,
                        send: Callable[[ASGISendEvent | None], Awaitable[None]],
                        ) -> Callable[[ASGIReceiveEvent], Awaitable[None]]:
        queue = AppQueue(config.max_app_queue_size)
        assert self._nursery is not None
        self._nursery.start_soon(_run_app, app, config, scope, queue.get,
                                 partial(self._server.app_send, send))
        return queue.put


class LeanTCPServer(TCPServer):
    """One plain-TCP connection: ``TCPServer`` with a read loop that holds nothing between
    reads, a :class:`_LeanTaskGroup`, a send that ends the connection when it makes no
    progress for ``send_timeout_s`` (``on_send_timeout`` is told), and a close as soon as
    the peer's is read; ``app`` is the ASGI app itself (no wrapper)."""

    def __init__(self, app: Any, config: HypercornConfig, context: WorkerContext,
                 state: Any, stream: Any, *, send_timeout_s: float = math.inf,
                 on_send_timeout: Callable[[], None] | None = None,
                 open_set: set[LeanTCPServer] | None = None) -> None:
        super().__init__(app, config, context, state, stream)
        self._open_set = open_set  # serve's connections, told when shutdown begins
        self._send_timeout_s = send_timeout_s
        self._on_send_timeout = on_send_timeout
        # The keep-alive timer: when the idle connection closes (inf while a request is in
        # progress), and the read loop's wait, whose deadline it shortens.
        self._idle_until = math.inf
        self._read_until = math.inf
        self._reading: trio.CancelScope | None = None
        # What Hypercorn wrote while the app's send runs, held to be written at once.
        self._app_sending = False
        self._held: list[bytes] = []

    def _set_idle(self, idle: bool) -> None:
        """Hypercorn's ``Updated`` event: idle (between requests) for ``keep_alive_timeout``
        at most, and not at all once the server is shutting down; busy, no limit."""
        if not idle:
            self._idle_until = math.inf
        elif self.context.terminated.is_set():
            self._idle_until = -math.inf
        else:
            self._idle_until = trio.current_time() + self.config.keep_alive_timeout
        if self._reading is not None:
            self._reading.deadline = min(self._read_until, self._idle_until)

    def shutting_down(self) -> None:
        """The server stopped accepting (``context.terminated`` is set): an idle connection
        closes now, a busy one once its request is answered."""
        if self._idle_until != math.inf:
            self._set_idle(True)

    async def protocol_send(self, event: Event) -> None:
        # TCPServer.protocol_send, with the bytes written by _send_within (a deadline on
        # progress) instead of an unbounded shielded send_all. Still shielded: quart-trio
        # cancels a request as soon as Hypercorn reports its stream done, mid-write.
        if isinstance(event, RawData):
            data = event.data
            if self._app_sending and len(data) <= COMBINED_WRITE_BYTES:
                self._held.append(data)  # written when the app's send returns (app_send)
                return
            if self._held:  # a large body: the head first, then the body as it is (no copy)
                await self._write(self._take_held())
            await self._write(data)
            return
        if self._held:  # what the app sent goes out before anything that follows it
            await self._write(self._take_held())
        if isinstance(event, Updated):
            self._set_idle(event.idle)
            return
        await super().protocol_send(event)

    async def app_send(self, send: Callable[[ASGISendEvent | None], Awaitable[None]],
                       message: ASGISendEvent | None) -> None:
        """The app's ``send`` on an HTTP/1.1 connection: the bytes Hypercorn makes of one ASGI
        message are written in one write when it is handled, a response's start with its first
        body message (Hypercorn writes a response's head, each body chunk and the end, an empty
        one, each by itself: three writes, where the client reads one answer; the head alone
        waits for the next message, which ASGI requires to follow). HTTP/2 is left as it is:
        its streams send at once, one connection's bytes in the order the h2 library made
        them."""
        if self._app_sending or not isinstance(self.protocol.protocol, H11Protocol):
            await send(message)
            return
        self._app_sending = True
        try:
            await send(message)
        finally:
            self._app_sending = False
        if self._held and (message is None or message["type"] != "http.response.start"):
            await self._write(self._take_held())

    def _take_held(self) -> bytes:
        held, self._held = self._held, []
        return b"".join(held)

    async def _write(self, data: bytes) -> None:
        if not data:  # Hypercorn's end of a body of known length: nothing to write
            return
        lock = self.send_lock
        if lock.locked():
            await lock.acquire()
        else:  # no other send: no schedule point for the lock (one less task step an answer)
            lock.acquire_nowait()
        try:
            with trio.CancelScope(shield=True):
                outcome = await self._send_within(data)
            if outcome == "stalled":
                if self._on_send_timeout is not None:
                    self._on_send_timeout()
                _reset_on_close(self.stream.socket)
                await self.stream.aclose()
            if outcome != "sent":
                await self.protocol.handle(Closed())
        finally:
            lock.release()

    async def _send_within(self, data: bytes) -> str:
        """Write ``data`` to the socket: ``"sent"``; ``"broken"`` when the connection is gone
        (reset, closed meanwhile, its sending side shut down); ``"stalled"`` when a wait for
        the socket to take more made no progress for ``send_timeout_s``. What trio's
        ``SocketStream.send_all`` does, with that deadline moved on by every byte taken."""
        sock = self.stream.socket
        timeout_s = self._send_timeout_s
        try:
            # First at once, as trio's send would (most answers fit the socket's buffer): no
            # deadline scope and no schedule point unless the socket is full.
            try:
                offset = os.write(sock.fileno(), data)
            except BlockingIOError:
                offset = 0
            if offset == len(data):
                return "sent"
            with memoryview(data) as view:
                total = len(view)
                with trio.CancelScope(deadline=trio.current_time() + timeout_s) as waiting:
                    while offset < total:
                        with view[offset:] as rest:
                            offset += await sock.send(rest)
                        waiting.deadline = trio.current_time() + timeout_s
                if offset < total:  # the deadline passed with nothing taken
                    return "stalled"
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
            return "broken"
        return "sent"

    async def run(self) -> None:
        # TCPServer.run, without the TLS handshake (plain sockets only) and with our group.
        socket = self.stream.socket
        if self._open_set is not None:
            self._open_set.add(self)
        try:
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())

            async with _LeanTaskGroup(self) as task_group:
                self._task_group = task_group
                self.protocol = ProtocolWrapper(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState(self.state),
                    False,
                    client,
                    server,
                    self.protocol_send,
                    "http/1.1",
                )
                await self.protocol.initiate()
                self._set_idle(True)
                await self._read_data()
                # The peer closed (or the read failed or timed out): nothing more can come.
                # No timer task is left (Hypercorn's kept an idle connection whose client
                # closed in CLOSE-WAIT for the whole keep_alive_timeout): the group ends as
                # soon as the request in progress (if any) has ended, and the socket closes.
        except OSError:
            pass
        finally:
            if self._open_set is not None:
                self._open_set.discard(self)
            await self._close()
            # The connection's objects refer to each other (its protocol holds our
            # protocol_send, its task group our idle timeout): dropping our side lets
            # reference counting free them now instead of a full collection later.
            self.__dict__.pop("protocol", None)
            self.__dict__.pop("_task_group", None)

    async def _read_data(self) -> None:
        timeout = self.config.read_timeout or math.inf
        stream = self.stream
        while True:
            if stream.socket.fileno() == -1:  # closed meanwhile (its answer said close)
                break
            self._read_until = trio.current_time() + timeout
            with trio.CancelScope(deadline=min(self._read_until, self._idle_until)) as reading:
                self._reading = reading
                try:
                    await trio.lowlevel.wait_readable(stream.socket)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                finally:
                    self._reading = None
            if reading.cancelled_caught:
                if trio.current_time() >= self._idle_until:  # keep-alive ran out, or shutdown
                    with trio.CancelScope(shield=True):
                        await self._initiate_server_close()
                break  # else read_timeout: Hypercorn's TooSlowError
            # Readable: read at once (``receive_some`` would add a schedule point, a task step
            # for every read of every request, for nothing: the socket has data or is closed).
            try:
                data = os.read(stream.socket.fileno(), MAX_RECV)
            except BlockingIOError:  # nothing after all (a spurious wake-up): wait again
                continue
            except OSError:  # reset, or closed meanwhile
                break
            end = data == b""
            await self.protocol.handle(RawData(bytes(data)))  # bytes: the same object
            del data  # not held while the next read waits
            if end:
                break
        await self.protocol.handle(Closed())


def _reset_on_close(sock: trio.socket.SocketType) -> None:
    """Make closing ``sock`` reset the connection (``SO_LINGER`` 0): what it still holds
    unsent is dropped at once, not kept by the kernel for a peer that does not read."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # closed meanwhile


async def serve(app: Any, config: HypercornConfig, *,
                shutdown_trigger: Callable[..., Awaitable[None]] | None = None,
                send_timeout_s: float = math.inf,
                on_send_timeout: Callable[[], None] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` (ASGI) as ``hypercorn.trio.serve(app, config, ...)`` does, each plain-TCP
    connection by a :class:`LeanTCPServer`: the ASGI lifespan runs around it (startup before the
    first accept, shutdown after the last connection); the bound URLs are reported through
    ``task_status``; once ``shutdown_trigger`` returns, accepting stops and open connections get
    ``config.graceful_timeout`` to finish before they are cancelled. A connection whose send
    makes no progress for ``send_timeout_s`` is reset (``on_send_timeout`` is called, in the
    connection's task). Configurations this module does not cover (another Hypercorn, TLS,
    QUIC, several workers, ``max_requests``) are served by Hypercorn's own ``serve``, which has
    neither the send timeout nor the prompt close (logged once at start)."""
    if (not lean_connections_supported() or config.ssl_enabled or config.quic_bind
            or config.workers != 1 or config.max_requests is not None):
        logger.warning(
            "served by Hypercorn %s's own serve (not the lean connections): no send timeout, "
            "and a connection its client closed stays open until keep_alive_timeout",
            version("hypercorn"))
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger,
                              task_status=task_status, mode="asgi")
        return
    from hypercorn.app_wrappers import ASGIWrapper  # what Hypercorn's lifespan expects

    config.set_statsd_logger_class(StatsdLogger)
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(ASGIWrapper(app), config, lifespan_state)
    context = WorkerContext(None)
    sockets = config.create_sockets()
    listeners = []
    urls = []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        urls.append("http://" + repr_socket_addr(sock.family, sock.getsockname()))
    open_set: set[LeanTCPServer] = set()
    connection = partial(LeanTCPServer, app, config, context,
                         ConnectionState(lifespan_state.copy()), send_timeout_s=send_timeout_s,
                         on_send_timeout=on_send_timeout, open_set=open_set)

    async with trio.open_nursery() as outer:  # the lifespan task lives here
        await outer.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as open_connections:
            for url in urls:
                await config.log.info(f"Running on {url} (CTRL + C to quit)")
            async with trio.open_nursery() as accepting:
                accepting.start_soon(partial(trio.serve_listeners, connection, listeners,
                                             handler_nursery=open_connections))
                task_status.started(urls)
                if shutdown_trigger is None:
                    await trio.sleep_forever()
                await shutdown_trigger()
                accepting.cancel_scope.cancel()  # no new connections from here on
            await context.terminated.set()  # tells keep-alive connections to close
            for open_connection in list(open_set):
                open_connection.shutting_down()
            open_connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        outer.cancel_scope.cancel()


__all__ = ["APP_QUEUE_BODY_BYTES", "AppQueue", "LeanTCPServer", "lean_connections_supported",
           "serve"]
