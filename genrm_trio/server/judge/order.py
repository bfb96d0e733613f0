"""The order of judge work under the capacity limit (``judge_max_concurrency``).

When more comparisons wait than the judge can serve, which one goes next decides when each
group finishes (the step's makespan is the same for every order that keeps the judge busy).
:class:`OrderedLimiter` is a capacity limiter whose free token goes to the waiter ranked first
by ``judge_order``:

``complete_group`` (default)
    groups that have all their members first, in the order they became complete; then groups
    still collecting (eager pairs), oldest first. Work on a group's critical path goes first,
    and no complete group waits behind one that completed later. Measured in the ``step``
    bench against the others: with eager judging it beats ``arrival`` on both the median and
    the tail of group latency at every capacity.
``closest_group``
    the group with the fewest comparisons left (finished ones do not count; those whose members
    have not arrived yet do), then the oldest group: shortest work first, the lowest median
    group latency, but a group with much work left can wait until the end (the worst tail).
``oldest_group``
    the group opened first.
``arrival``
    first come, first served (``trio.CapacityLimiter``'s order).

Within one group, waiters are served in the group's issue order (``place``: its prefix order,
scoring.prefix_order; a retry keeps its comparison's place), first come first served for
equal places; calls with no group (``POST /compare``, which rank ahead of groups) are served
first come, first served. The rank is read when a token is handed on, so
progress a group made while its calls waited counts. Cost per hand-over: one rank per group
with waiting calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol

import trio

JudgeOrder = Literal["complete_group", "closest_group", "oldest_group", "arrival"]
JUDGE_ORDERS: tuple[JudgeOrder, ...] = ("complete_group", "closest_group", "oldest_group",
                                        "arrival")


class GroupProgress(Protocol):
    """What the limiter reads of a group (a cohort) to rank its waiting calls."""

    @property
    def opened_at(self) -> float: ...

    @property
    def comparisons_left(self) -> int: ...

    @property
    def collected_at(self) -> float | None: ...


class _Waiter:
    __slots__ = ("seq", "place", "event", "granted")

    def __init__(self, seq: int, place: int) -> None:
        self.seq = seq
        self.place = place
        self.event = trio.Event()
        self.granted = False


def insert_in_place(queue: deque[Any], item: Any, place: Callable[[Any], int],
                    same: Callable[[Any], bool] | None = None) -> None:
    """Append ``item``, moved ahead of the waiters at the tail that ``same`` accepts (default:
    all) with a higher place: a queue in issue order, FIFO among equal places. O(moves)."""
    at = len(queue)
    mine = place(item)
    while at > 0 and (same is None or same(queue[at - 1])) and place(queue[at - 1]) > mine:
        at -= 1
    queue.insert(at, item)


class OrderedLimiter:
    """``total_tokens`` calls at once; the rest wait and are served in ``order``.

    ``slot(group)`` blocks until a token is this caller's and holds it for the block.
    Cancellation while waiting removes the waiter (a token handed to it meanwhile is passed on).
    Safe to share between the tasks of one trio run.
    """

    def __init__(self, total_tokens: int, order: JudgeOrder = "complete_group") -> None:
        if total_tokens < 1:
            raise ValueError(f"total_tokens must be >= 1, got {total_tokens!r}")
        if order not in JUDGE_ORDERS:
            raise ValueError(f"unknown judge order {order!r}")
        self._total = total_tokens
        self._order = order
        self._borrowed = 0
        self._seq = 0
        self._waiting = 0
        # id(group) -> (group, its waiters in arrival order); by identity, so any object works.
        self._queues: dict[int, tuple[GroupProgress | None, deque[_Waiter]]] = {}

    @property
    def total_tokens(self) -> int:
        return self._total

    @property
    def borrowed_tokens(self) -> int:
        return self._borrowed

    @property
    def waiting(self) -> int:
        return self._waiting

    @asynccontextmanager
    async def slot(self, group: GroupProgress | None = None,
                   place: int = 0) -> AsyncIterator[None]:
        await self.acquire(group, place)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, group: GroupProgress | None = None, place: int = 0) -> None:
        """Take a token, waiting for one in rank order (within ``group``, by ``place``). A
        checkpoint, like trio's limiter."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._borrowed < self._total and not self._waiting:
            self._borrowed += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self._seq += 1
        waiter = _Waiter(self._seq, place)
        insert_in_place(self._queues.setdefault(id(group), (group, deque()))[1], waiter,
                        lambda w: w.place)
        self._waiting += 1
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release()  # handed over while being cancelled: pass it on
            else:
                queue = self._queues[id(group)][1]
                queue.remove(waiter)
                self._waiting -= 1
                if not queue:
                    del self._queues[id(group)]
            raise

    def release(self) -> None:
        """Give a token back: to the first-ranked waiter if any, else to the pool."""
        if self._borrowed < 1:
            raise RuntimeError("release without a token")
        waiter = self._next()
        if waiter is None:
            self._borrowed -= 1
            return
        waiter.granted = True
        waiter.event.set()

    def _next(self) -> _Waiter | None:
        if not self._waiting:
            return None
        best = 0
        best_rank: tuple[float, ...] | None = None
        for key, (group, queue) in self._queues.items():
            rank = self._rank(group, queue[0].seq)
            if best_rank is None or rank < best_rank:
                best, best_rank = key, rank
        queue = self._queues[best][1]
        waiter = queue.popleft()
        if not queue:
            del self._queues[best]
        self._waiting -= 1
        return waiter

    def _rank(self, group: GroupProgress | None, seq: int) -> tuple[float, ...]:
        if self._order == "arrival":
            return (seq,)
        if group is None:
            return (-1.0, 0.0, seq)
        if self._order == "oldest_group":
            return (0.0, group.opened_at, seq)
        if self._order == "complete_group":
            collected = group.collected_at
            if collected is None:
                return (1.0, group.opened_at, seq)
            return (0.0, collected, seq)
        return (float(group.comparisons_left), group.opened_at, seq)
