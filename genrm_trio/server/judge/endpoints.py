"""Endpoint choice: which judge URL an attempt goes to, and the cool-down of failing ones.

Calls go to the ready endpoint with the fewest calls in flight or waiting for it (ties: the
least used, so sequential calls spread out); a retry avoids the endpoint its comparison's last
attempt used whenever another is ready. An endpoint with ``judge.endpoint_failure_threshold``
consecutive failures is skipped for ``judge.endpoint_cooldown_s``; when every endpoint cools
down, the one whose cool-down started first is used.

``judge.max_concurrency_per_endpoint`` gives each endpoint that many slots: a call waits for a
slot here, on our side, before its per-request deadline starts, so a judge that serves fewer
calls at once than we could send does not time calls out in its own queue. State is plain
counters, touched only from trio tasks of the run that owns the judge.

``judge.routing: cohort_affinity`` (:meth:`Endpoints.acquire`) sends a cohort's comparisons to
one endpoint, its *home*, so the calls that share a prefix (conversation, principle, often
``response_1``) meet that engine's prefix cache. The home is chosen when the cohort's first
comparison is issued: the ready endpoint with the fewest *outstanding prompt tokens* (waiting
or in flight, each call estimated as its request body's bytes / 4, the mock judge's tokenizer
rule), not the fewest calls. A comparison *spills* to the ready endpoint with the fewest
outstanding tokens when its home has more than ``judge.affinity_spill_factor`` times the mean
over ready endpoints and (with ``max_concurrency_per_endpoint``) no free slot while the other
has one; a slot that frees on an endpoint with no waiting calls of its own takes the first
waiting call of the most loaded endpoint that is over that bound. So affinity holds while the
endpoints are within the factor of each other, and no endpoint idles while another one's
queue is over it. A retry goes to the least loaded ready endpoint other than its last one (the
home is kept); a cooling home is replaced by the least loaded ready endpoint.
"""

from __future__ import annotations

import logging
import math
import urllib.parse
from collections import deque

import trio

from genrm_trio.config import Config
from genrm_trio.server.judge.order import insert_in_place

log = logging.getLogger(__name__)


def display_url(url: str) -> str:
    """The URL without user info, safe for logs, errors and ``/status``."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def endpoint_url(base_url: str, api: str) -> str:
    """The full URL of ``api`` (``responses`` or ``chat``) under a server root."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/responses" if api == "responses" else "/chat/completions")


class Endpoint:
    """One judge URL and its counters."""

    __slots__ = (
        "url",
        "display",
        "in_flight",
        "picks",
        "failures",
        "consecutive_failures",
        "cooling_until",
        "cooldown_started",
        "split_url",
        "limiter",
        "waiting",
        "input_tokens",
        "output_tokens",
        "cached_tokens",
        "outstanding_tokens",
        "limit",
        "used",
        "queue",
    )

    def __init__(self, url: str, max_concurrency: int | None = None,
                 own_slots: bool = False) -> None:
        self.url = url
        self.split_url = urllib.parse.urlsplit(url)
        self.display = display_url(url)
        self.in_flight = 0
        self.picks = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.cooling_until = -math.inf
        self.cooldown_started = -math.inf
        # least_loaded: a trio limiter (FIFO per endpoint); cohort_affinity: our own slots
        # (``used`` of ``limit``) and waiting calls (``queue``), which another endpoint may take.
        self.limit = max_concurrency
        own = own_slots and max_concurrency is not None
        self.limiter = trio.CapacityLimiter(max_concurrency) if max_concurrency and not own \
            else None
        self.used = 0
        self.queue: deque[SlotWaiter] = deque()
        self.outstanding_tokens = 0  # estimated prompt tokens of calls waiting or in flight
        self.waiting = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0  # prompt tokens the judge reported found in its prefix cache

    def cooling(self, now: float) -> bool:
        return now < self.cooling_until

    def has_free_slot(self) -> bool:
        return self.limit is None or (self.used < self.limit and not self.queue)


class Affinity:
    """A group's home endpoint under ``cohort_affinity`` (None until its first comparison is
    issued). Owned by the group (a cohort holds one as ``judge_affinity``)."""

    __slots__ = ("endpoint",)

    def __init__(self) -> None:
        self.endpoint: Endpoint | None = None


class SlotWaiter:
    """A call waiting for a slot of ``endpoint`` (which changes when another endpoint takes it)."""

    __slots__ = ("endpoint", "tokens", "avoid", "group", "place", "event", "granted")

    def __init__(self, endpoint: Endpoint, tokens: int, avoid: object | None,
                 group: object | None = None, place: int = 0) -> None:
        self.endpoint = endpoint
        self.tokens = tokens
        self.avoid = avoid
        self.group = group
        self.place = place
        self.event = trio.Event()
        self.granted = False


