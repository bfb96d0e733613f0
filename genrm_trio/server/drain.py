"""Drain: the third way to stop, for a rolling restart behind a proxy (README "Rolling restart").

SIGTERM and Ctrl-C fail every open cohort at once (503 ``shutdown``). A drain instead lets the
cohorts this process holds finish, while the proxy in front sends every new group to another
replica, and then stops the process as SIGTERM would, with nothing left to fail:

1. ``SIGUSR1`` or ``POST /admin/drain`` calls :meth:`DrainMode.request`: the registry refuses a
   member that would open a new cohort with 425 ``draining`` (a status HAProxy retries on the
   next replica: ``retry-on 425``). Members of open cohorts, replays and recorded failures are
   answered as before; readiness stays 200 and the probe port's agent answer stays ``up``: the
   replica must stay on HAProxy's hash ring, because a replica marked down or in DRAIN would
   lose its open groups' later members to the other replicas (HAProxy's stick table learns a
   group's replica only from its first answer, which a collecting cohort has not given yet:
   measured with HAProxy 2.6, README "Rolling restart").
2. :meth:`DrainMode.run`, a task of ``serve``'s root nursery, waits until no cohort is active,
   or for ``drain_timeout_s`` (null: the longest a cohort can stay open), whichever is first,
   then sets the server's stop event: the usual graceful shutdown follows, in which whatever is
   still open ends as with SIGTERM, and the process exits 0.
3. ``POST /admin/ready`` (:meth:`DrainMode.take_back`) before that undoes it; it also ends a
   restarted replica's rejoin window (``rejoin_s``: the registry opens no cohort for that long
   after start, and remembers the groups it refused as open elsewhere).

Owned by ``serve_main`` (which maps SIGUSR1 to it) or ``run_server``; no global state, and the
only task is :meth:`run`, in the caller's nursery.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter
from typing import Any, Protocol

import trio

logger = logging.getLogger(__name__)


class DrainState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"  # the drain is over: the graceful shutdown is under way


class Drainable(Protocol):
    """What a drain needs of the cohort registry."""

    @property
    def shutting_down(self) -> bool: ...

    def begin_drain(self) -> None: ...

    def end_drain(self) -> None: ...

    def end_rejoin(self) -> None: ...

    @property
    def rejoining_s(self) -> float: ...

    @property
    def groups_elsewhere(self) -> int: ...

    counters: Counter[str]

    def snapshot(self) -> dict[str, int]: ...

    def longest_open_deadline_s(self) -> float | None: ...

    async def wait_until_idle(self) -> None: ...


class DrainMode:
    """Whether this process is draining, and the drain's one task (:meth:`run`).

    ``bound_s`` is the drain's longest wait for the cohorts open when it began. A request that
    comes before :meth:`attach` (a signal during start-up) takes effect when the registry is
    attached.
    """

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.state = DrainState.SERVING
        self._registry: Drainable | None = None
        self._began_at = math.nan
        self._requested = trio.Event()
        self._wait_scope: trio.CancelScope | None = None
        self.drains = 0

    def attach(self, registry: Drainable) -> None:
        self._registry = registry
        if self.state is DrainState.DRAINING:
            registry.begin_drain()

    @property
    def draining(self) -> bool:
        return self.state is not DrainState.SERVING

    def request(self) -> bool:
        """Begin draining now (idempotent). False when it cannot: shutdown has begun."""
        registry = self._registry
        if self.state is DrainState.STOPPING or (registry is not None and
                                                 registry.shutting_down):
            return self.state is not DrainState.SERVING
        if self.state is DrainState.DRAINING:
            return True
        self.state = DrainState.DRAINING
        self._began_at = trio.current_time()
        self.drains += 1
        if registry is not None:
            registry.begin_drain()
        self._requested.set()
        return True

    def take_back(self) -> bool:
        """Serve new cohorts again: the drain taken back, the rejoin window (``rejoin_s``)
        ended. False when it is too late (the drain is over, or shutdown has begun); True
        otherwise, also when nothing was draining."""
        if self.state is DrainState.STOPPING or (self._registry is not None and
                                                 self._registry.shutting_down):
            return False
        if self._registry is not None:
            self._registry.end_rejoin()
        if self.state is DrainState.DRAINING:
            self.state = DrainState.SERVING
            self._requested = trio.Event()
            if self._registry is not None:
                self._registry.end_drain()
            if self._wait_scope is not None:
                self._wait_scope.cancel()
        return True

    def status(self) -> dict[str, Any]:
        """For ``/status``: the state, and while draining the seconds since it began, the
        seconds left of its bound, the cohorts still open and the seconds until the last of
        their deadlines (``open_deadline_s``; null with none open); always the members refused
        with 425 so far, the rejoin window's seconds left and the groups it sent elsewhere."""
        out: dict[str, Any] = {"state": self.state.value, "timeout_s": self.bound_s,
                               "drains": self.drains}
        if self.state is not DrainState.SERVING:
            elapsed = trio.current_time() - self._began_at
            out["elapsed_s"] = round(elapsed, 3)
            out["remaining_s"] = round(max(0.0, self.bound_s - elapsed), 3)
        if self._registry is not None:
            out["open_cohorts"] = self._registry.snapshot()["active_cohorts"]
            out["refused"] = self._registry.counters["drain_refused"]  # 425s, this process
            out["rejoining_s"] = round(self._registry.rejoining_s, 3)
            out["groups_elsewhere"] = self._registry.groups_elsewhere
            if self.state is not DrainState.SERVING:
                deadline = self._registry.longest_open_deadline_s()
                out["open_deadline_s"] = None if deadline is None else round(deadline, 3)
        return out

    async def run(self, registry: Drainable, stop: trio.Event) -> None:
        """The drain's task: for each drain requested, wait until ``registry`` has no active
        cohort or the bound has passed, then set ``stop`` (the graceful shutdown) and return.
        A drain taken back meanwhile is waited for again. Cancelled with its nursery."""
        self.attach(registry)
        while True:
            await self._requested.wait()
            if self.state is not DrainState.DRAINING:
                continue  # taken back before this task woke
            deadline = self._began_at + self.bound_s
            with trio.CancelScope(deadline=deadline) as scope:
                self._wait_scope = scope
                await registry.wait_until_idle()
            self._wait_scope = None
            if self.state is not DrainState.DRAINING:
                continue  # taken back
            self.state = DrainState.STOPPING
            open_cohorts = registry.snapshot()["active_cohorts"]
            if open_cohorts:
                logger.warning("drain: %g s passed with %d cohorts still open: shutting down "
                               "(they end as on SIGTERM)", self.bound_s, open_cohorts)
            else:
                logger.info("drain complete after %.3f s: no open cohort left, shutting down",
                            trio.current_time() - self._began_at)
            stop.set()
            return


__all__ = ["DrainMode", "DrainState"]
