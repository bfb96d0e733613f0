"""The cohort state machine and the registry that owns every cohort.

Lifetimes: the registry opens and owns its own nursery (:meth:`CohortRegistry.open`, an async
context manager that ``serve`` enters, apart from Hypercorn's); every cohort task lives there and
nowhere else. Each cohort is one task (:meth:`CohortRegistry._run_cohort`) holding its own cancel
scope and a nursery for its judge calls; its collection and evaluation deadlines are cancel scopes
inside that task. The task is a containment boundary: any exception inside it fails that cohort
alone with 503 ``evaluation_error`` (logged once with its traceback); it never reaches the
registry's nursery, so every other cohort and the process go on. A ``/verify`` handler never owns
shared work: it registers its member synchronously (before any ``await``, so concurrent first
arrivals cannot open two cohorts), then waits for the cohort to resolve: on its ``done`` event,
or, for an HTTP handler, reading its own connection until the cohort's resolution cancels that
read (:meth:`CohortRegistry.verify_unless_gone`: no task per waiter). Cancelling the handler, or
the client hanging up, removes only its waiter.

Every phase change goes through one function (:meth:`CohortRegistry._transition`), a compare-and-
set on the expected phase, done synchronously between checkpoints, so each race (final arrival
against a deadline, supersession against publish, shutdown against anything) has exactly one
winner, and all waiters read that one outcome.

Retention: terminal records live in an insertion-ordered dict (terminal-time order) and are
pruned from the old end, so bookkeeping is O(1) amortised per request however many are kept.
Watermarks of groups with an active cohort are never candidates for eviction and are not even
visited: only idle groups' watermarks sit in the ordered eviction queue. Watermarks outlive
records by one extra TTL and cap (twice each), so that a retry of an attempt whose record was
evicted is answered at once with 409 ``result_expired`` instead of opening a fresh cohort that
waits out the collection deadline.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import trio

from genrm_trio import identity, scoring
from genrm_trio.config import Config, min_members_present
from genrm_trio.errors import GenRMError, JudgeFailed
from genrm_trio.logs import RateLimitedNote
from genrm_trio.server import memory_limit
from genrm_trio.server.journal import Journal
from genrm_trio.server.judge import Affinity, Crowd, GroupProgress, JudgeRequest
from genrm_trio.server.tracing import (
    NO_COHORT_TRACE,
    NO_REQUEST_SPAN,
    NO_TRACER,
    CohortTrace,
    JudgeParent,
    RequestSpan,
    Tracer,
)
from genrm_trio.server.verdicts import VerdictCache
from genrm_trio.wire import LEGACY_GUIDANCE, VerifyMember, bound_text, member_response

logger = logging.getLogger(__name__)

OVERLOAD_RETRY_AFTER_S = 1.0
BODY_RESERVE_FACTOR = 4
"""A ``/verify`` body reserves this many times its length of ``max_active_bytes`` while it is
read and processed (:meth:`CohortRegistry.reserve_body`, called by server/app.py): the body
itself, its decoded member, and for its answer the body decoded again and encoded, all held at
once while the answer is built. Released when the member waits in its cohort (whose bytes count
then) or when the answer is handed to the connection, which counts its own bytes."""
REFUSABLE_BODY_BYTES = 2**20
"""A ``/verify`` body up to this size is counted in ``max_active_bytes`` as it is read but never
refused for it (the registry's admission decides, as before): members of open cohorts, which
are what frees the budget, keep getting in. A larger one whose reservation would pass the
budget waits, unread, for room (:data:`BODY_ROOM_WAIT_S`), then is refused with 429."""
BODY_ROOM_WAIT_S = 5.0
"""How long a ``/verify`` body over :data:`REFUSABLE_BODY_BYTES` waits, unread, for room in
``max_active_bytes`` (:meth:`CohortRegistry.reserve_body_within`) before it is refused with
429 (at most ``request_read_timeout_s``)."""
DISCONNECT_WATCH_AFTER_S = 0.5
"""How long after a cohort opened its waiting ``/verify`` members start to watch their
connections: a client that hangs up is noticed (its waiter removed) once its cohort is this
old, at once after that (README, "HTTP API")."""
_WATCH_SLACK_S = 0.1
"""The watch timer starts every cohort due within this much of the one it woke for."""


class Phase(enum.Enum):
    COLLECTING = "collecting"
    EVALUATING = "evaluating"
    COMPLETED = "completed"
    FAILED = "failed"


ACTIVE_PHASES = (Phase.COLLECTING, Phase.EVALUATING)

#: The allowed phase changes; :meth:`CohortRegistry._transition` refuses any other.
_TRANSITIONS = MappingProxyType({
    Phase.COLLECTING: frozenset({Phase.EVALUATING, Phase.FAILED}),
    Phase.EVALUATING: frozenset({Phase.COMPLETED, Phase.FAILED}),
    Phase.COMPLETED: frozenset(),
    Phase.FAILED: frozenset(),
})


@dataclass(frozen=True, slots=True)
class Failure:
    """An explicit failure handed to a request. ``masked`` failures (judge_failed) are answered
    with the masked 200 of contract 3.3; the others with ``status`` and a JSON error body."""

    status: int
    kind: str
    detail: str
    masked: bool = False
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Rewarded:
    """A member's reward. ``defaulted_comparisons``: how many of its cohort's comparisons used
    the default verdict; ``reused_comparisons``: how many were scored with a kept verdict
    instead of a judge call (see server/verdicts.py); both None when unknown (a record
    reloaded from the journal). ``cohort_expected`` / ``cohort_scored``: the cohort's size N
    and how many of its members were judged (M < N for a partial cohort,
    ``incomplete_cohort_policy: judge_present``)."""

    reward: float
    defaulted_comparisons: int | None = dataclasses.field(default=0, compare=False)
    cohort_expected: int | None = dataclasses.field(default=None, compare=False)
    cohort_scored: int | None = dataclasses.field(default=None, compare=False)
    reused_comparisons: int | None = dataclasses.field(default=0, compare=False)
    #: The member's slot (a member sent without ``_ng_rollout_index`` learns it here).
    slot: int | None = dataclasses.field(default=None, compare=False)


Outcome = Rewarded | Failure


class PairJudge(Protocol):
    async def judge_pair(self, request: JudgeRequest, group: GroupProgress | None = None,
                         trace: JudgeParent = NO_COHORT_TRACE) -> scoring.Verdict: ...


class CohortObserver(Protocol):
    """Told of every cohort disposition (server/prometheus.py's ServerMetrics is one)."""

    def cohort_done(self, kind: str, collection_s: float, evaluation_s: float | None,
                    partial: bool = False) -> None: ...

    def cohort_scored(self, expected: int, scored: int) -> None:
        """A cohort was published with ``scored`` of its ``expected`` members rewarded."""


class _Member:
    """A cohort's slot: the member's body as received (``raw``, the same bytes its request
    holds), its response digest and rollout id. Nothing decoded is kept while it waits.
    ``waiters``: how many requests wait on it now (an arrival-slotted identical body
    re-attaches only to a member that has none: see :meth:`CohortRegistry._arrive`)."""

    __slots__ = ("digest", "raw", "rollout_id", "_answer", "waiters")

    def __init__(self, digest: str, raw: bytes, rollout_id: str | None = None) -> None:
        self.digest = digest
        self.raw = raw
        self.rollout_id = rollout_id  # NeMo Gym's, from an /ng-rollout/<id>/ path
        self._answer: str | None = None
        self.waiters = 0

    @property
    def response(self) -> dict[str, Any]:
        """The ``response`` object, decoded from ``raw`` (a new dict on each call)."""
        return member_response(self.raw)

    @property
    def answer(self) -> str:
        """The final answer text, extracted when first judged (not while waiting: a waiting
        member should hold no more memory than its request)."""
        if self._answer is None:
            self._answer = scoring.final_answer(self.response)
        return self._answer


def _rollout_ids(cohort: Cohort) -> dict[str, str]:
    """The disposition line's ``rollout_ids`` field (NeMo Gym's ids by slot, ``-`` for a slot
    that had none), present only when some member came through an ``/ng-rollout/`` path. The
    log formatter bounds a field's length."""
    ids = [cohort.members[slot].rollout_id if slot in cohort.members else None
           for slot in range(cohort.size)]
    if all(i is None for i in ids):
        return {}
    return {"rollout_ids": ",".join(i or "-" for i in ids)}


class Cohort:
    """One cohort's live state. Owned by the registry; mutated only by registry methods."""

    __slots__ = (
        "key", "size", "prompt_digest", "history", "principle",
        "phase", "members", "digests", "rewards", "failure", "size_bytes",
        "opened_at", "scope", "arrival", "done", "pairs", "started_pairs", "results",
        "pairs_done", "evaluating_at", "defaulted", "input_tokens", "output_tokens",
        "cached_tokens", "wakers", "wake", "scored", "pair_scopes", "dropped_pairs",
        "judge_affinity", "trace", "reused", "verdict_prefix", "by_arrival",
    )

    def __init__(
        self, key: identity.CohortKey, size: int, prompt_digest: str, history: list[dict[str, str]],
        principle: str | None, pairs: list[tuple[int, int, int]], opened_at: float,
    ) -> None:
        self.key = key
        self.size = size
        self.prompt_digest = prompt_digest
        self.history = history
        self.principle = principle
        self.phase = Phase.COLLECTING
        self.members: dict[int, _Member] = {}
        # By slot once completed; None for a slot a partial cohort was judged without.
        self.digests: tuple[str | None, ...] = ()
        self.rewards: tuple[float | None, ...] = ()
        self.failure: Failure | None = None
        self.size_bytes = 0
        self.opened_at = opened_at
        self.scope = trio.CancelScope()
        self.arrival = trio.Event()
        self.done = trio.Event()
        # HTTP handlers' waiters (verify_unless_gone) wait on `wake`: set when the cohort
        # resolves or, once it is DISCONNECT_WATCH_AFTER_S old, by the registry's watch timer;
        # from then on they watch their connections in these cancel scopes.
        self.wake = trio.Event()
        self.wakers: set[trio.CancelScope] = set()
        # The comparison plan as (slot_i, slot_j, judge_idx) triples: over all N slots, or,
        # once judged partially, over the slots present (`scored`, in slot order).
        self.pairs = pairs
        self.started_pairs: set[tuple[int, int, int]] = set()
        self.results: dict[tuple[int, int, int], scoring.Verdict] = {}
        # A started comparison's own cancel scope, until it ends: a re-plan cancels the ones
        # it drops (eager comparisons of a partial cohort that are not in its new plan).
        self.pair_scopes: dict[tuple[int, int, int], trio.CancelScope] = {}
        self.pairs_done = trio.Event()
        self.scored: tuple[int, ...] | None = None  # set when judged partially
        self.dropped_pairs = 0
        self.evaluating_at: float | None = None
        self.defaulted = 0  # comparisons that used the default verdict
        self.input_tokens = 0  # judge tokens of the finished comparisons
        self.output_tokens = 0
        self.cached_tokens = 0  # of input_tokens, what the judge found in its prefix cache
        self.judge_affinity = Affinity()  # its home endpoint under judge.routing: cohort_affinity
        self.trace: CohortTrace = NO_COHORT_TRACE  # its genrm.cohort span (server/tracing.py)
        # Comparisons scored with a kept verdict (no judge call; in started_pairs and results).
        self.reused = 0
        # What this cohort's verdict keys start with; built when its first pair is ready.
        self.verdict_prefix: bytes | None = None
        # A prompt-keyed cohort whose members may take slots by arrival (legacy_slots:
        # arrival, or POST /get_reward): it keeps a record when it completes, so an identical
        # re-send replays, and incomplete_cohort_policy judge_present applies to it.
        self.by_arrival = False

    def release(self) -> None:
        """Wake every waiter: the outcome (rewards or failure) is set. Synchronous."""
        self.done.set()
        self.wake.set()
        for wake in self.wakers:
            wake.cancel()

    def start_watching(self) -> None:
        """From now on its HTTP handlers' waiters watch their connections. Synchronous."""
        self.wake.set()

    @property
    def collected_at(self) -> float | None:
        """When the last member arrived (None while collecting): the judge's limiter ranks by
        it."""
        return self.evaluating_at

    @property
    def comparisons_left(self) -> int:
        """Comparisons not finished yet, started or not: the judge's limiter ranks by it."""
        return len(self.pairs) - len(self.results)

    @property
    def legacy(self) -> bool:
        return self.key.group_id is None

    @property
    def scored_count(self) -> int:
        """How many members its rewards cover (N unless judged partially)."""
        return self.size if self.scored is None else len(self.scored)


class _Record:
    """A terminal record (tombstone): digests and rewards by slot (None for a slot a partial
    cohort was judged without), or the failure. Few objects each."""

    __slots__ = ("expires_at", "digests", "rewards", "failure", "defaulted", "scored", "reused",
                 "closed_at")

    def __init__(
        self, expires_at: float, digests: tuple[str | None, ...],
        rewards: tuple[float | None, ...], failure: Failure | None, defaulted: int | None = None,
        reused: int | None = None, closed_at: float = -math.inf,
    ) -> None:
        self.expires_at = expires_at
        # When its cohort ended (-inf: reloaded from the journal). An arrival cohort's record
        # answers members it does not hold only this long (the late-member window).
        self.closed_at = closed_at
        self.digests = digests
        self.rewards = rewards
        self.failure = failure
        self.defaulted = defaulted  # None: not journaled, unknown after a restart
        self.scored = sum(1 for d in digests if d is not None)
        self.reused = reused  # the same


class _Watermark:
    """The newest attempt seen for a group. ``finished``: that attempt's cohort ended with a
    retained record (so a later miss means the record expired). ``touched_at``: when the group
    last became idle (no active cohort); only idle watermarks age."""

    __slots__ = ("attempt", "prompt_digest", "touched_at", "finished")

    def __init__(self, attempt: int, prompt_digest: str, touched_at: float,
                 finished: bool = False) -> None:
        self.attempt = attempt
        self.prompt_digest = prompt_digest
        self.touched_at = touched_at
        self.finished = finished


class CohortRegistry:
    """Owns every cohort of the process: admission, fencing, replay, retention, shutdown.

    Obtain one with :meth:`open`, which owns the nursery every cohort task runs in. ``judge``
    judges one pair with its retry budget (server/judge). ``journal`` (optional, owned by the
    caller) mirrors terminal records, watermarks and kept verdicts to disk; the registry reloads
    them here, so replay, failure records, fencing and verdict reuse survive a restart.
    """

    def __init__(self, cfg: Config, judge: PairJudge, nursery: trio.Nursery,
                 journal: Journal | None = None, observer: CohortObserver | None = None,
                 *, service: trio.Nursery | None = None, tracer: Tracer = NO_TRACER) -> None:
        # `serve` hands over a config resolved at start; a registry built from a plain one
        # (tests, tools) resolves max_active_bytes: auto here, once.
        self._cfg = cfg = memory_limit.resolved(cfg)
        self._max_active_bytes = cfg.max_active_bytes
        # Where the watch timer runs (apart from the cohort tasks); without one, waiters watch
        # their connections from the start.
        self._service = service
        self._observer = observer
        self._tracer = tracer
        self._judge = judge
        self._nursery = nursery
        self._active: dict[identity.CohortKey, Cohort] = {}
        # Cohorts active, as cohort_affinity's endpoint queues read it (judge/endpoints.py).
        self._crowd = Crowd(waits=cfg.judge.engine != "vllm")
        self._active_by_group: dict[str, dict[int, Cohort]] = {}
        self._active_bytes = 0
        self._duplicate_bytes = 0
        # Bytes of answers handed to the connections and not yet taken by their clients
        # (answer_sending / answer_sent): the same budget as members (issue 26).
        self._unsent_bytes = 0
        # Bytes reserved for /verify bodies being read and processed (reserve_body): the same
        # budget again, so that a burst of large bodies cannot arrive at once (issue 26).
        self._body_bytes = 0
        self._refusable_bodies = 0  # reservations that reserve_body could have refused
        # Set (and dropped) when held bytes fall, for bodies waiting for room
        # (reserve_body_within); None while nobody waits.
        self._room: trio.Event | None = None
        self._bodies_waiting = 0
        self._send_timeouts = RateLimitedNote(
            logger, "a client took none of its answer for send_timeout_s: connection reset",
            10.0)
        self._records: OrderedDict[identity.CohortKey, _Record] = OrderedDict()
        self._watermarks: dict[str, _Watermark] = {}
        # Groups with no active cohort, least recently idle first: the only eviction candidates.
        self._idle_groups: OrderedDict[str, None] = OrderedDict()
        ttl = cfg.cohort_result_ttl_s
        self._watermark_ttl_s = None if ttl is None else 2.0 * ttl
        self._watermark_cap = 2 * cfg.max_terminal_cohorts
        self.watermark_visits = 0
        self._waiters = 0
        # Cohorts by the time their waiters start watching connections (open order), and the
        # one task that starts them (_watch_timer, in the `service` nursery).
        self._watch_due: deque[tuple[float, Cohort]] = deque()
        self._watch_queued = trio.Event()
        self._watch_timer_scope: trio.CancelScope | None = None
        self._shutting_down = False
        # Drain (README "Rolling restart"): new cohorts refused with 425 so that a proxy sends
        # them elsewhere; the cohorts open here finish. `_idle` wakes wait_until_idle.
        self._draining = False
        self._idle = trio.Event()
        # Rejoin (README "Rolling restart"): for rejoin_s after start no cohort opens here (425,
        # the proxy sends the member on), and each group refused so is remembered, so that its
        # later members and attempts follow it to the replica that opened it.
        self._rejoin_until = (trio.current_time() + cfg.rejoin_s if cfg.rejoin_s > 0
                              else None)
        self._elsewhere: OrderedDict[object, float] = OrderedDict()
        self._warned_missing_attempt = False
        self.counters: Counter[str] = Counter()
        self._journal = journal
        # Kept verdicts (server/verdicts.py); None with verdict_reuse: off.
        self._verdicts = VerdictCache(cfg, journal) if cfg.verdict_reuse != "off" else None
        # One warm-up judge call per cohort before the rest (_start_ready_pairs).
        # (Only for judge endpoints: the built-in judge and plugins have no prefix cache here.)
        # Not on an engine that shares prefixes between concurrent calls (judge.engine: vllm),
        # and with unknown / sglang only until the first judge answer and once an endpoint has
        # shown it does not (Crowd.waits, set by judge/endpoints.py).
        self._warm_up = (cfg.judge.routing == "cohort_affinity" and bool(cfg.judge.base_urls)
                         and cfg.judge.max_concurrency_per_endpoint is None
                         and cfg.judge.engine != "vllm")
        self._crowded_at = 2 * len(cfg.judge.base_urls)  # as judge/endpoints.py's crowd
        if journal is not None:
            self._reload(journal)

    @classmethod
    @asynccontextmanager
    async def open(cls, cfg: Config, judge: PairJudge, journal: Journal | None = None,
                   observer: CohortObserver | None = None,
                   tracer: Tracer = NO_TRACER) -> AsyncIterator[CohortRegistry]:
        """Open a registry with its own nursery for the lifetime of the block.

        Cohort tasks run in that nursery only; the one watch timer (see
        :meth:`verify_unless_gone`) in a second one beside it. Leaving the block (normally or
        by an exception) fails every active cohort with ``shutdown`` first, so each waiter is
        answered and every cohort task ends promptly; the block then waits for them. Cohort
        failures never propagate out of here (each cohort task contains its own)."""
        async with trio.open_nursery() as service, trio.open_nursery() as nursery:
            registry = cls(cfg, judge, nursery, journal, observer, service=service,
                           tracer=tracer)
            try:
                yield registry
            finally:
                registry.begin_shutdown()

    def _reload(self, journal: Journal) -> None:
        now, wall = trio.current_time(), time.time()
        for stored in journal.records(self._cfg.num_rollouts_per_prompt):
            if stored.expires_wall is None:
                expires_at = math.inf
            else:
                expires_at = now + (stored.expires_wall - wall)
            failure = Failure(**stored.failure) if stored.failure is not None else None
            self._records[stored.key] = _Record(expires_at, stored.digests, stored.rewards,
                                                failure)
        for mark in journal.watermarks():
            self._watermarks[mark.group_id] = _Watermark(
                mark.attempt, mark.prompt_digest, now - (wall - mark.touched_wall),
                mark.finished)
            self._idle_groups[mark.group_id] = None
        verdicts = 0
        if self._verdicts is not None:
            verdicts = self._verdicts.reload(journal, self._cfg.default_score,
                                             self._cfg.default_ranking, now)
        if journal.skipped_rows:
            logger.warning(
                "state journal %s: %d malformed or mismatched rows skipped at reload (a changed "
                "num_rollouts_per_prompt, or a file this version did not write)",
                journal.path, journal.skipped_rows)
        self._prune(now)
        logger.info("state journal %s: %d records, %d watermarks, %d verdicts reloaded",
                    journal.path, len(self._records), len(self._watermarks), verdicts)

    # ------------------------------------------------------------------ public API

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def journal(self) -> Journal | None:
        return self._journal

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Stop opening cohorts: from now on a member that would open a new cohort (a group
        this process holds no active cohort of) is refused with 425 ``draining``, which a proxy
        retries on another replica before any client sees it; members of the cohorts open here,
        replays and recorded failures are answered as before. Synchronous and idempotent; undone
        by :meth:`end_drain`."""
        if not self._draining:
            self._draining = True
            logger.info("drain: new cohorts refused (425 draining), %d open cohorts finish",
                        len(self._active))

    @property
    def rejoining_s(self) -> float:
        """Seconds left of the rejoin window (0 once it is over or when there is none)."""
        if self._rejoin_until is None:
            return 0.0
        left = self._rejoin_until - trio.current_time()
        if left <= 0:
            self._rejoin_until = None
            return 0.0
        return left

    @property
    def groups_elsewhere(self) -> int:
        """Groups remembered as open on another replica (refused here while rejoining)."""
        return len(self._elsewhere)

    def end_rejoin(self) -> None:
        """End the rejoin window now (``POST /admin/ready``); the groups it refused stay
        remembered (their cohorts are open elsewhere)."""
        if self._rejoin_until is not None:
            self._rejoin_until = None
            logger.info("rejoin ended: new cohorts admitted (%d groups stay elsewhere)",
                        len(self._elsewhere))

    def end_drain(self) -> None:
        """Open new cohorts again (``POST /admin/ready``). No effect once shutdown has begun."""
        if self._draining and not self._shutting_down:
            self._draining = False
            logger.info("drain taken back: new cohorts admitted again")

    def longest_open_deadline_s(self) -> float | None:
        """Seconds until the last deadline of the active cohorts (a collecting cohort's is its
        collection deadline plus a whole evaluation timeout; an evaluating one's, its
        evaluation deadline): how long a drain can have to wait for them. None when none is
        active. O(active cohorts); for /status while draining."""
        if not self._active:
            return None
        cfg = self._cfg
        now = trio.current_time()
        ends = (
            (cohort.opened_at + cfg.cohort_collection_timeout_s
             if cohort.evaluating_at is None else cohort.evaluating_at)
            + cfg.cohort_evaluation_timeout_s
            for cohort in self._active.values()
        )
        return max(0.0, max(ends) - now)

    async def wait_until_idle(self) -> None:
        """Return once no cohort is active (at once if none is). Cancellable; wakes when the
        last active cohort retires."""
        while self._active:
            if self._idle.is_set():
                self._idle = trio.Event()
            await self._idle.wait()

    async def verify(self, member: VerifyMember, span: RequestSpan = NO_REQUEST_SPAN) -> Outcome:
        """Admit one member and wait for its cohort's outcome.

        Registration is synchronous. Blocks until the cohort completes or fails (never longer than
        its deadlines). Cancellation (the client went away) removes only this waiter: the member
        stays and the cohort goes on. Returns the member's reward or an explicit failure; never
        raises for a documented condition.
        """
        outcome = await self.verify_unless_gone(member, None, span)
        assert outcome is not None  # only a client_gone wait ends without an outcome
        return outcome

    async def verify_unless_gone(
        self, member: VerifyMember, client_gone: Callable[[], Awaitable[object]] | None,
        span: RequestSpan = NO_REQUEST_SPAN, on_wait: Callable[[], None] | None = None,
    ) -> Outcome | None:
        """:meth:`verify` for an HTTP handler: while the member waits, ``client_gone()`` runs in
        the handler's own task (it reads the connection until the client hangs up) and the
        cohort's resolution interrupts it. Returns the outcome, or None when ``client_gone``
        returned first: then only this waiter was removed, as for a cancelled :meth:`verify`.
        No task is started per waiter. ``client_gone`` runs only once the registry's watch
        timer finds the cohort :data:`DISCONNECT_WATCH_AFTER_S` old (at once for a member that
        joins it later), so a client that hangs up sooner is noticed then; waiters of a cohort
        that resolves sooner wake on its event alone. Without ``client_gone`` (None) it waits
        for the outcome alone. ``span``: the request's span (server/tracing.py), linked with
        its cohort's. ``on_wait``: called once the member waits in its cohort (it counts in the
        registry's own accounting from then on: the HTTP handler releases its body's
        reservation there, so a waiting member never holds room another body needs).

        One coroutine frame for the whole wait (no helpers awaited in between): with thousands
        of members waiting, each frame costs a few hundred bytes per waiter (issue 21)."""
        admitted = self._admit(member)
        if not isinstance(admitted, tuple):
            if (self._journal is not None and (isinstance(admitted, Rewarded)
                                               or admitted.kind not in _UNRECORDED)):
                # Read from a record or watermark: answered once what made it is committed
                # (nothing waits when nothing is queued).
                await self._journal.committed()
            self.counters[_outcome_label(admitted)] += 1
            return admitted
        cohort, slot, duplicate = admitted
        if on_wait is not None:
            on_wait()
        joined = cohort.members[slot]  # its live waiters tell a retry from a sibling
        cohort.trace.joined(span, slot, duplicate)
        # A duplicate holds its own body while it waits: it counts towards max_active_bytes
        # like a member does.
        held = member.size_bytes if duplicate else 0
        self._waiters += 1
        self._duplicate_bytes += held
        joined.waiters += 1
        try:
            if client_gone is None:
                await cohort.done.wait()
            else:
                # A cohort that resolves soon (the common case under load, when the judge is
                # fast and this server's CPU is what counts) wakes its waiters by this one
                # event, the cheapest wake there is. Once the watch timer finds the cohort old
                # enough, its waiters watch their connections, woken by a cancellation of their
                # own scope (which costs trio several times more).
                await cohort.wake.wait()
                if not cohort.done.is_set():
                    with trio.CancelScope() as wake:  # Cohort.release() cancels it
                        cohort.wakers.add(wake)
                        try:
                            await client_gone()
                        finally:
                            cohort.wakers.discard(wake)
                    if not wake.cancelled_caught:
                        return None  # the client went away first
        finally:
            self._waiters -= 1
            self._duplicate_bytes -= held
            joined.waiters -= 1
            if held:
                self._room_freed()
        return self._outcome(cohort, slot)

    def answer_sending(self, size: int) -> None:
        """``size`` bytes of an answer are being written to a client: they count towards
        ``max_active_bytes`` until :meth:`answer_sent` (called with the same size once the
        send has returned, whatever ended it). Synchronous."""
        self._unsent_bytes += size

    def answer_sent(self, size: int) -> None:
        self._unsent_bytes -= size
        self._room_freed()

    def _room_freed(self) -> None:
        """Held bytes fell: wake the bodies waiting for room (:meth:`reserve_body_within`)."""
        room = self._room
        if room is not None:
            self._room = None
            room.set()

    def reserve_body(self, size: int, *, refusable: bool = True,
                     more: bool = False) -> Failure | None:
        """Reserve ``size`` bytes of ``max_active_bytes`` for a request body about to be read
        and processed (what it will hold: the body, its decoded member, its answer); None once
        reserved, held until :meth:`release_body` with the same arguments. A 429
        ``overloaded`` (counted, nothing reserved, no other state changed) when ``refusable``,
        another refusable body holds a reservation already, and the bytes held (members,
        waiting duplicates, unsent answers, reserved bodies) plus ``size`` would pass the
        budget. The one exemption, a refusable body admitted while no other is reserved, keeps
        a body larger than the whole budget servable (a member of an open cohort among them)
        and guarantees progress; the process then passes the budget by at most that one
        body's share. Not while unsent answers would pass the budget with it: they drain by
        themselves, so it waits for them (:meth:`reserve_body_within`; 100 slow readers of
        8 MB answers held 31 MB more than the budget through it). ``more``: more bytes of a
        body that holds a refusable reservation already (chunked, as they arrive; released
        with it, in one :meth:`release_body`).
        Synchronous."""
        if not self._body_fits(size, refusable, more):
            return self._body_refused(size)
        self._body_bytes += size
        self._refusable_bodies += refusable and not more
        return None

    async def reserve_body_within(self, size: int, deadline: float) -> Failure | None:
        """:meth:`reserve_body` of a refusable body's first reservation, waiting until
        ``deadline`` for room (held bytes fall as other bodies are processed, answers are taken
        and cohorts end) instead of refusing at once: a member of an open cohort that arrives
        beside another large body gets in. The 429 once ``deadline`` passes with no room."""
        while not self._body_fits(size, True, False):
            if trio.current_time() >= deadline:
                return self._body_refused(size)
            if self._room is None:
                self._room = trio.Event()
            self._bodies_waiting += 1
            try:
                with trio.move_on_at(deadline):
                    await self._room.wait()
            finally:
                self._bodies_waiting -= 1
        return self.reserve_body(size)

    def _body_fits(self, size: int, refusable: bool, more: bool) -> bool:
        limit = self._max_active_bytes
        if not refusable or limit is None or self._held_bytes() + size <= limit:
            return True
        if self._refusable_bodies > int(more):
            return False
        # The lone refusable body is let past the budget, so that members of open cohorts
        # (which hold their bytes until their cohorts end) never starve it: but not past
        # what unsent answers hold, which drain by themselves (their clients read, or
        # send_timeout_s ends them), when the two together would pass it.
        return more or self._unsent_bytes == 0 or self._unsent_bytes + size <= limit

    def _body_refused(self, size: int) -> Failure:
        self.counters["body_refusals"] += 1
        return _overloaded(
            f"max_active_bytes ({self._max_active_bytes}) reached: this body needs {size} "
            f"bytes of it while it is read and processed, {self._held_bytes()} are held")

    def release_body(self, size: int, *, refusable: bool = True) -> None:
        self._body_bytes -= size
        self._refusable_bodies -= refusable
        self._room_freed()

    def _held_bytes(self) -> int:
        return (self._active_bytes + self._duplicate_bytes + self._unsent_bytes
                + self._body_bytes)

    def send_timed_out(self) -> None:
        """A connection was reset because its client took nothing for ``send_timeout_s``
        (counted; logged at most once per 10 s). Synchronous."""
        self.counters["send_timeouts"] += 1
        self._send_timeouts.note()

    def _over_budget(self) -> bool:
        held = self._active_bytes + self._duplicate_bytes + self._unsent_bytes
        return self._max_active_bytes is not None and held >= self._max_active_bytes

    def _outcome(self, cohort: Cohort, slot: int) -> Outcome:
        """A released waiter's outcome (counted once per waiter)."""
        outcome: Outcome | None = cohort.failure
        if outcome is None:
            reward = cohort.rewards[slot]
            assert reward is not None  # only present members wait on a cohort
            outcome = Rewarded(reward, cohort.defaulted, cohort.size, cohort.scored_count,
                               cohort.reused, slot)
        self.counters[_outcome_label(outcome)] += 1
        return outcome

    def begin_shutdown(self) -> None:
        """Refuse new requests and fail every active cohort with ``shutdown`` (each waiter gets
        its 503). Synchronous and idempotent."""
        if self._shutting_down:
            return
        self._shutting_down = True
        if self._watch_timer_scope is not None:
            self._watch_timer_scope.cancel()
        self._watch_due.clear()
        self._tracer.shutdown_began(len(self._active), self._waiters)
        failure = Failure(503, "shutdown", "the server is shutting down")
        for cohort in list(self._active.values()):
            self._fail(cohort, failure)
        self._prune(trio.current_time())  # watermarks of groups that just went idle
        logger.info("shutdown: all active cohorts failed, new requests refused")

    def snapshot(self) -> dict[str, int]:
        """Counts for leak checks and /status: active cohorts by phase, waiters, records."""
        collecting = sum(1 for c in self._active.values() if c.phase is Phase.COLLECTING)
        return {
            "active_cohorts": len(self._active),
            "collecting": collecting,
            "evaluating": len(self._active) - collecting,
            "waiters": self._waiters,
            "retained_records": len(self._records),
            "watermarks": len(self._watermarks),
            "active_bytes": self._active_bytes + self._duplicate_bytes,
            "unsent_answer_bytes": self._unsent_bytes,
            "body_bytes": self._body_bytes,
            "bodies_waiting": self._bodies_waiting,
            "body_refusals": self.counters["body_refusals"],
            "send_timeouts": self.counters["send_timeouts"],
        }

    def retention(self) -> dict[str, dict[str, Any]]:
        """For ``/status``: every structure of the registry that grows with requests, its size
        and its bound (``cap``: a count, ``ttl_s``: an age; None where the config leaves it
        unlimited). Synchronous, O(1)."""
        cfg = self._cfg
        return {
            "records": {"count": len(self._records), "cap": cfg.max_terminal_cohorts,
                        "ttl_s": cfg.cohort_result_ttl_s},
            # Idle groups' watermarks are capped; active groups' ones go with their cohorts.
            "idle_watermarks": {"count": len(self._idle_groups), "cap": self._watermark_cap,
                                "ttl_s": self._watermark_ttl_s},
            "active_groups": {"count": len(self._active_by_group),
                              "cap": cfg.max_active_cohorts, "ttl_s": None},
            "active_cohorts": {"count": len(self._active), "cap": cfg.max_active_cohorts,
                               "ttl_s": cfg.cohort_collection_timeout_s
                               + cfg.cohort_evaluation_timeout_s},
            "watch_queue": {"count": len(self._watch_due), "cap": None,
                            "ttl_s": DISCONNECT_WATCH_AFTER_S + _WATCH_SLACK_S},
            "counters": {"count": len(self.counters), "cap": None, "ttl_s": None},
            "verdicts": {"count": len(self._verdicts or ()),
                         "cap": cfg.verdict_cache_max_entries if self._verdicts else 0,
                         "ttl_s": cfg.cohort_result_ttl_s},
        }

    def verdict_status(self) -> dict[str, Any]:
        """For ``/status``: verdict reuse's mode, the kept verdicts and their cap and TTL, and
        how many comparisons were reused and judged so far."""
        cache = self._verdicts
        status = cache.status() if cache is not None else {
            "mode": "off", "entries": 0, "cap": 0, "ttl_s": None}
        status["reused_comparisons"] = self.counters["comparisons_reused"]
        status["judged_comparisons"] = self.counters["comparisons_judged"]
        return status

    # ------------------------------------------------------------------ admission

    def _admit(self, member: VerifyMember) -> Outcome | tuple[Cohort, int, bool]:
        """Synchronous admission: an outcome now, or ``(cohort, slot, duplicate)`` to wait
        on."""
        cfg = self._cfg
        now = trio.current_time()
        self._prune(now)
        if self._shutting_down:
            if self._draining:  # a drain's end: a proxy still sends it elsewhere
                return self._refuse_draining()
            return Failure(503, "shutdown", "the server is shutting down")
        fields = member.fields()  # decoded again here; not kept (see VerifyMember)
        prompt_input = fields.responses_create_params.get("input")
        prompt_digest = identity.prompt_digest(prompt_input, fields.principle)
        group_id = member.group_id
        attempt = member.attempt
        if group_id is not None:
            if not member.attempt_given and not self._warned_missing_attempt:
                self._warned_missing_attempt = True
                logger.warning(
                    "a request with _ng_group_id has no _ng_group_attempt: treated as attempt 0 "
                    "(logged once per process)"
                )
            key = identity.explicit_key(group_id, attempt)
            watermark = self._watermarks.get(group_id)
            if watermark is not None:
                if attempt < watermark.attempt:
                    return Failure(
                        409, "stale_attempt",
                        f"group {_short(group_id)!r}: attempt {attempt} is older than the newest "
                        f"attempt seen ({watermark.attempt})",
                    )
                if prompt_digest != watermark.prompt_digest:
                    return Failure(
                        409, "prompt_mismatch",
                        f"group {_short(group_id)!r}: prompt or principle differs from the "
                        f"group's newest attempt ({watermark.attempt})",
                    )
        elif member.key_scope is not None:
            key = identity.scoped_key(member.key_scope, prompt_digest, attempt)
            watermark = None
        else:
            key = identity.legacy_key(fields.task_index, fields.prompt_id, prompt_digest, attempt)
            watermark = None
        # A prompt-keyed cohort whose members may come without a slot (see Cohort.by_arrival).
        by_arrival = group_id is None and (
            cfg.legacy_slots == "arrival" or member.key_scope is not None)

        slot = member.rollout_index or 0
        digest = identity.response_digest(fields.response)

        record = self._records.get(key)
        if record is not None and by_arrival:
            replayed = self._replay_arrival(key, record, member.rollout_index, digest, now)
            if replayed is not None:
                return replayed
            record = None  # a new round of this prompt: the record was dropped
        if record is not None:
            # A replay's answer echoes its body (a reward or a masked failure): past the
            # budget it waits for room like a new cohort does (a 429 changes no state).
            if record.failure is not None:
                if record.failure.masked and self._over_budget():
                    return _overloaded(self._budget_reached())
                return record.failure
            recorded, reward = record.digests[slot], record.rewards[slot]
            if recorded is None or reward is None:
                return _closed(key, slot, record.scored, len(record.digests))
            if recorded != digest:
                return _conflict(key, slot, "the completed cohort")
            if self._over_budget():
                return _overloaded(self._budget_reached())
            return Rewarded(reward, record.defaulted, len(record.digests), record.scored,
                            record.reused, slot)

        cohort = self._active.get(key)
        if cohort is not None:
            if cohort.prompt_digest != prompt_digest:
                return Failure(
                    409, "prompt_mismatch",
                    f"{identity.describe(key)}: prompt or principle differs from the cohort's",
                )
            if member.rollout_index is None and cohort.size > 1:
                return self._arrive(cohort, digest, member)
            existing = cohort.members.get(slot)
            if existing is not None:
                if existing.digest != digest:
                    return _conflict(key, slot, f"the {cohort.phase.value} cohort")
                return cohort, slot, True
            if cohort.scored is not None:  # judged over the members present, without this slot
                return _closed(key, slot, len(cohort.scored), cohort.size)
            self._add_member(cohort, slot, digest, member)
            return cohort, slot, False

        if (watermark is not None and watermark.attempt == attempt and watermark.finished):
            # This attempt finished here and its record has since expired: waiting out a fresh
            # collection deadline could never give the caller its answer.
            self.counters["result_expired"] += 1
            return Failure(
                409, "result_expired",
                f"group {_short(group_id or '')!r}: attempt {attempt} already finished and its "
                "record is no longer retained; resend the complete group with a higher "
                "_ng_group_attempt",
            )

        # A new cohort. A draining process opens none, except a newer attempt of a group whose
        # cohort it holds (that group is still this replica's). A refusal changes no state.
        if self._draining and (group_id is None or group_id not in self._active_by_group):
            return self._refuse_draining()
        # A rejoining process (rejoin_s after start) opens none either: the group may be open on
        # the replica that took this one's groups while it was away; so is a group it refused
        # so before, for as long as that cohort can stay open there.
        elsewhere = group_id if group_id is not None else key
        if self.rejoining_s > 0 or self._open_elsewhere(elsewhere, now):
            self._note_elsewhere(elsewhere, now)
            return self._refuse_draining()
        # Admission control first: a refusal changes no state.
        if cfg.max_active_cohorts is not None and len(self._active) >= cfg.max_active_cohorts:
            return _overloaded(f"max_active_cohorts ({cfg.max_active_cohorts}) reached")
        if self._over_budget():
            return _overloaded(self._budget_reached())
        if group_id is not None:
            self._advance_watermark(group_id, attempt, prompt_digest, now, watermark)
        cohort = self._open(key, prompt_input, fields.principle, prompt_digest, now)
        cohort.by_arrival = by_arrival
        self._add_member(cohort, slot, digest, member)
        return cohort, slot, False

    def _arrive(self, cohort: Cohort, digest: str,
                member: VerifyMember) -> Outcome | tuple[Cohort, int, bool]:
        """Admit a member that came without a slot into its active prompt-keyed cohort.

        A client's retry and a sibling with the same text look alike (a low-temperature group
        can hold two identical answers), so the registry goes by who is waiting: an identical
        body re-attaches to a member with that digest whose every request has gone away (the
        client timed out or lost its connection, then re-sent); while each such member still
        has a live waiter, the body is a new sibling and takes the lowest free slot. A retry
        that arrives before the registry noticed its earlier connection go (see
        :meth:`verify_unless_gone`: a gone client is noticed once its cohort is
        :data:`DISCONNECT_WATCH_AFTER_S` old, at once after that) is therefore counted as a
        sibling; to keep that window short, an identical arrival makes the cohort's waiters
        watch their connections at once. Once the cohort holds N members (it is being judged)
        an identical body can only be a re-send: it re-attaches to the first member with that
        digest; a different one is beyond N: 409 ``cohort_full``, or 409 ``cohort_closed``
        for a cohort judged over the members present. Synchronous."""
        twins = [slot for slot, m in cohort.members.items() if m.digest == digest]
        for slot in twins:
            if cohort.members[slot].waiters == 0:
                self.counters["arrival_reattached"] += 1
                return cohort, slot, True
        if cohort.phase is Phase.COLLECTING and cohort.scored is None:
            slot = next(s for s in range(cohort.size) if s not in cohort.members)
            if twins:
                self.counters["arrival_identical_siblings"] += 1
                cohort.start_watching()
            self._add_member(cohort, slot, digest, member)
            return cohort, slot, False
        if twins:
            self.counters["arrival_reattached"] += 1
            return cohort, twins[0], True
        if cohort.scored is not None:
            return _closed(cohort.key, None, len(cohort.scored), cohort.size)
        self.counters["arrival_beyond_n"] += 1
        return Failure(
            409, "cohort_full",
            f"{identity.describe(cohort.key)}: all {cohort.size} slots already hold other "
            "responses (a member beyond num_rollouts_per_prompt: the group has more samples "
            "than num_rollouts_per_prompt, or a retry was counted as a sibling); it gets no "
            "reward",
        )

    def _replay_arrival(self, key: identity.CohortKey, record: _Record, index: int | None,
                        digest: str, now: float) -> Outcome | None:
        """A member of a prompt-keyed arrival cohort that has a retained record: the record's
        answer for a member it holds (same digest; at the sent slot when one was sent): an
        identical re-send replays. A member it does not hold: within the late-member window
        (``cohort_collection_timeout_s`` after the cohort ended) a cohort judged without it
        answers 409 ``cohort_closed`` and a failed one its failure, never a cohort of its own;
        a completed full cohort, or any record past the window, is an older round of the same
        prompt: the record is dropped and None returned (the caller opens a new cohort).
        Synchronous."""
        if index is not None:
            slot = index if index < len(record.digests) and record.digests[index] == digest \
                else None
        else:
            slot = next((s for s, d in enumerate(record.digests) if d == digest), None)
        if slot is not None:
            if record.failure is not None:
                return record.failure
            reward = record.rewards[slot]
            assert reward is not None  # a slot with a digest was judged
            return Rewarded(reward, record.defaulted, len(record.digests), record.scored,
                            record.reused, slot)
        full = record.failure is None and record.scored == len(record.digests)
        if not full and now < record.closed_at + self._cfg.cohort_collection_timeout_s:
            if record.failure is not None:
                return record.failure
            return _closed(key, index, record.scored, len(record.digests))
        del self._records[key]
        if self._journal is not None and record.failure is not None:
            self._journal.delete_records([key])
        self.counters["arrival_new_rounds"] += 1
        return None



    def _budget_reached(self) -> str:
        detail = f"max_active_bytes ({self._max_active_bytes}) reached"
        if self._unsent_bytes:
            detail += f" ({self._unsent_bytes} of them answers not yet taken by their clients)"
        return detail

    def _open_elsewhere(self, group: object, now: float) -> bool:
        expires = self._elsewhere.get(group)
        if expires is None:
            return False
        if expires <= now:
            del self._elsewhere[group]
            return False
        return True

    def _note_elsewhere(self, group: object, now: float) -> None:
        """Remember ``group`` as open on another replica for as long as a cohort can stay open
        (collection plus evaluation timeouts from now); at most :data:`MAX_GROUPS_ELSEWHERE`,
        the oldest forgotten first."""
        cfg = self._cfg
        self._elsewhere[group] = (now + cfg.cohort_collection_timeout_s
                                  + cfg.cohort_evaluation_timeout_s)
        self._elsewhere.move_to_end(group)
        while len(self._elsewhere) > MAX_GROUPS_ELSEWHERE:
            self._elsewhere.popitem(last=False)

    def _refuse_draining(self) -> Failure:
        self.counters["drain_refused"] += 1
        return _draining_failure()

    def _advance_watermark(
        self, group_id: str, attempt: int, prompt_digest: str, now: float,
        watermark: _Watermark | None,
    ) -> None:
        """A new cohort of ``group_id`` opens at ``attempt`` (>= the watermark's). The journal is
        written before memory changes; a failed write degrades it and memory stays the truth."""
        if watermark is None:
            if self._journal is not None:
                self._journal.put_watermark(group_id, attempt, prompt_digest, time.time())
            self._watermarks[group_id] = _Watermark(attempt, prompt_digest, now)
            return
        if attempt > watermark.attempt:
            if self._journal is not None:
                self._journal.put_watermark(group_id, attempt, prompt_digest, time.time())
            watermark.attempt = attempt
            watermark.finished = False
            older = self._active_by_group.get(group_id, {})
            for old in [c for a, c in older.items() if a < attempt]:
                self._fail(old, Failure(
                    503, "superseded",
                    f"group {_short(group_id)!r}: attempt {old.key.attempt} was superseded by "
                    f"attempt {attempt}",
                ))

    def _open(
        self, key: identity.CohortKey, prompt_input: Any, principle: str | None,
        prompt_digest: str, now: float,
    ) -> Cohort:
        cfg = self._cfg
        judge_principle = (principle or cfg.default_principle) if cfg.use_principle else None
        cohort = Cohort(
            key, cfg.num_rollouts_per_prompt, prompt_digest,
            scoring.conversation_history(prompt_input), judge_principle,
            scoring.comparison_pairs(
                cfg.num_rollouts_per_prompt, cfg.comparison_strategy,
                cfg.num_judges_per_comparison,
            ),
            now,
        )
        cohort.trace = self._tracer.cohort(identity.describe(key), key.group_id, key.attempt,
                                           cohort.size)
        cohort.judge_affinity = Affinity(self._crowd)
        self._active[key] = cohort
        self._crowd.cohorts = len(self._active)
        if key.group_id is not None:
            self._active_by_group.setdefault(key.group_id, {})[key.attempt] = cohort
            self._idle_groups.pop(key.group_id, None)  # active groups are never evicted
        self.counters["cohorts_opened"] += 1
        self._nursery.start_soon(self._run_cohort, cohort)
        if self._service is None:
            cohort.start_watching()
            return cohort
        self._watch_due.append((now + DISCONNECT_WATCH_AFTER_S, cohort))
        self._watch_queued.set()
        if self._watch_timer_scope is None:
            self._watch_timer_scope = trio.CancelScope()
            self._service.start_soon(self._watch_timer, self._watch_timer_scope)
        return cohort

    async def _watch_timer(self, scope: trio.CancelScope) -> None:
        """Start the connection watch of each cohort still active when it is due (see
        :meth:`verify_unless_gone`). One task for the registry, sleeping until the next due
        cohort; ended by :meth:`begin_shutdown`."""
        with scope:
            while True:
                if not self._watch_due:
                    self._watch_queued = trio.Event()
                    await self._watch_queued.wait()
                    continue
                await trio.sleep_until(self._watch_due[0][0])
                horizon = trio.current_time() + _WATCH_SLACK_S
                while self._watch_due and self._watch_due[0][0] <= horizon:
                    _, cohort = self._watch_due.popleft()
                    if cohort.phase in ACTIVE_PHASES:
                        cohort.start_watching()

    def _add_member(self, cohort: Cohort, slot: int, digest: str, member: VerifyMember) -> None:
        cohort.members[slot] = _Member(digest, member.raw, member.rollout_id)
        cohort.size_bytes += member.size_bytes
        self._active_bytes += member.size_bytes
        cohort.arrival.set()
        if len(cohort.members) == cohort.size and self._transition(cohort, Phase.EVALUATING):
            cohort.evaluating_at = trio.current_time()
            cohort.trace.collected()

    def _transition(self, cohort: Cohort, new: Phase) -> bool:
        """The one place a phase changes: compare-and-set against the allowed transitions.
        Returns False (and changes nothing) when the cohort is not in a phase that may move to
        ``new``, e.g. a judge result or a deadline that lost a race to a failure."""
        if new not in _TRANSITIONS[cohort.phase]:
            return False
        cohort.phase = new
        return True

    # ------------------------------------------------------------------ the cohort task

    async def _run_cohort(self, cohort: Cohort) -> None:
        """The cohort's own task and its containment boundary. Whatever ends it, the cohort is
        terminal when it returns, and no exception other than a cancellation from above leaves
        it."""
        try:
            await self._drive(cohort)
        except Exception as exc:
            self._crashed(cohort, exc)
        except BaseExceptionGroup as group:  # errors mixed with a cancellation from above
            errors, rest = group.split(Exception)
            if errors is not None:
                self._crashed(cohort, errors)
            if rest is not None:
                raise rest from None
        finally:
            if cohort.phase in ACTIVE_PHASES:
                # Cancelled from above (the registry's nursery is going away).
                kind = "shutdown" if self._shutting_down else "cancelled"
                self._fail(cohort, Failure(503, kind, f"evaluation was cancelled ({kind})"))

    def _crashed(self, cohort: Cohort, exc: BaseException) -> None:
        logger.error("%s: cohort task crashed; this cohort alone fails",
                     identity.describe(cohort.key), exc_info=exc)
        self.counters["cohort_task_crashes"] += 1
        self._fail(cohort, self._failure(
            cohort, 503, "evaluation_error",
            f"evaluation failed: {type(exc).__name__}: {bound_text(str(exc), 300)}"))

    async def _drive(self, cohort: Cohort) -> None:
        """Collection deadline, then judging under the evaluation deadline, then publishing."""
        cfg = self._cfg
        eager = cfg.judge_schedule == "eager"
        with cohort.scope:
            async with trio.open_nursery() as pair_nursery:
                with trio.move_on_after(cfg.cohort_collection_timeout_s):
                    while cohort.phase is Phase.COLLECTING:
                        if eager:
                            self._start_ready_pairs(cohort, pair_nursery)
                        cohort.arrival = trio.Event()
                        await cohort.arrival.wait()
                if cohort.phase is Phase.COLLECTING and not self._judge_present(cohort):
                    self._fail(cohort, self._incomplete(cohort))
                    return
                if cohort.phase is not Phase.EVALUATING:
                    return
                # The evaluation deadline is the pair nursery's own: every judge call runs
                # inside it, so the judge sees it (a Retry-After beyond it fails at once).
                pair_nursery.cancel_scope.deadline = (
                    trio.current_time() + cfg.cohort_evaluation_timeout_s)
                cohort.trace.evaluation_started(len(cohort.pairs) - len(cohort.started_pairs))
                self._start_ready_pairs(cohort, pair_nursery)
                await cohort.pairs_done.wait()
                pair_nursery.cancel_scope.cancel()  # all done: nothing is left to stop
        # Outside the pair nursery: aggregation errors are this task's own, never a group.
        if cohort.phase is not Phase.EVALUATING:
            return
        if cohort.pairs_done.is_set():
            self._publish(cohort)
        elif pair_nursery.cancel_scope.cancelled_caught:  # the evaluation deadline passed
            self._fail(cohort, self._judge_failure(
                cohort,
                f"evaluation deadline of {cfg.cohort_evaluation_timeout_s:g} s "
                f"exceeded with {len(cohort.results)} of {len(cohort.pairs)} "
                "comparisons done",
            ))

    def _judge_present(self, cohort: Cohort) -> bool:
        """At the collection deadline with slots missing: under ``incomplete_cohort_policy:
        judge_present``, an explicit group with at least ``min_cohort_members`` distinct slots
        is moved to evaluating over exactly the members present. Its comparisons are planned
        again over them, in slot order, with the configured strategy; comparisons already
        started (eager) that the new plan has are kept, the others cancelled and counted as
        wasted. Synchronous. Returns False when the cohort must fail as incomplete."""
        cfg = self._cfg
        if (cfg.incomplete_cohort_policy != "judge_present"
                or (cohort.legacy and not cohort.by_arrival)
                or len(cohort.members) < min_members_present(cfg)):
            return False
        present = tuple(sorted(cohort.members))
        plan = self._plan_present(present)
        if not self._transition(cohort, Phase.EVALUATING):
            return False
        cohort.evaluating_at = trio.current_time()
        cohort.scored = present
        dropped = cohort.started_pairs.difference(plan)
        for pair in dropped:
            scope = cohort.pair_scopes.pop(pair, None)
            if scope is not None:
                scope.cancel()
            cohort.results.pop(pair, None)
        cohort.started_pairs -= dropped
        cohort.dropped_pairs = len(dropped)
        self.counters["comparisons_wasted"] += len(dropped)
        cohort.pairs = plan
        if len(cohort.results) == len(plan):
            cohort.pairs_done.set()
        return True

    def _plan_present(self, present: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """The comparisons of a partial cohort: the configured strategy over the M slots
        ``present`` (in slot order), as slot triples. With ``circular`` and ``all_pairs`` every
        early pair of two present members is in it (consecutive slots stay consecutive among
        the present ones), so eager verdicts are dropped only by a plan that leaves one out."""
        cfg = self._cfg
        return [(present[a], present[b], k) for a, b, k in scoring.comparison_pairs(
            len(present), cfg.comparison_strategy, cfg.num_judges_per_comparison)]

    def _start_ready_pairs(self, cohort: Cohort, nursery: trio.Nursery) -> None:
        """Start every comparison whose members are present and that has no verdict yet, in
        prefix order (calls sharing the longest prefix back to back); a pair with a kept verdict
        (verdict reuse) takes it at once instead of a judge call. With ``judge.routing:
        cohort_affinity``, no ``judge.max_concurrency_per_endpoint`` and at least two active
        cohorts per judge endpoint, the first judge call goes alone, a warm-up: the rest follow
        once it has ended (:meth:`_judge_one`), so they find its prefix in the engine's cache
        instead of all computing it at once (with fewer cohorts nothing else would use the
        judges meanwhile). With per-endpoint slots the endpoint's queue does that
        (server/judge/endpoints.py)."""
        members = cohort.members
        results = cohort.results
        cache = self._verdicts
        now = trio.current_time()
        # The warm-up pays only while other cohorts' calls keep the judges busy meanwhile.
        warm_up = (self._warm_up and self._crowd.waits
                   and len(self._active) >= self._crowded_at)
        for place, index in enumerate(scoring.prefix_order(cohort.pairs)):
            if warm_up and len(cohort.started_pairs) > cohort.reused and not (
                    len(results) > cohort.reused):
                break  # the warm-up call is in flight
            pair = cohort.pairs[index]
            i, j, judge_idx = pair
            if pair in cohort.started_pairs or i not in members or j not in members:
                continue
            # Built now: the task may first run after the cohort failed and dropped its members.
            request = JudgeRequest(
                history=cohort.history,
                response_1=members[i].answer,
                response_2=members[j].answer,
                principle=cohort.principle,
                judge_idx=judge_idx,
                place=place,
            )
            key = None
            if cache is not None:
                if cohort.verdict_prefix is None:
                    cohort.verdict_prefix = cache.prefix(cohort.key, cohort.principle,
                                                         cohort.history)
                key = identity.verdict_key(cohort.verdict_prefix, judge_idx,
                                           request.response_1, request.response_2)
                kept = cache.get(key, now)
                if kept is not None:
                    cohort.started_pairs.add(pair)  # started and done: no judge call
                    results[pair] = kept
                    cohort.reused += 1
                    self.counters["comparisons_reused"] += 1
                    continue
            cohort.started_pairs.add(pair)
            self.counters["comparisons_started"] += 1
            # Made here, not in the task: a re-plan may cancel it before the task first runs.
            scope = cohort.pair_scopes[pair] = trio.CancelScope()
            nursery.start_soon(self._judge_one, cohort, pair, request, scope, nursery, key)
        if cohort.pairs and len(results) == len(cohort.pairs):  # every verdict was kept
            cohort.pairs_done.set()

    async def _judge_one(self, cohort: Cohort, pair: tuple[int, int, int], request: JudgeRequest,
                         scope: trio.CancelScope, nursery: trio.Nursery,
                         key: bytes | None = None) -> None:
        """Judge one pair for ``cohort``; with ``key`` (verdict reuse on), keep a parsed
        verdict under it at once, whatever becomes of the cohort: a replacement attempt after
        a sibling's failure then re-judges only what is missing."""
        try:
            with scope:
                verdict = await self._judge.judge_pair(request, cohort, cohort.trace)
            if scope.cancelled_caught:  # dropped by a re-plan (counted as wasted there)
                return
        except JudgeFailed as exc:
            cohort.input_tokens += exc.input_tokens
            cohort.output_tokens += exc.output_tokens
            cohort.cached_tokens += exc.cached_tokens
            self._fail(cohort, self._judge_failure(cohort, str(exc)))
            return
        except Exception as exc:  # task boundary: any other error fails this cohort only
            logger.exception("%s: judge task crashed", identity.describe(cohort.key))
            self._fail(cohort, self._failure(
                cohort, 503, "evaluation_error", f"judging failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            if cohort.pair_scopes.get(pair) is scope:
                del cohort.pair_scopes[pair]
        cohort.input_tokens += verdict.input_tokens
        cohort.output_tokens += verdict.output_tokens
        cohort.cached_tokens += verdict.cached_tokens
        self.counters["comparisons_judged"] += 1
        if key is not None and self._verdicts is not None:
            self._verdicts.put(key, verdict, trio.current_time())
        if cohort.phase in ACTIVE_PHASES and pair in cohort.started_pairs:
            cohort.results[pair] = verdict
            if len(cohort.results) == len(cohort.pairs):
                cohort.pairs_done.set()
            elif (len(cohort.results) - cohort.reused == 1 and self._warm_up
                  and len(cohort.started_pairs) - cohort.reused == 1):
                self._start_ready_pairs(cohort, nursery)  # the warm-up ended: fan out

    def _publish(self, cohort: Cohort) -> None:
        """Aggregate over the members judged (all N, or a partial cohort's present ones, in
        slot order: penalties and bonuses are centred over them) and publish by slot."""
        scored = cohort.scored if cohort.scored is not None else tuple(range(cohort.size))
        position = {slot: p for p, slot in enumerate(scored)}
        comparisons = [
            scoring.Comparison(
                response_i=position[i], response_j=position[j], judge_idx=k, score_1=v.score_1,
                score_2=v.score_2, ranking=v.ranking,
            )
            for (i, j, k) in cohort.pairs
            for v in (cohort.results[(i, j, k)],)
        ]
        responses = [cohort.members[slot].response for slot in scored]
        try:
            rewards, _ = scoring.aggregate(comparisons, responses, self._cfg,
                                           with_metrics=False)
            if len(rewards) != len(scored) or not all(math.isfinite(r) for r in rewards):
                raise GenRMError(f"aggregation gave {rewards!r} for {len(scored)} rollouts")
        except GenRMError as exc:  # anything else is a bug: the task boundary logs it
            self._fail(cohort, self._failure(
                cohort, 503, "evaluation_error", f"reward aggregation failed: {exc}"))
            return
        by_slot: list[float | None] = [None] * cohort.size
        digests: list[str | None] = [None] * cohort.size
        for slot, reward in zip(scored, rewards, strict=True):
            by_slot[slot] = float(reward)
            digests[slot] = cohort.members[slot].digest
        if not self._transition(cohort, Phase.COMPLETED):
            return
        cohort.rewards = tuple(by_slot)
        cohort.digests = tuple(digests)
        cohort.defaulted = sum(1 for v in cohort.results.values() if v.defaulted)
        shown = [None if r is None else round(r, 4) for r in cohort.rewards[:16]]
        if cohort.scored is None:
            self._disposed(cohort, "completed",
                           f"rewards {shown}; "
                           f"{cohort.defaulted} of {len(cohort.pairs)} comparisons defaulted")
        else:
            self.counters["cohorts_partial"] += 1
            self._disposed(cohort, "partial",
                           f"rewards by slot {shown} (missing slots: "
                           f"{_slots(s for s in range(cohort.size) if s not in position)}); "
                           f"{cohort.defaulted} of {len(cohort.pairs)} comparisons defaulted, "
                           f"{cohort.dropped_pairs} early ones dropped by the re-plan")
        if self._observer is not None:
            self._observer.cohort_scored(cohort.size, len(scored))
        kept = self._retire(cohort)
        self.counters["cohorts_completed"] += 1
        self._release(cohort, kept)

    # ------------------------------------------------------------------ failure & retention

    def _fail(self, cohort: Cohort, failure: Failure) -> bool:
        """Compare-and-set to FAILED; releases every waiter with ``failure`` and cancels the
        cohort's pending work. Returns False if the cohort was already terminal."""
        if not self._transition(cohort, Phase.FAILED):
            return False
        cohort.failure = failure
        # Judge calls already started (finished or still in flight) are lost with the cohort.
        self.counters["comparisons_wasted"] += len(cohort.started_pairs) - cohort.reused
        self._disposed(cohort, failure.kind, bound_text(failure.detail, 300))
        kept = self._retire(cohort)
        self.counters[f"cohorts_failed_{failure.kind}"] += 1
        self._release(cohort, kept)
        cohort.scope.cancel()
        return True

    def _disposed(self, cohort: Cohort, kind: str, detail: str) -> None:
        """The one log line per cohort disposition (structured fields for JSON logs), and the
        observer's durations. Called at the terminal transition, before members are dropped."""
        now = trio.current_time()
        evaluating_at = cohort.evaluating_at
        collection_s = (now if evaluating_at is None else evaluating_at) - cohort.opened_at
        evaluation_s = None if evaluating_at is None else now - evaluating_at
        key = identity.describe(cohort.key)  # bounded, control characters escaped
        if kind == "completed":
            status = "completed"
        elif kind == "partial":
            status = f"completed partial ({cohort.scored_count} of {cohort.size} members)"
        else:
            status = f"failed ({kind})"
        judged = len(cohort.results) - cohort.reused
        fields: dict[str, Any] = {
            "event": "cohort", "key": key, "kind": kind, "attempt": cohort.key.attempt,
            "members": len(cohort.members), "size": cohort.size,
            # Judged over the members present (incomplete_cohort_policy: judge_present).
            **({} if cohort.scored is None else {"partial": True, "scored": len(cohort.scored)}),
            "total_s": round(now - cohort.opened_at, 6),
            "collection_s": round(collection_s, 6),
            "evaluation_s": None if evaluation_s is None else round(evaluation_s, 6),
            "judge_calls": len(cohort.started_pairs) - cohort.reused,
            "judge_results": judged,
            "reused_comparisons": cohort.reused,
            "defaulted_comparisons": cohort.defaulted,
            "judge_input_tokens": cohort.input_tokens,
            "judge_output_tokens": cohort.output_tokens,
            "judge_cached_tokens": cohort.cached_tokens,
            **_rollout_ids(cohort),
        }
        logger.info(
            "%s %s after %.3f s: %s; comparisons %d judged, %d reused; judge tokens %d in, "
            "%d out, %d cached", key, status, now - cohort.opened_at, detail, judged,
            cohort.reused, cohort.input_tokens, cohort.output_tokens, cohort.cached_tokens,
            extra=fields,
        )
        cohort.trace.disposed(kind, fields)
        if self._observer is not None:
            self._observer.cohort_done(kind, collection_s, evaluation_s,
                                       cohort.scored is not None)

    def _release(self, cohort: Cohort, kept: bool) -> None:
        """Wake the waiters of a cohort that just became terminal: with a journal and a kept
        record, once the writer confirms the commit holding it (server/journal.py: synced
        with ``state_sync: full``; at once when the journal is degraded, at the latest after
        its stall bound); otherwise now."""
        if kept and self._journal is not None:
            self._journal.after_commit(cohort.release)
        else:
            cohort.release()

    def _retire(self, cohort: Cohort) -> bool:
        """Move a cohort that just became terminal out of the active set, keep its record.
        Returns whether a record was kept."""
        key = cohort.key
        now = trio.current_time()
        del self._active[key]
        if not self._active:
            self._idle.set()
        self._crowd.cohorts = len(self._active)
        self._active_bytes -= cohort.size_bytes
        self._room_freed()
        failure = cohort.failure
        # An arrival cohort's failure record knows its members' digests (in memory only: the
        # journal keeps none for a failure), so a re-send is told from a late member.
        kept_digests = cohort.digests
        if cohort.by_arrival and failure is not None:
            kept_digests = tuple(m.digest if (m := cohort.members.get(s)) is not None else None
                                 for s in range(cohort.size))
        cohort.members = {}
        cohort.results = {}
        cohort.verdict_prefix = None
        cohort.judge_affinity.close()
        keep = (failure is not None and failure.kind != "shutdown") or (
            failure is None and (key.group_id is not None or cohort.by_arrival)
        )
        if keep:
            ttl = self._cfg.cohort_result_ttl_s
            # A completed legacy cohort's record lives in memory only (the journal keeps none:
            # after a restart the same prompt is judged afresh, as legacy cohorts always were).
            if self._journal is not None and (failure is not None or key.group_id is not None):
                self._journal.put_record(
                    key, None if ttl is None else time.time() + ttl, cohort.digests,
                    cohort.rewards, dataclasses.asdict(failure) if failure is not None else None,
                )
            expires_at = math.inf if ttl is None else now + ttl
            self._records[key] = _Record(expires_at, kept_digests, cohort.rewards, failure,
                                         cohort.defaulted, cohort.reused, now)
            self._records.move_to_end(key)
        if key.group_id is not None:
            group_id = key.group_id
            by_attempt = self._active_by_group[group_id]
            del by_attempt[key.attempt]
            mark = self._watermarks.get(group_id)
            if keep and mark is not None and mark.attempt == key.attempt and not mark.finished:
                if self._journal is not None:
                    self._journal.put_watermark(group_id, mark.attempt, mark.prompt_digest,
                                                time.time(), finished=True)
                mark.finished = True
            if not by_attempt:
                del self._active_by_group[group_id]
                if mark is not None:  # the group is idle from now: its watermark starts ageing
                    mark.touched_at = now
                    self._idle_groups[group_id] = None
                    self._idle_groups.move_to_end(group_id)
        self._prune(now)
        return keep

    def _prune(self, now: float) -> None:
        """Evict expired or over-cap records and idle watermarks, oldest first. O(1) amortised:
        each visit evicts, except the one that stops the walk; active groups are never visited.
        A mass expiry is one journal transaction."""
        cap = self._cfg.max_terminal_cohorts
        records = self._records
        evicted: list[identity.CohortKey] = []
        while records:
            key, record = next(iter(records.items()))
            if len(records) > cap or record.expires_at <= now:
                del records[key]
                evicted.append(key)
            else:
                break
        ttl = self._watermark_ttl_s
        idle = self._idle_groups
        watermarks = self._watermarks
        dropped: list[str] = []
        while idle:
            self.watermark_visits += 1
            group_id = next(iter(idle))
            mark = watermarks[group_id]
            expired = ttl is not None and mark.touched_at + ttl <= now
            if not (len(idle) > self._watermark_cap or expired):
                break
            del idle[group_id]
            del watermarks[group_id]
            dropped.append(group_id)
        if self._journal is not None:
            if evicted:
                self._journal.delete_records(evicted)
            if dropped:
                self._journal.delete_watermarks(dropped)
        if self._verdicts is not None:
            self._verdicts.prune(now)

    # ------------------------------------------------------------------ failure texts

    def _failure(self, cohort: Cohort, status: int, kind: str, detail: str,
                 masked: bool = False) -> Failure:
        text = f"{identity.describe(cohort.key)}: {detail}"
        if cohort.legacy:
            text += LEGACY_GUIDANCE
        return Failure(status, kind, text, masked=masked)

    def _judge_failure(self, cohort: Cohort, detail: str) -> Failure:
        # The guidance must survive the 2000-character cut, so cut the judge text first.
        room = 2000 - len(LEGACY_GUIDANCE) - 200 if cohort.legacy else 1800
        return self._failure(cohort, 200, "judge_failed", bound_text(detail, room), masked=True)

    def _incomplete(self, cohort: Cohort) -> Failure:
        cfg = self._cfg
        shown = _slots(s for s in range(cohort.size) if s not in cohort.members)
        why = "no reward is computed from an incomplete cohort"
        if cfg.incomplete_cohort_policy == "judge_present":
            why = ("legacy groups (no _ng_group_id) are judged partially only with "
                   "legacy_slots: arrival" if cohort.legacy and not cohort.by_arrival
                   else f"incomplete_cohort_policy judge_present needs at least "
                        f"{min_members_present(cfg)} members")
        return self._failure(
            cohort, 503, "cohort_incomplete",
            f"collection deadline of {cfg.cohort_collection_timeout_s:g} s passed with "
            f"{len(cohort.members)} of {cohort.size} rollouts (missing slots: {shown}); {why}",
        )


def _slots(slots: Iterable[int], limit: int = 32) -> str:
    """Slot numbers for a message, at most ``limit`` of them."""
    shown = list(itertools.islice(slots, limit + 1))
    return ", ".join(str(s) for s in shown[:limit]) + (", ..." if len(shown) > limit else "")


def _closed(key: identity.CohortKey, slot: int | None, scored: int, size: int) -> Failure:
    what = "a member" if slot is None else f"slot {slot}"
    if key.group_id is None:
        return Failure(
            409, "cohort_closed",
            f"{identity.describe(key)}: {what} arrived after the cohort was judged without it "
            f"({scored} of {size} members, incomplete_cohort_policy judge_present); a late "
            "member never gets a reward nor a cohort of its own",
        )
    return Failure(
        409, "cohort_closed",
        f"group {_short(key.group_id)!r} attempt {key.attempt}: {what} arrived after "
        f"the cohort was judged without it ({scored} of {size} members, incomplete_cohort_policy "
        "judge_present); a missing slot never gets a reward: resend the complete group with a "
        "higher _ng_group_attempt",
    )


def _conflict(key: identity.CohortKey, slot: int, where: str) -> Failure:
    return Failure(
        409, "conflict",
        f"{identity.describe(key)}: slot {slot} of {where} already holds a different response",
    )


MAX_GROUPS_ELSEWHERE = 65536
"""Groups a rejoining replica remembers as open on another replica (README "Rolling restart");
past it the oldest is forgotten (its later members could then open a partial cohort here)."""

_UNRECORDED = frozenset({"overloaded", "shutdown", "draining"})
"""Refusals at admission that no journaled state decided."""


def _draining_failure() -> Failure:
    return Failure(
        425, "draining",
        "this replica opens no new cohort now (it is draining, or rejoining after a restart: "
        "this group may be open on another replica); send the request to another replica "
        "(a proxy retries it there)",
    )


def _overloaded(why: str) -> Failure:
    return Failure(
        429, "overloaded", f"server overloaded: {why}; retry later",
        retry_after_s=OVERLOAD_RETRY_AFTER_S,
    )


def _outcome_label(outcome: Outcome) -> str:
    if isinstance(outcome, Rewarded):
        return "verify_rewarded"
    return "verify_masked" if outcome.masked else f"verify_{outcome.kind}"


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