class Endpoints:
    """The configured endpoints, the choice between them and their failure bookkeeping."""

    def __init__(self, cfg: Config, urls: list[str]) -> None:
        self._cfg = cfg
        limit = cfg.judge.max_concurrency_per_endpoint
        self.affinity = cfg.judge.routing == "cohort_affinity"
        self._factor = cfg.judge.affinity_spill_factor
        self.all = [Endpoint(u, limit, own_slots=self.affinity) for u in urls]

    # -- cohort_affinity ------------------------------------------------------------------

    def _ready(self, now: float) -> list[Endpoint]:
        return [e for e in self.all if not e.cooling(now)]

    @staticmethod
    def _lightest(candidates: list[Endpoint]) -> Endpoint:
        return min(candidates, key=lambda e: (e.outstanding_tokens, e.in_flight + e.waiting,
                                              e.picks))

    def _over(self, endpoint: Endpoint, ready: list[Endpoint]) -> bool:
        """``endpoint`` holds more than the spill factor times the mean outstanding tokens."""
        mean = sum(e.outstanding_tokens for e in ready) / len(ready)
        return endpoint.outstanding_tokens > self._factor * mean

    def _target(self, avoid: object | None, affinity: Affinity | None) -> Endpoint:
        now = trio.current_time()
        ready = self._ready(now)
        if not ready:
            return min(self.all, key=lambda e: e.cooldown_started)
        if avoid is not None and len(ready) > 1:  # a retry: another endpoint than the last
            return self._lightest([e for e in ready if e is not avoid])
        home = affinity.endpoint if affinity is not None else None
        if home is None or home not in ready:
            home = self._lightest(ready)
            if affinity is not None:
                affinity.endpoint = home
        if not self._over(home, ready) or (home.limit is not None and home.has_free_slot()):
            return home
        free = [e for e in ready if e is not home and e.has_free_slot()]
        return self._lightest(free) if free else home

    async def acquire(self, avoid: object | None, affinity: Affinity | None,
                      tokens: int, group: object | None = None, place: int = 0) -> Endpoint:
        """``cohort_affinity``: choose the endpoint of one attempt (module docstring) and take
        one of its slots, waiting for one in FIFO order when it has none (a group's calls in
        their ``place`` order; a waiting call may be handed a slot of another endpoint).
        Blocks only while waiting; a cancellation removes
        the waiter (a slot handed to it meanwhile is passed on). The caller gives the slot
        back with :meth:`release` and the same ``tokens``."""
        endpoint = self._target(avoid, affinity)
        endpoint.outstanding_tokens += tokens
        if endpoint.has_free_slot():
            endpoint.used += 1
            await trio.lowlevel.checkpoint()
            return endpoint
        waiter = SlotWaiter(endpoint, tokens, avoid, group, place)
        insert_in_place(endpoint.queue, waiter, lambda w: w.place,
                        lambda w: group is not None and w.group is group)
        endpoint.waiting += 1
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release(waiter.endpoint, tokens)
            else:
                waiter.endpoint.queue.remove(waiter)
                waiter.endpoint.waiting -= 1
                waiter.endpoint.outstanding_tokens -= tokens
            raise
        return waiter.endpoint

    def release(self, endpoint: Endpoint, tokens: int) -> None:
        """Give back a slot taken by :meth:`acquire`: to the endpoint's first waiting call,
        else to the first waiting call of the most loaded ready endpoint over the spill bound,
        else free. Synchronous."""
        endpoint.outstanding_tokens -= tokens
        if endpoint.limit is None:
            endpoint.used -= 1
            return
        if endpoint.queue:
            self._grant(endpoint.queue.popleft(), endpoint)
            return
        now = trio.current_time()
        ready = self._ready(now)
        if endpoint in ready:
            # A cooling endpoint's waiting calls are always taken.
            victims = [e for e in self.all if e is not endpoint and e.queue
                       and e.queue[0].avoid is not endpoint
                       and (e.cooling(now) or self._over(e, ready))]
            if victims:
                victim = max(victims, key=lambda e: e.outstanding_tokens)
                waiter = victim.queue.popleft()
                victim.outstanding_tokens -= waiter.tokens
                endpoint.outstanding_tokens += waiter.tokens
                self._grant(waiter, endpoint, moved_from=victim)
                return
        endpoint.used -= 1

    @staticmethod
    def _grant(waiter: SlotWaiter, endpoint: Endpoint, moved_from: Endpoint | None = None) -> None:
        (moved_from or endpoint).waiting -= 1
        waiter.endpoint = endpoint
        waiter.granted = True
        waiter.event.set()

    # -- least_loaded ---------------------------------------------------------------------

    def choose(self, avoid: object | None = None) -> Endpoint:
        """The endpoint for the next attempt, not ``avoid`` when another is ready (never
        blocks)."""
        now = trio.current_time()
        ready = [e for e in self.all if not e.cooling(now)]
        if len(ready) > 1:
            ready = [e for e in ready if e is not avoid]
        if ready:
            # Least loaded; ties go to the least used so sequential calls spread out.
            return min(ready, key=lambda e: (e.in_flight + e.waiting, e.picks))
        return min(self.all, key=lambda e: e.cooldown_started)

    def record(self, endpoint: Endpoint, failed: bool) -> None:
        """Count one finished attempt of ``endpoint``; may start its cool-down."""
        if not failed:
            endpoint.consecutive_failures = 0
            return
        endpoint.failures += 1
        endpoint.consecutive_failures += 1
        threshold = self._cfg.judge.endpoint_failure_threshold
        if threshold > 0 and endpoint.consecutive_failures >= threshold:
            now = trio.current_time()
            was_cooling = endpoint.cooling_until > now
            endpoint.cooldown_started = now
            endpoint.cooling_until = now + self._cfg.judge.endpoint_cooldown_s
            if was_cooling:  # its other calls were still in flight: one line per cool-down
                return
            log.warning(
                "judge endpoint %s cooling down for %s s after %d consecutive failures",
                endpoint.display,
                self._cfg.judge.endpoint_cooldown_s,
                endpoint.consecutive_failures,
            )
