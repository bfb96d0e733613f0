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
over ready endpoints and either its home has no free slot while another has one or the
registry holds fewer than two cohorts per endpoint (then even a home with free slots spills:
an engine shares its compute between the calls it runs); and when its home has no free slot
while another has one and the registry holds fewer than two cohorts per endpoint (no other
cohort would take that slot soon); a slot that frees on an endpoint with no waiting calls of
its own takes waiting calls of the most loaded endpoint under the same rule. So affinity holds
while the endpoints are within the factor of each other, and no endpoint idles while another
one's queue is over it. A retry goes to the least loaded ready endpoint other than its last
one (the home is kept); a cooling home is replaced by the least loaded ready endpoint.

With ``max_concurrency_per_endpoint``, each endpoint's waiting calls are served by what they
would make the engine compute (:meth:`Endpoints._pick`), from what this process knows of each
cohort's prefixes there (:class:`Affinity`: *warm* once a call with it was answered there,
*computing* while the first such call is in flight): first calls whose conversation and
``response_1`` are warm, then calls that compute a new ``response_1`` on a warm conversation,
then calls that open a cohort there; within each, a cohort the endpoint has not served for
:data:`STARVED_GRANTS` grants per slot first (so an open cohort's prefix does not age out of a
small cache while older ones are served), then queue order (older cohorts first, a cohort's
calls in prefix order: consecutive calls share the most, which is what an engine with one
cached prompt per slot, like llama.cpp's, needs). A call that would compute again a prefix a
call in flight is computing is a *duplicate*: when the registry holds at least two cohorts per
endpoint (:class:`Crowd`), it waits for that call even while a slot is free (other cohorts'
calls take the slot meanwhile), so each prefix is computed once; with fewer cohorts it takes
the free slot, as nothing else would. The engine may still have evicted a warm prefix; it is a
hint, never a correctness matter (rewards never depend on issue order).

Such a *prefix wait* (this duplicate wait, and the registry's warm-up call, server/cohort.py)
saves work only on an engine whose concurrent calls do not share a prefix (llama.cpp's slots);
on one that shares it (vLLM registers a block when it schedules it) or has no prefix cache it
only adds a judge round trip. ``judge.engine`` chooses: ``llama_cpp`` waits, ``vllm`` never
does; ``sglang`` learns as ``unknown`` does (its scheduler holds back a waiting call whose
prefix another waiting call has, but only under its cache-aware ``--schedule-policy lpm`` with
at most 128 calls waiting, schedule_policy.py; under ``fcfs`` concurrent calls each compute it);
``unknown`` (the default) learns it per endpoint. Until the endpoint's first answer nothing is
known, so it waits as ``llama_cpp`` does (one judge round trip, once per endpoint and process:
the first wave of calls then opens one conversation per slot instead of computing one
conversation in every slot). An answer that carries llama.cpp's ``timings`` makes it
``llama_cpp`` (:meth:`Endpoint.identify`). Otherwise it waits only once its cached-token
accounting has shown that concurrent calls on one conversation do not share it
(:class:`Sharing`: over at least :data:`EVIDENCE_CALLS` answered calls of each kind, the cached
share of the prompt of calls that started while their conversation was being computed there
stays under :data:`SHARED_FRACTION` of the share of calls that found it warm); until then it
routes with affinity but does not wait, so past its first answer it is never slower than
``least_loaded`` where affinity saves nothing.
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
        "grants",
        "sharing",
        "engine",
        "answered",
    )

    def __init__(self, url: str, max_concurrency: int | None = None,
                 own_slots: bool = False, engine: str = "unknown") -> None:
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
        self.grants = 0  # slots handed out under cohort_affinity
        self.outstanding_tokens = 0  # estimated prompt tokens of calls waiting or in flight
        self.waiting = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0  # prompt tokens the judge reported found in its prefix cache
        self.sharing = Sharing()
        # ``judge.engine``, or for ``unknown`` what the endpoint's answers showed it to be
        # (:meth:`identify`).
        self.engine = engine
        # Whether a call of it was answered (computed) yet: until then an ``unknown`` endpoint
        # is treated as one whose concurrent calls do not share (Endpoints.prefix_waits).
        self.answered = False

    def identify(self, engine: str | None) -> None:
        """An answer of this endpoint says which engine serves it (``answers.engine_of``):
        an ``unknown`` endpoint takes that engine's rule from now on; a configured
        ``judge.engine`` is never overridden."""
        if engine is not None and self.engine == "unknown":
            self.engine = engine

    def cooling(self, now: float) -> bool:
        return now < self.cooling_until

    def has_free_slot(self) -> bool:
        # While a slot is free, every call still waiting here waits for its prefix (a call
        # computing it is in flight), not for a slot (Endpoints.release fills free slots).
        return self.limit is None or self.used < self.limit


#: The ``judge.engine`` values whose prefix waits follow what :class:`Sharing` learnt.
LEARNS = ("unknown", "sglang")

#: Answered calls of each kind (:class:`Sharing`) before an endpoint's sharing is judged.
EVIDENCE_CALLS = 8

#: An endpoint shares a prefix between concurrent calls when the calls that started while their
#: conversation was being computed there find at least this share of what calls that found it
#: warm find in its cache.
SHARED_FRACTION = 0.5


class Sharing:
    """What an endpoint's cached-token accounting says of concurrent calls on one conversation
    (``judge.engine: unknown``): the summed cached share of the prompt of answered calls that
    started while their conversation was being computed there (``concurrent``), and of calls
    that found it warm (``warm``). Plain counters: four numbers per endpoint."""

    __slots__ = ("concurrent_calls", "concurrent_share", "warm_calls", "warm_share")

    def __init__(self) -> None:
        self.concurrent_calls = 0
        self.concurrent_share = 0.0
        self.warm_calls = 0
        self.warm_share = 0.0

    def add(self, concurrent: bool, cached_tokens: int, input_tokens: int) -> None:
        share = min(1.0, cached_tokens / input_tokens)
        if concurrent:
            self.concurrent_calls += 1
            self.concurrent_share += share
        else:
            self.warm_calls += 1
            self.warm_share += share

    def unshared(self) -> bool:
        """Shown not to share: enough calls of both kinds, and concurrent ones find in the
        cache less than :data:`SHARED_FRACTION` of what warm ones find (an engine that reports
        no cached tokens, or has no cache, is never shown so)."""
        if self.concurrent_calls < EVIDENCE_CALLS or self.warm_calls < EVIDENCE_CALLS:
            return False
        warm = self.warm_share / self.warm_calls
        return warm > 0 and self.concurrent_share / self.concurrent_calls < SHARED_FRACTION * warm


#: A prefix of a group's prompts on one endpoint: the conversation (``None``), or the
#: conversation and one ``response_1``.
PrefixKey = tuple[Endpoint, str | None]

#: How many of an endpoint's waiting calls a free slot ranks (Endpoints._pick): the cost of a
#: hand-over is bounded, and calls beyond the window wait for those ahead of them.
PICK_WINDOW = 256


class Crowd:
    """How many cohorts the registry holds (collecting or judging), shared by their
    :class:`Affinity`: more work is coming when this is more than one cohort per endpoint.
    Owned by the registry, which sets ``cohorts``. ``waits``: prefix waits pay on some endpoint
    (:meth:`Endpoints.any_prefix_waits`, set after every answered call): the registry's
    warm-up call reads it."""

    __slots__ = ("cohorts", "waits")

    def __init__(self, waits: bool = False) -> None:
        self.cohorts = 0
        self.waits = waits


class Affinity:
    """A group's home endpoint under ``cohort_affinity`` (None until its first comparison is
    issued), and which of its prompt prefixes each endpoint has computed (``warm``: a call
    with that prefix was answered there) or is computing (``computing``: calls in flight that
    found it cold), and when each endpoint last gave it a slot (``served``, its grant count). Owned
    by the group (a cohort holds one as ``judge_affinity``); at most endpoints x (N + 1) keys.
    """

    __slots__ = ("endpoint", "warm", "computing", "served", "crowd", "closed")

    def __init__(self, crowd: Crowd | None = None) -> None:
        self.crowd = crowd
        self.endpoint: Endpoint | None = None
        self.warm: set[PrefixKey] = set()
        self.computing: dict[PrefixKey, int] = {}
        self.served: dict[Endpoint, int] = {}
        self.closed = False

    def close(self) -> None:
        """The group is done: drop what it knows (the keys hold its answers' text); calls
        still in flight release without bookkeeping."""
        self.closed = True
        self.warm.clear()
        self.computing.clear()
        self.served.clear()

    def keys(self, endpoint: Endpoint, prefix: str | None) -> tuple[PrefixKey, ...]:
        """The prefixes a call starting with ``prefix`` would compute on ``endpoint``."""
        warm = self.warm
        conversation = (endpoint, None)
        if prefix is None:
            return () if conversation in warm else (conversation,)
        own = (endpoint, prefix)
        if conversation in warm:
            return () if own in warm else (own,)
        return (conversation,) if own in warm else (conversation, own)

    def tier(self, endpoint: Endpoint, prefix: str | None) -> int:
        """What a call starting with ``prefix`` would compute on ``endpoint``: 0 nothing of
        what it shares (all warm there); 1 its ``response_1`` on a warm conversation; 2 the
        conversation too (the group opens there); 3 again a prefix that a call in flight is
        computing (a duplicate)."""
        cold = self.keys(endpoint, prefix)
        if not cold:
            return 0
        if any(key in self.computing for key in cold):
            return DUPLICATE
        return 2 if cold[0][1] is None else 1


#: :meth:`Affinity.tier` of a call that would compute a prefix another call is computing.
DUPLICATE = 3

#: A group that an endpoint has served but not for this many grants per slot goes first among
#: calls of its tier: its prefixes would otherwise age out of the engine's cache while older
#: groups are served (a 16k-token cache holds about 8 x 4 calls' new blocks).
STARVED_GRANTS = 8


class Lease:
    """One slot taken by :meth:`Endpoints.acquire`: give it back with :meth:`Endpoints.release`.
    ``keys``: the group's prefixes this call is computing (cold when it started);
    ``conversation``: what it found of the group's conversation there (:data:`WARM`,
    :data:`CONCURRENT`: another call was computing it, or None: cold or no group)."""

    __slots__ = ("endpoint", "tokens", "affinity", "keys", "conversation")

    def __init__(self, endpoint: Endpoint, tokens: int, affinity: Affinity | None,
                 keys: tuple[PrefixKey, ...], conversation: str | None = None) -> None:
        self.endpoint = endpoint
        self.tokens = tokens
        self.affinity = affinity
        self.keys = keys
        self.conversation = conversation


#: :attr:`Lease.conversation` values.
WARM = "warm"
CONCURRENT = "concurrent"


class SlotWaiter:
    """A call waiting for a slot of ``endpoint`` (which changes when another endpoint takes it)."""

    __slots__ = ("endpoint", "tokens", "avoid", "group", "place", "event", "lease",
                 "affinity", "prefix")

    def __init__(self, endpoint: Endpoint, tokens: int, avoid: object | None,
                 group: object | None = None, place: int = 0,
                 affinity: Affinity | None = None, prefix: str | None = None) -> None:
        self.endpoint = endpoint
        self.tokens = tokens
        self.avoid = avoid
        self.group = group
        self.place = place
        self.affinity = affinity
        self.prefix = prefix
        self.event = trio.Event()
        self.lease: Lease | None = None  # set when granted

    def rank(self, endpoint: Endpoint) -> tuple[int, int]:
        """(tier, 0 if this call's group waits past :data:`STARVED_GRANTS` there else 1):
        lower goes first (then queue order)."""
        if self.affinity is None:
            return (1, 1)
        served = self.affinity.served.get(endpoint)
        starved = served is not None and (
            endpoint.grants - served > STARVED_GRANTS * (endpoint.limit or 1))
        return (self.affinity.tier(endpoint, self.prefix), 0 if starved else 1)


class Endpoints:
    """The configured endpoints, the choice between them and their failure bookkeeping."""

    def __init__(self, cfg: Config, urls: list[str]) -> None:
        self._cfg = cfg
        limit = cfg.judge.max_concurrency_per_endpoint
        self.affinity = cfg.judge.routing == "cohort_affinity"
        self._factor = cfg.judge.affinity_spill_factor
        self.all = [Endpoint(u, limit, own_slots=self.affinity, engine=cfg.judge.engine)
                    for u in urls]
        # One judge URL: every call goes to it, so the choice costs nothing (_target).
        self._single = self.all[0] if len(self.all) == 1 else None

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

    def _target(self, avoid: object | None, affinity: Affinity | None,
                prefix: str | None) -> Endpoint:
        single = self._single
        if single is not None:  # cooling or not, a retry or not: the only one there is
            if affinity is not None:
                affinity.endpoint = single
            return single
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
        over, crowded = self._over(home, ready), self._crowded(affinity)
        # With slots a home keeps its calls while it has a free slot, unless few cohorts are
        # active and it is past the spill factor (an engine shares its compute between the
        # calls it runs). A full home spills, with few cohorts to any free slot (no other work
        # would take it soon), otherwise only past the factor.
        if home.limit is not None and home.has_free_slot() and (crowded or not over):
            return home
        if not over and (home.limit is None or crowded):
            return home
        free = [e for e in ready if e is not home and e.has_free_slot()
                and not self._waits(e, affinity, prefix)]
        return self._lightest(free) if free else home

    async def acquire(self, avoid: object | None, affinity: Affinity | None,
                      tokens: int, group: object | None = None, place: int = 0,
                      prefix: str | None = None) -> Lease:
        """``cohort_affinity``: choose the endpoint of one attempt (module docstring) and take
        one of its slots, waiting when it has none (or, for a duplicate in a crowd, until the
        call computing its prefix ends). ``prefix`` (the call's ``response_1``) says which of
        the group's prefixes the call shares. Blocks only while waiting; a cancellation
        removes the waiter (a slot handed to it meanwhile is passed on). The caller gives the
        slot back with :meth:`release`, which owns the returned lease."""
        await trio.lowlevel.checkpoint_if_cancelled()
        endpoint = self._target(avoid, affinity, prefix)
        endpoint.outstanding_tokens += tokens
        if endpoint.has_free_slot() and not self._waits(endpoint, affinity, prefix):
            endpoint.used += 1
            # No schedule point after the slot is taken: nothing can cancel the caller before
            # it holds the lease (and a task step every judge call saved, issue 27).
            return self._lease(endpoint, tokens, affinity, prefix)
        waiter = SlotWaiter(endpoint, tokens, avoid, group, place, affinity, prefix)
        insert_in_place(endpoint.queue, waiter, lambda w: w.place,
                        lambda w: group is not None and w.group is group)
        endpoint.waiting += 1
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.lease is not None:
                self.release(waiter.lease, False)
            else:
                waiter.endpoint.queue.remove(waiter)
                waiter.endpoint.waiting -= 1
                waiter.endpoint.outstanding_tokens -= tokens
            raise
        if waiter.lease is None:  # set with the event, by _grant
            raise RuntimeError("slot waiter woken without a lease")
        return waiter.lease

    def _lease(self, endpoint: Endpoint, tokens: int, affinity: Affinity | None,
               prefix: str | None) -> Lease:
        keys: tuple[PrefixKey, ...] = ()
        conversation = None
        endpoint.grants += 1
        if affinity is not None and not affinity.closed:
            affinity.served[endpoint] = endpoint.grants
            keys = affinity.keys(endpoint, prefix)
            if not keys or keys[0][1] is not None:
                conversation = WARM
            elif keys[0] in affinity.computing:
                conversation = CONCURRENT
            for key in keys:
                affinity.computing[key] = affinity.computing.get(key, 0) + 1
        return Lease(endpoint, tokens, affinity, keys, conversation)

    def release(self, lease: Lease, computed: bool, input_tokens: int = 0,
                cached_tokens: int = 0) -> None:
        """Give back a slot taken by :meth:`acquire` (``computed``: the judge answered, so its
        prompt's prefixes are in that engine's cache now; ``input_tokens`` / ``cached_tokens``:
        what it reported of this call's prompt): free slots go to waiting calls of
        the endpoint (:meth:`_pick`), else to waiting calls of the most loaded other endpoint
        that is cooling, past the spill bound or (few cohorts) holding any, else stay free.
        Synchronous."""
        endpoint = lease.endpoint
        affinity = lease.affinity
        if (computed and input_tokens > 0 and lease.conversation is not None
                and endpoint.engine in LEARNS):
            endpoint.sharing.add(lease.conversation == CONCURRENT, cached_tokens, input_tokens)
        if computed:
            endpoint.answered = True
            if affinity is not None and affinity.crowd is not None:
                # Learnt (Sharing), identified from its answers (Endpoint.identify), or no
                # longer unheard of.
                affinity.crowd.waits = self.any_prefix_waits()
        if affinity is not None and not affinity.closed:
            for key in lease.keys:
                left = affinity.computing[key] - 1
                if left:
                    affinity.computing[key] = left
                else:
                    del affinity.computing[key]
                if computed:
                    affinity.warm.add(key)
        endpoint.outstanding_tokens -= lease.tokens
        endpoint.used -= 1
        limit = math.inf if endpoint.limit is None else endpoint.limit
        # Without a limit a call waits here only as a duplicate of a prefix that a call in
        # flight computes (_waits); this release may have ended that wait (its prefix is warm
        # now, or no longer being computed, or nothing is in flight): grant what may go.
        while endpoint.used < limit:
            waiter = self._pick(endpoint, endpoint.queue)
            if waiter is None:
                break
            endpoint.used += 1
            self._grant(waiter, endpoint)
        if endpoint.queue or endpoint.limit is None:
            return
        now = trio.current_time()
        ready = self._ready(now)
        while endpoint.used < endpoint.limit and endpoint in ready:
            # A cooling endpoint's waiting calls are always taken; with few cohorts, any
            # endpoint's (as _target spills them).
            victims = [e for e in self.all if e is not endpoint and e.queue
                       and (e.cooling(now) or self._over(e, ready)
                            or not self._crowded(e.queue[0].affinity))]
            if not victims:
                return
            victim = max(victims, key=lambda e: e.outstanding_tokens)
            waiter = self._pick(endpoint, victim.queue, steal=True)
            if waiter is None:
                return
            victim.outstanding_tokens -= waiter.tokens
            endpoint.outstanding_tokens += waiter.tokens
            endpoint.used += 1
            self._grant(waiter, endpoint, moved_from=victim)

    def _pick(self, endpoint: Endpoint, queue: deque[SlotWaiter],
              steal: bool = False) -> SlotWaiter | None:
        """Take from ``queue`` (``endpoint``'s own, or another's when ``steal``: not a retry
        that avoids ``endpoint``) the waiting call a free slot of ``endpoint`` goes to: the
        lowest :meth:`SlotWaiter.rank` among the first :data:`PICK_WINDOW`, first in queue
        order on ties. None when nothing may go: the queue is empty, or every candidate is
        a duplicate that waits (:meth:`_defers`; with more than the window waiting, even a
        duplicate goes)."""
        if not queue:
            return None
        best, best_rank = 0, (DUPLICATE + 1, 0)
        for at in range(min(len(queue), PICK_WINDOW)):
            if steal and queue[at].avoid is endpoint:
                continue
            rank = queue[at].rank(endpoint)
            if rank < best_rank:
                best, best_rank = at, rank
        if best_rank[0] > DUPLICATE:  # nothing it may take
            return None
        waiter = queue[best]
        if (best_rank[0] == DUPLICATE and len(queue) <= PICK_WINDOW
                and self._defers(endpoint, waiter.affinity)):
            return None
        del queue[best]
        return waiter

    def _crowded(self, affinity: Affinity | None) -> bool:
        """At least two cohorts per endpoint are active (collecting or judging): other
        cohorts' calls will take a slot that one cohort leaves free."""
        crowd = affinity.crowd if affinity is not None else None
        return crowd is not None and crowd.cohorts >= 2 * len(self.all)

    def _waits(self, endpoint: Endpoint, affinity: Affinity | None, prefix: str | None) -> bool:
        """A call of ``affinity``'s group starting with ``prefix`` would wait at ``endpoint``
        although it has a free slot (:meth:`_defers`)."""
        # The cheap test first: where prefix waits do not pay, no prefix is looked up.
        return (affinity is not None and self._defers(endpoint, affinity)
                and affinity.tier(endpoint, prefix) == DUPLICATE)

    def _defers(self, endpoint: Endpoint, affinity: Affinity | None) -> bool:
        """Whether a call that would compute again a prefix a call in flight is computing
        waits for that call although ``endpoint`` has a free slot: when the endpoint is
        serving calls, the registry is crowded (:meth:`_crowded`) and prefix waits pay there
        (:meth:`prefix_waits`)."""
        return endpoint.used > 0 and self._crowded(affinity) and self.prefix_waits(endpoint)

    def prefix_waits(self, endpoint: Endpoint) -> bool:
        """Whether a duplicate waits at ``endpoint`` (module docstring): ``judge.engine``
        ``llama_cpp`` always, ``vllm`` never, ``unknown`` / ``sglang`` until the endpoint's
        first answer and once it was shown not to share a prefix between concurrent calls
        (:data:`LEARNS`). An ``unknown`` endpoint whose answers showed it to be llama.cpp's
        server waits from its first answer on (:meth:`Endpoint.identify`)."""
        if endpoint.engine in LEARNS:
            return not endpoint.answered or endpoint.sharing.unshared()
        return endpoint.engine == "llama_cpp"

    def any_prefix_waits(self) -> bool:
        """Whether prefix waits pay on some endpoint that has answered (:class:`Crowd`
        ``waits``, the registry's warm-up call); True while none has answered, unless
        ``judge.engine`` is ``vllm``."""
        if self._single is not None:
            return self.prefix_waits(self._single)
        heard = [e for e in self.all if e.answered]
        if not heard:
            return any(self.prefix_waits(e) for e in self.all)
        return any(self.prefix_waits(e) for e in heard)

    def _grant(self, waiter: SlotWaiter, endpoint: Endpoint,
               moved_from: Endpoint | None = None) -> None:
        # The lease now, not when the waiter's task runs: the next pick must see the prefixes
        # this call computes.
        (moved_from or endpoint).waiting -= 1
        waiter.endpoint = endpoint
        waiter.lease = self._lease(endpoint, waiter.tokens, waiter.affinity, waiter.prefix)
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
