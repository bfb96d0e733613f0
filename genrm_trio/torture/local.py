"""The local driver: one schedule against an in-process ``CohortRegistry`` with a scripted judge
and an autojump clock; :func:`run_local` runs many seeded ones and shrinks the first failing one.

Lifetimes: :func:`run_schedule` opens two nurseries, one that the registry spawns its cohorts
into and one for the request tasks; both are empty when it returns (that is one of the checks).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import trio
import trio.testing

from genrm_trio import wire
from genrm_trio.config import Config
from genrm_trio.server.cohort import CohortRegistry, Failure, Outcome, Rewarded
from genrm_trio.torture.contract import (
    PROMPTS,
    VERIFY_FAILURE_STATUS,
    answer_text,
    reference_rewards,
    verify_body,
)
from genrm_trio.torture.schedules import (
    COLLECTION_TIMEOUT_S,
    EVALUATION_TIMEOUT_S,
    FIRST_LEGACY_GROUP,
    JUDGE_DELAYS_S,
    NUM_GROUPS,
    Advance,
    Arrive,
    Disconnect,
    JudgeMode,
    NewAttempt,
    Op,
    Schedule,
    Shutdown,
    generate_schedule,
)
from genrm_trio.torture.scripted_judge import ScriptedJudge
from genrm_trio.torture.shrink import shrink_schedule

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    index: int
    op_index: int
    group: int
    attempt: int
    slot: int
    variant: int
    prompt: int
    key: tuple[Any, ...]
    sent_at: float
    after_shutdown: bool
    scope: trio.CancelScope | None = None
    outcome: Outcome | None = None
    answers: int = 0
    answered_at: float | None = None
    disconnected: bool = False
    disconnected_at: float | None = None


@dataclass(slots=True)
class Report:
    """What one schedule did and what it broke. ``violations`` empty means the schedule passed."""

    violations: list[str] = field(default_factory=list)
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    judge_calls: int = 0
    virtual_s: float = 0.0


def _label(outcome: Outcome) -> str:
    if isinstance(outcome, Rewarded):
        partial = (outcome.cohort_scored or 0) < (outcome.cohort_expected or 0)
        return "rewarded_partial" if partial else "rewarded"
    return outcome.kind


class _LocalRun:
    """One schedule against one in-process registry; collects violations as it goes."""

    def __init__(self, schedule: Schedule, registry_factory: RegistryFactory) -> None:
        self.schedule = schedule
        self.registry_factory = registry_factory
        self.cfg = schedule.config()
        self.judge = ScriptedJudge()
        self.report = Report()
        self.requests: list[_Request] = []
        self.attempts = [0] * NUM_GROUPS
        self.group_ids = [f"torture-{g}" for g in range(NUM_GROUPS)]
        self.shutdown_at: float | None = None
        self.op_index = 0
        self._reference_cache: dict[tuple[Any, ...], list[float]] = {}
        # (key, answer time) of waited-for answers -> labels, and reward assignments that fit
        self._active_before: set[int] = set()
        self._published: dict[tuple[Any, ...], set[str]] = {}
        self._assignments: dict[tuple[Any, ...], set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

    def violation(self, text: str) -> None:
        self.report.violations.append(f"op {self.op_index}: {text}")

    # -- requests ----------------------------------------------------------------------------

    def key_of(self, group: int, attempt: int, prompt: int) -> tuple[Any, ...]:
        if group < FIRST_LEGACY_GROUP:
            return ("explicit", group, attempt)
        return ("legacy", group, prompt, attempt)

    async def request_task(self, registry: CohortRegistry, req: _Request, raw: bytes) -> None:
        with trio.CancelScope() as scope:
            req.scope = scope
            try:
                member = wire.decode_verify(raw, self.cfg.num_rollouts_per_prompt)
                outcome = await registry.verify(member)
            except Exception as exc:  # task boundary: a crash is a finding, not a test error
                self.violation(f"request {req.index}: verify raised {type(exc).__name__}: {exc}")
                return
            req.answers += 1
            req.outcome = outcome
            req.answered_at = trio.current_time()
            self.check_answer(req, outcome)
            if req.answered_at > req.sent_at:  # released by its cohort, not answered at once
                self._published.setdefault((req.key, req.answered_at), set()).add(
                    _label(outcome))
        if scope.cancelled_caught:
            req.disconnected = True

    def check_answer(self, req: _Request, outcome: Outcome) -> None:
        label = f"request {req.index} {req.key} slot {req.slot} v{req.variant}"
        elapsed = trio.current_time() - req.sent_at
        bound = COLLECTION_TIMEOUT_S + EVALUATION_TIMEOUT_S + 1e-6
        if elapsed > bound:
            self.violation(f"{label}: answered after {elapsed:.3f} s (> {bound:g} s deadlines)")
        if isinstance(outcome, Rewarded):
            self.check_reward(req, outcome, label)
            return
        if not isinstance(outcome, Failure):
            self.violation(f"{label}: answer {outcome!r} is neither a reward nor a Failure")
            return
        status = VERIFY_FAILURE_STATUS.get(outcome.kind)
        if status is None:
            self.violation(f"{label}: failure kind {outcome.kind!r} is not in the contract")
            return
        if outcome.status != status or outcome.masked != (outcome.kind == "judge_failed"):
            self.violation(f"{label}: {outcome.kind} answered with status {outcome.status} "
                           f"masked={outcome.masked}")
        if not outcome.detail:
            self.violation(f"{label}: {outcome.kind} without detail")
        self.check_failure_cause(req, outcome, label)

    def _earlier(self, req: _Request) -> Iterable[_Request]:
        return (r for r in self.requests if r.index < req.index)

    def check_failure_cause(self, req: _Request, failure: Failure, label: str) -> None:
        """Necessary conditions: a failure kind may only appear if its cause happened."""
        kind = failure.kind
        explicit = req.group < FIRST_LEGACY_GROUP
        now = trio.current_time()
        if kind == "shutdown" and self.shutdown_at is None:
            self.violation(f"{label}: 'shutdown' but the registry was never shut down")
        elif kind in ("stale_attempt", "superseded"):
            newer = any(r.group == req.group and r.attempt > req.attempt
                        for r in self.requests if r.sent_at <= now)
            if not explicit or not newer:
                self.violation(f"{label}: {kind!r} with no newer attempt of an explicit group")
        elif kind == "result_expired":
            if not explicit or not any(r.key == req.key for r in self._earlier(req)):
                self.violation(f"{label}: 'result_expired' but this attempt of an explicit "
                               "group was never sent before")
        elif kind == "conflict":
            if not any(r.key == req.key and r.slot == req.slot and r.variant != req.variant
                       for r in self._earlier(req)):
                self.violation(f"{label}: 'conflict' but no different answer was sent before")
        elif kind == "prompt_mismatch":
            if not explicit:
                self.violation(f"{label}: 'prompt_mismatch' for a legacy group, whose key "
                               "includes the prompt")
            elif not any(r.group == req.group and r.prompt != req.prompt
                       for r in self._earlier(req)):
                self.violation(f"{label}: 'prompt_mismatch' but no other prompt was sent")
        elif kind == "cohort_incomplete":
            first = min((r.sent_at for r in self.requests if r.key == req.key), default=now)
            if now - first < COLLECTION_TIMEOUT_S - 1e-9:
                self.violation(f"{label}: 'cohort_incomplete' only {now - first:.3f} s after "
                               f"the cohort's first arrival")
        elif kind == "judge_failed":
            if req.group not in self.judge.trouble:
                self.violation(f"{label}: masked judge failure but every judge call for the "
                               "group succeeded in time")
        elif kind == "evaluation_error":
            if req.group not in self.judge.crashed:
                self.violation(f"{label}: 'evaluation_error' without a crashing judge")
        elif kind == "overloaded":
            if self.schedule.max_active is None:
                self.violation(f"{label}: 'overloaded' with no admission limit configured")
            waiting = [r.index for r in self._earlier(req)
                       if r.key == req.key and r.outcome is None and not r.disconnected]
            if waiting:
                self.violation(f"{label}: 'overloaded' for a member of an active cohort "
                               f"(request {waiting[0]} waits on it)")
        elif kind == "cohort_closed":
            if not (explicit and self.schedule.partial):
                self.violation(f"{label}: 'cohort_closed' without incomplete_cohort_policy "
                               "judge_present for an explicit group")
            elif not any(r.key == req.key and now - r.sent_at >= COLLECTION_TIMEOUT_S - 1e-9
                         for r in self._earlier(req)):
                self.violation(f"{label}: 'cohort_closed' but no member of the cohort was sent "
                               "a collection deadline ago")
        elif kind == "cancelled":
            self.violation(f"{label}: 'cancelled' while nothing cancelled the registry")

    def reference(self, key: tuple[Any, ...], prompt: int, slots: tuple[int, ...],
                  variants: tuple[int, ...]) -> list[float]:
        """The reference rewards of the answers ``variants`` in ``slots`` (all N, or the
        members a partial cohort was judged over: the same computation over them alone)."""
        cache_key = (key, prompt, slots, variants)
        cached = self._reference_cache.get(cache_key)
        if cached is None:
            group, attempt = key[1], key[-1]
            answers = [answer_text(group, attempt, s, v)
                       for s, v in zip(slots, variants, strict=True)]
            cached = reference_rewards(self.cfg, PROMPTS[prompt], answers)
            self._reference_cache[cache_key] = cached
        return cached

    def _scored_slots(self, req: _Request, outcome: Rewarded, label: str
                      ) -> list[tuple[int, ...]] | None:
        """The slot sets the reward may come from: all N for a full cohort; for a partial one
        (policy on, explicit group, at least min_cohort_members, after a collection deadline)
        every set of ``cohort_scored`` slots holding the request's own. None: a violation."""
        n = self.schedule.n
        scored = outcome.cohort_scored
        if outcome.cohort_expected != n or scored is None or not 2 <= scored <= n:
            self.violation(f"{label}: rewarded with cohort_expected {outcome.cohort_expected}, "
                           f"cohort_scored {scored} for a cohort of {n}")
            return None
        if scored == n:
            return [tuple(range(n))]
        cfg = self.cfg
        minimum = cfg.min_cohort_members or n - 1
        first = min((r.sent_at for r in self.requests if r.key == req.key),
                    default=trio.current_time())
        if not (self.schedule.partial and req.group < FIRST_LEGACY_GROUP):
            self.violation(f"{label}: a partial reward ({scored} of {n}) without "
                           "incomplete_cohort_policy judge_present for an explicit group")
        elif scored < minimum:
            self.violation(f"{label}: a partial reward over {scored} members, fewer than "
                           f"min_cohort_members ({minimum})")
        elif trio.current_time() - first < COLLECTION_TIMEOUT_S - 1e-9:
            self.violation(f"{label}: a partial reward before any collection deadline passed")
        else:
            return [c for c in itertools.combinations(range(n), scored) if req.slot in c]
        return None

    def check_reward(self, req: _Request, outcome: Rewarded, label: str) -> None:
        """The reward must come from a cohort of answers that were sent for this key (every
        slot, or for a partial cohort the slots it says it scored), with this request's own
        answer in its own slot, and equal the reference for one of them. A missing slot never
        has a reward: a slot set is a candidate only if each of its slots was sent."""
        reward = outcome.reward
        now = trio.current_time()
        candidates: list[set[int]] = [set() for _ in range(self.schedule.n)]
        for r in self.requests:
            if r.key == req.key and r.sent_at <= now:
                candidates[r.slot].add(r.variant)
        candidates[req.slot] &= {req.variant}
        slot_sets = self._scored_slots(req, outcome, label)
        if slot_sets is None:
            return
        complete = [s for s in slot_sets if all(candidates[slot] for slot in s)]
        if not complete:
            missing = [s for s, c in enumerate(candidates) if not c]
            self.violation(f"{label}: rewarded {reward!r} but slots {missing} of the cohort "
                           "were never sent with a compatible answer (incomplete cohort)")
            return
        if not math.isfinite(reward):
            self.violation(f"{label}: non-finite reward {reward!r}")
            return
        fits = {
            (slots, variants) for slots in complete
            for variants in itertools.product(*(sorted(candidates[s]) for s in slots))
            if self.reference(req.key, req.prompt, slots, variants)[slots.index(req.slot)]
            == reward
        }
        if fits:
            if now > req.sent_at:
                publication = (req.key, now)
                known = self._assignments.get(publication)
                joint = fits if known is None else known & fits
                if not joint:
                    self.violation(f"{label}: reward {reward!r} fits no member set that also "
                                   "fits the other rewards published with it")
                self._assignments[publication] = joint or fits
            return
        self.violation(f"{label}: reward {reward!r} matches no reference computation of the "
                       f"answers sent (candidates {[sorted(c) for c in candidates]})")

    # -- operations --------------------------------------------------------------------------

    async def apply(self, op: Op, registry: CohortRegistry, requests: trio.Nursery) -> None:
        if isinstance(op, Arrive):
            op = replace(op, group=op.group % NUM_GROUPS, slot=op.slot % self.schedule.n)
            attempt = self.attempts[op.group]
            if op.older:
                attempt = max(0, attempt - 1)
            req = _Request(
                index=len(self.requests), op_index=self.op_index, group=op.group,
                attempt=attempt, slot=op.slot, variant=op.variant, prompt=op.prompt,
                key=self.key_of(op.group, attempt, op.prompt), sent_at=trio.current_time(),
                after_shutdown=self.shutdown_at is not None,
            )
            self.requests.append(req)
            body = verify_body(op.group, attempt, op.slot, op.variant, op.prompt,
                               self.group_ids)
            requests.start_soon(self.request_task, registry, req, msgspec.json.encode(body))
        elif isinstance(op, Disconnect):
            if op.back <= len(self.requests):
                target = self.requests[-op.back]
                if target.scope is not None:
                    target.scope.cancel()
                    if target.outcome is None and target.disconnected_at is None:
                        target.disconnected_at = trio.current_time()
        elif isinstance(op, NewAttempt):
            self.attempts[op.group % NUM_GROUPS] += 1
        elif isinstance(op, Advance):
            await trio.sleep(op.seconds)
        elif isinstance(op, JudgeMode):
            self.judge.modes[op.group % NUM_GROUPS] = (op.mode, op.delay_s)
        elif isinstance(op, Shutdown):
            if self.shutdown_at is None:
                self.shutdown_at = trio.current_time()
            registry.begin_shutdown()

    def check_step(self, op: Op, registry: CohortRegistry) -> None:
        """Invariants that must hold once the registry has settled after ``op``."""
        snap = registry.snapshot()
        if snap["retained_records"] > self.cfg.max_terminal_cohorts:
            self.violation(f"{snap['retained_records']} retained records over the cap "
                           f"{self.cfg.max_terminal_cohorts}")
        # A disconnected request's cohort may still be active, until its deadlines have passed.
        horizon = trio.current_time() - COLLECTION_TIMEOUT_S - EVALUATION_TIMEOUT_S
        active_groups = {r.group for r in self.requests
                         if r.outcome is None and r.group < FIRST_LEGACY_GROUP
                         and (not r.disconnected or r.sent_at >= horizon)}
        if isinstance(op, Arrive):
            # Watermarks are pruned on admission; groups with an active cohort are never pruned;
            # idle ones are kept up to twice the record cap (result_expired needs them).
            allowed = 2 * self.cfg.max_terminal_cohorts + len(active_groups | self._active_before)
            if snap["watermarks"] > allowed:
                self.violation(f"{snap['watermarks']} watermarks after an admission, over the "
                               f"cap + active groups ({allowed})")
        self._active_before = active_groups
        pending = [r for r in self.requests if r.outcome is None and not r.disconnected]
        if snap["waiters"] != len(pending):
            self.violation(f"registry counts {snap['waiters']} waiters, {len(pending)} "
                           "requests are waiting")
        if self.shutdown_at is not None:
            for r in pending:
                self.violation(f"request {r.index} still waiting after shutdown")
            for r in self.requests:
                if r.after_shutdown and r.outcome is not None and _label(r.outcome) != "shutdown":
                    self.violation(f"request {r.index} sent after shutdown got "
                                   f"{_label(r.outcome)!r}")
        if isinstance(op, Arrive) and self.requests:
            req = self.requests[-1]
            if req.outcome is None and req.group < FIRST_LEGACY_GROUP:
                for r in pending:
                    if r.group == req.group and r.attempt < req.attempt:
                        self.violation(f"request {r.index} of attempt {r.attempt} still waits "
                                       f"after attempt {req.attempt} was admitted")

    async def run(self) -> Report:
        try:
            async with trio.open_nursery() as cohorts:
                registry = self.registry_factory(self.cfg, self.judge, cohorts)
                async with trio.open_nursery() as requests:
                    for index, op in enumerate(self.schedule.ops):
                        self.op_index = index
                        await self.apply(op, registry, requests)
                        await trio.testing.wait_all_tasks_blocked()
                        self.check_step(op, registry)
                    self.op_index = len(self.schedule.ops)
                    # Every deadline of every cohort lies within this much virtual time.
                    max_delay = max(JUDGE_DELAYS_S)
                    await trio.sleep(COLLECTION_TIMEOUT_S + EVALUATION_TIMEOUT_S + max_delay + 1)
                    await trio.testing.wait_all_tasks_blocked()
                    self.check_end(registry, cohorts)
                    requests.cancel_scope.cancel()
                cohorts.cancel_scope.cancel()
        except Exception as exc:  # a crash escaping the registry's nursery is a finding
            self.report.violations.append(
                f"op {self.op_index}: exception escaped the registry: {type(exc).__name__}: "
                f"{exc}")
        self.report.requests = len(self.requests)
        self.report.judge_calls = self.judge.calls
        self.report.virtual_s = trio.current_time()
        for r in self.requests:
            self.report.outcomes[_label(r.outcome) if r.outcome else "disconnected"] += 1
        return self.report

    def check_end(self, registry: CohortRegistry, cohorts: trio.Nursery) -> None:
        for r in self.requests:
            if r.disconnected:
                continue
            if r.answers != 1:
                self.violation(f"request {r.index} {r.key} slot {r.slot} got {r.answers} "
                               "answers (expected exactly one)")
        snap = registry.snapshot()
        for name in ("active_cohorts", "waiters", "active_bytes"):
            if snap[name]:
                self.violation(f"left behind: {name} = {snap[name]}")
        if cohorts.child_tasks:
            self.violation(f"left behind: {len(cohorts.child_tasks)} cohort task(s)")
        if snap["retained_records"] > self.cfg.max_terminal_cohorts:
            self.violation(f"{snap['retained_records']} retained records over the cap")
        for (key, at), labels in self._published.items():
            if len(labels) > 1:
                self.violation(f"the waiters of {key} released at {at:.3f} s saw different "
                               f"outcomes: {sorted(labels)}")
        self.check_call_timing()

    def check_call_timing(self) -> None:
        """Every comparison starts exactly when it may: with ``eager``, at the arrival of the
        later of its two members; otherwise at the arrival that completed the cohort. Never
        before, never after, and never twice for one pair of one live cohort."""
        eager = self.schedule.eager
        n = self.schedule.n
        sends: dict[tuple[Any, ...], list[float]] = {}
        # Partial cohorts: a comparison may also start when a collection deadline of its key
        # passes (the re-plan over the members present).
        deadlines: dict[tuple[Any, ...], set[float]] = {}
        for r in self.requests:
            sends.setdefault((r.key, r.slot, r.variant), []).append(r.sent_at)
            sends.setdefault((r.key, r.slot), []).append(r.sent_at)
            if self.schedule.partial:
                deadlines.setdefault(r.key, set()).add(r.sent_at + COLLECTION_TIMEOUT_S)
        seen: dict[tuple[Any, ...], list[float]] = {}
        for call in self.judge.log:
            t = call.started_at
            key = self.key_of(call.group, call.attempt, call.prompt)
            label = (f"comparison {key} {call.first}/{call.second} started at {t:.3f} s "
                     f"({'eager' if eager else 'wait_for_all'})")
            both = [sends.get((key, *m), []) for m in (call.first, call.second)]
            if any(not any(at <= t for at in times) for times in both):
                self.violation(f"{label}: before both of its members arrived")
                continue
            if any(abs(t - d) <= 1e-6 for d in deadlines.get(key, ())):
                # A partial cohort's re-planned comparison, started at its deadline (the clock's
                # jump to a deadline may land a rounding error off it).
                pass
            elif eager:
                if t not in both[0] and t not in both[1]:
                    self.violation(f"{label}: not at the arrival of one of its members (late)")
            else:
                slots = [sends.get((key, s), []) for s in range(n)]
                if any(not any(at <= t for at in times) for times in slots):
                    self.violation(f"{label}: before all {n} members arrived")
                elif not any(t in times for times in slots):
                    self.violation(f"{label}: not at the arrival that completed the cohort")
            pair = (key, call.first, call.second)
            earlier = seen.setdefault(pair, [])
            if (sum(1 for at in earlier if at == t) >= self.schedule.judges
                    and self._one_cohort_throughout(key, t, t)):
                self.violation(f"{label}: more than {self.schedule.judges} call(s) for the "
                               "pair at once")
            elif any(at < t and self._one_cohort_throughout(key, at, t) for at in earlier):
                self.violation(f"{label}: a second comparison of a pair its live cohort had "
                               "already started")
            earlier.append(t)

    def _one_cohort_throughout(self, key: tuple[Any, ...], t1: float, t2: float) -> bool:
        """Whether provably one and the same cohort of ``key`` was active from ``t1`` through
        ``t2``: a request admitted to it was still waiting after ``t2``, and it was admitted
        before ``t1``, or at ``t1`` when no earlier cohort of the key can have ended then."""
        fresh_at_t1 = not any(
            r.key == key and (r.sent_at < t1 or r.answered_at == t1) for r in self.requests)
        for r in self.requests:
            if r.key != key or r.sent_at > t1 or (r.sent_at == t1 and not fresh_at_t1):
                continue
            if t1 == t2 and r.sent_at == t1:
                continue
            until = r.answered_at if r.answered_at is not None else r.disconnected_at
            if until is not None and until > t2:
                return True
        return False


