"""The one deadline of a graceful shutdown, and what enforces it at the socket level.

Shutdown must end within ``shutdown_grace_s`` plus a small constant whatever clients and judges
do. Two things stood in the way:

- every cleanup await that must survive a cancellation (a response send, closing the judge's
  clients) ran under its own ``move_on_after(grace, shield=True)``, each starting a fresh grace
  whenever it began, so the overruns added up;
- Hypercorn writes every response byte under an *unbounded* shield of its own
  (``TCPServer.protocol_send``), so a client that stops reading while a response is pending
  keeps its connection task, and with it the whole process, alive forever: no enclosing
  deadline reaches into that shield.

:class:`ShutdownDeadline` is computed once, when shutdown begins (``begin``), and every scope it
hands out (:meth:`ShutdownDeadline.scope`) follows it, including scopes opened before it was
known. :func:`abort_client_connections` shuts down, at the socket level, every connection
accepted on the server's port: a send blocked inside Hypercorn's shield then fails at once
(``EPIPE``) and its task ends. The server calls it when the deadline passes, after which only
the closing of connections, the judge and the journal remains (:data:`CLEANUP_S`).

This module has no third-party imports; it knows Hypercorn only through the fact above.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import stat
from collections.abc import Iterable
from types import TracebackType

import trio

logger = logging.getLogger(__name__)

#: What the process may spend after the shutdown deadline to close what the deadline tore down
#: (connections, the judge's HTTP clients, the journal). ``genrm-trio serve`` cancels whatever
#: is still running at ``deadline + CLEANUP_S``.
CLEANUP_S = 0.25
#: ``genrm-trio serve`` exits the process at ``deadline + FORCED_EXIT_S`` if it has not ended by
#: then (something ignored its cancellation: a judge plugin that swallows it, a call in a
#: thread). Active cohorts were failed and answered when shutdown began; the journal commits
#: each transaction, so a forced exit loses nothing a ``kill -9`` would not.
FORCED_EXIT_S = 0.6


class ShutdownDeadline:
    """The moment by which a graceful shutdown must be over, shared by everything that waits.

    ``deadline`` is ``inf`` until :meth:`begin` fixes it at ``now + grace_s`` (once; later calls
    change nothing). :meth:`expire_now` brings it forward to now (a second signal). Owned by
    whoever owns the shutdown (``serve_main`` or ``run_server``); synchronous, no tasks.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.deadline = math.inf
        # Every open scope: its own deadline and its offset after the shutdown deadline.
        self._scopes: dict[trio.CancelScope, tuple[float, float]] = {}

    @property
    def begun(self) -> bool:
        return self.deadline != math.inf

    def begin(self) -> None:
        """Start the grace now: the deadline becomes ``now + grace_s``. Idempotent."""
        if not self.begun:
            self._move(trio.current_time() + self.grace_s)

    def expire_now(self) -> None:
        """End the grace now (never moves the deadline later)."""
        self._move(min(self.deadline, trio.current_time()))

    def remaining_s(self) -> float:
        """Seconds left before the deadline (``inf`` before shutdown begins, 0 after it)."""
        return max(0.0, self.deadline - trio.current_time())

    def _move(self, deadline: float) -> None:
        self.deadline = deadline
        for scope, (own, after_s) in self._scopes.items():
            scope.deadline = min(own, deadline + after_s)

    def scope(
        self, *, bound_s: float = math.inf, after_s: float = 0.0, shield: bool = False,
    ) -> _DeadlineScope:
        """A cancel scope that ends at ``now + bound_s`` or at the shutdown deadline plus
        ``after_s``, whichever comes first, following the deadline when shutdown begins (or is
        cut short) while the scope is open. ``shield=True`` protects the body from outer
        cancellation (cleanup that must run in a cancelled task), the deadline still bounding
        it. Like ``move_on_after``: the scope swallows its own cancellation
        (``cancelled_caught``). Use it as a context manager (``with deadline.scope(...) as
        cancel_scope``); it is cheap (every answer the server sends is bounded by one)."""
        return _DeadlineScope(self, trio.current_time() + bound_s, after_s, shield)


class _DeadlineScope:
    """What :meth:`ShutdownDeadline.scope` returns: registers its cancel scope with the
    deadline while open, so a shutdown that begins meanwhile moves its deadline. A plain class
    rather than a generator context manager: one is entered per answer sent."""

    __slots__ = ("_owner", "_own", "_after_s", "_scope")

    def __init__(self, owner: ShutdownDeadline, own: float, after_s: float,
                 shield: bool) -> None:
        self._owner = owner
        self._own = own
        self._after_s = after_s
        self._scope = trio.CancelScope(deadline=min(own, owner.deadline + after_s),
                                       shield=shield)

    def __enter__(self) -> trio.CancelScope:
        self._owner._scopes[self._scope] = (self._own, self._after_s)
        return self._scope.__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        del self._owner._scopes[self._scope]
        return self._scope.__exit__(exc_type, exc, tb)


def _open_fds() -> Iterable[int]:
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            return [int(name) for name in os.listdir(listing)]
        except (OSError, ValueError):
            continue
    return range(3, min(os.sysconf("SC_OPEN_MAX"), 65536))  # pragma: no cover - no fd listing


def abort_client_connections(port: int) -> int:
    """Shut down (both directions) every TCP connection this process accepted on ``port``;
    returns how many. Synchronous and immediate: a task blocked writing to such a connection,
    shielded or not, wakes with a broken-pipe error. The listening socket and connections this
    process opened to other servers (the judge) are left alone."""
    aborted = 0
    for fd in _open_fds():
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            # A duplicate descriptor: closing it leaves the server's own socket open, while
            # shutdown() acts on the connection both descriptors share.
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile, or not a socket Python can wrap
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (
                        socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.getsockname()[1] != port:
                    continue
                sock.getpeername()  # the listener has no peer: OSError(ENOTCONN)
                sock.shutdown(socket.SHUT_RDWR)
                aborted += 1
            except OSError as exc:
                if exc.errno not in (errno.ENOTCONN, errno.EINVAL, errno.EBADF):
                    logger.debug("could not abort connection fd %d: %s", fd, exc)
    return aborted


__all__ = ["CLEANUP_S", "FORCED_EXIT_S", "ShutdownDeadline", "abort_client_connections"]