RegistryFactory = Callable[[Config, ScriptedJudge, trio.Nursery], CohortRegistry]


async def run_schedule(schedule: Schedule,
                       registry_factory: RegistryFactory = CohortRegistry) -> Report:
    """Run one schedule against a fresh in-process registry and return its report.

    Meant for a trio run with an autojump clock (``MockClock(autojump_threshold=0)``): the
    schedule's deadlines are tens of virtual seconds. Never raises for a finding: crashes of
    the registry are reported as violations. ``registry_factory`` lets tests torture a
    deliberately broken registry, to show the checks catch it.
    """
    return await _LocalRun(schedule, registry_factory).run()


def run_schedule_sync(schedule: Schedule,
                      registry_factory: RegistryFactory = CohortRegistry) -> Report:
    """:func:`run_schedule` in its own ``trio.run`` with an autojump clock. Blocks."""
    return trio.run(run_schedule, schedule, registry_factory,
                    clock=trio.testing.MockClock(autojump_threshold=0))


@dataclass(slots=True)
class LocalSummary:
    schedules: int = 0
    requests: int = 0
    judge_calls: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failing_seed: int | None = None
    shrunk: Schedule | None = None
    violations: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def run_local(schedules: int, seed: int, max_ops: int = 24,
              progress: Callable[[int], None] | None = None,
              registry_factory: RegistryFactory = CohortRegistry,
              eager: bool | None = None, partial: bool = False) -> LocalSummary:
    """Run ``schedules`` seeded schedules (schedule ``i`` uses seed ``seed + i``); stop at the
    first failing one, shrink it and keep its violations. Blocks (one trio run per schedule).
    ``eager`` forces the judge schedule of every schedule (``None``: as generated);
    ``partial`` generates the partial-cohort family (``incomplete_cohort_policy:
    judge_present``, groups missing a straggler)."""
    summary = LocalSummary()
    started = time.perf_counter()
    for i in range(schedules):
        schedule = generate_schedule(random.Random(seed + i), max_ops, partial=partial)
        if eager is not None:
            schedule = replace(schedule, eager=eager)
        report = run_schedule_sync(schedule, registry_factory)
        summary.schedules += 1
        summary.requests += report.requests
        summary.judge_calls += report.judge_calls
        summary.outcomes.update(report.outcomes)
        if report.violations:
            summary.failing_seed = seed + i
            summary.shrunk = shrink_schedule(
                schedule, lambda s: bool(run_schedule_sync(s, registry_factory).violations))
            summary.violations = run_schedule_sync(summary.shrunk, registry_factory).violations
            break
        if progress is not None and (i + 1) % 1000 == 0:
            progress(i + 1)
    summary.wall_s = time.perf_counter() - started
    return summary
