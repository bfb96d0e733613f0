"""``genrm-trio torture``: randomized lifecycle schedules, checked against the contract.

Two drivers share one idea: throw arrivals, duplicates, conflicting answers, client disconnects,
newer and older attempts, deadlines, judge faults and shutdown at a server, then check that every
request got exactly one answer, that every answer is a full-cohort reward for its own slot or an
explicit failure of the contract's kinds, that rewards equal a reference computation, and that
nothing is left behind.

::

    Schedule (frozen ops)  --run_schedule-->  in-process CohortRegistry, scripted judge,
       |                                      autojump clock: Report(violations, ...)
       +-- generate_schedule(rng)             seeded; shrink_schedule() cuts a failing one down
    run_http_torture(url, judge_url)      --> a live server over HTTP (ours or any server speaking
                                              the protocol) with the mock judge's fault injection

Lifetimes: :func:`run_schedule` opens two nurseries, one that the registry spawns its cohorts
into and one for the request tasks; both are empty when it returns (that is one of the checks).
:func:`run_http_torture` owns its HTTP client and one nursery per round. Nothing here keeps
module-level mutable state.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import click
import msgspec
import trio
import trio.testing

from genrm_trio import scoring, wire
from genrm_trio.config import Config
from genrm_trio.errors import JudgeFailed
from genrm_trio.server.cohort import CohortRegistry, Failure, Outcome, Rewarded
from genrm_trio.server.judge import JudgeRequest

logger = logging.getLogger(__name__)

#: Failure kinds a ``/verify`` request may be answered with (contract 3.3/3.4), by HTTP status.
VERIFY_FAILURE_STATUS: Mapping[str, int] = MappingProxyType({
    "judge_failed": 200,
    "bad_request": 400,
    "too_large": 413,
    "bad_coordinates": 422,
    "conflict": 409,
    "prompt_mismatch": 409,
    "stale_attempt": 409,
    "result_expired": 409,
    "overloaded": 429,
    "cohort_incomplete": 503,
    "superseded": 503,
    "shutdown": 503,
    "evaluation_error": 503,
    "cancelled": 503,
})

# ------------------------------------------------------------------------------ schedule model

#: Judge behaviours a schedule can set per group: answer, JudgeFailed, never answer, raise a
#: non-judge error, answer a non-finite verdict (only a broken plugin could; reward must fail).
JUDGE_MODES = ("ok", "fail", "hang", "crash", "nan")
#: Virtual seconds. Odd values so no two timers of a schedule land on the same instant by
#: accident (that keeps a schedule's outcome independent of trio's tie-breaking).
COLLECTION_TIMEOUT_S = 10.0
EVALUATION_TIMEOUT_S = 5.0
JUDGE_DELAYS_S = (0.0, 0.713, 2.291, 9.137)
ADVANCES_S = (0.517, 1.903, 4.411, 11.29)
NUM_GROUPS = 3
#: Groups with an index at or above this one are legacy groups (no ``_ng_group_id``).
FIRST_LEGACY_GROUP = 2


@dataclass(frozen=True, slots=True)
class Arrive:
    """One ``/verify`` request: group, slot, answer variant (0 or 1: a different answer), prompt
    variant (0 or 1) and attempt (``older``: one below the group's current attempt)."""

    group: int
    slot: int
    variant: int = 0
    prompt: int = 0
    older: bool = False


@dataclass(frozen=True, slots=True)
class Disconnect:
    """The client of the ``back``-th most recent request goes away (no-op if it is done)."""

    back: int = 1


@dataclass(frozen=True, slots=True)
class NewAttempt:
    """The group's caller moves to the next attempt (later arrivals use it)."""

    group: int


@dataclass(frozen=True, slots=True)
class Advance:
    seconds: float


@dataclass(frozen=True, slots=True)
class JudgeMode:
    """From now on, judge calls for ``group`` wait ``delay_s``, then behave as ``mode``."""

    group: int
    mode: str
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Op = Arrive | Disconnect | NewAttempt | Advance | JudgeMode | Shutdown


@dataclass(frozen=True, slots=True)
class Schedule:
    """Operations plus the registry configuration they run against."""

    ops: tuple[Op, ...]
    n: int = 2
    strategy: str = "circular"
    eager: bool = False
    max_terminal: int = 8
    ttl_s: float | None = 30.0
    max_active: int | None = None
    judges: int = 1

    def config(self) -> Config:
        return Config(
            num_rollouts_per_prompt=self.n,
            comparison_strategy=self.strategy,  # type: ignore[arg-type]
            judge_schedule="eager" if self.eager else "wait_for_all",
            cohort_collection_timeout_s=COLLECTION_TIMEOUT_S,
            cohort_evaluation_timeout_s=EVALUATION_TIMEOUT_S,
            max_terminal_cohorts=self.max_terminal,
            cohort_result_ttl_s=self.ttl_s,
            max_active_cohorts=self.max_active,
            num_judges_per_comparison=self.judges,
        )

    def describe(self) -> str:
        head = (f"Schedule(n={self.n}, strategy={self.strategy!r}, eager={self.eager}, "
                f"max_terminal={self.max_terminal}, ttl_s={self.ttl_s}, "
                f"max_active={self.max_active}, judges={self.judges})")
        return "\n".join([head, *(f"  {i:3d}. {op!r}" for i, op in enumerate(self.ops))])


def generate_schedule(rng: random.Random, max_ops: int = 24) -> Schedule:
    """A random schedule from ``rng`` (same seed, same schedule). Pure; never blocks."""
    n = rng.choice((2, 2, 3))
    ops: list[Op] = []
    sent = 0
    for _ in range(rng.randint(1, max_ops)):
        roll = rng.random()
        if roll < 0.12:  # a whole group arrives, in random order
            group = rng.randrange(NUM_GROUPS)
            slots = list(range(n))
            rng.shuffle(slots)
            ops.extend(Arrive(group=group, slot=s) for s in slots)
            sent += n
        elif roll < 0.50:
            ops.append(Arrive(
                group=rng.randrange(NUM_GROUPS), slot=rng.randrange(n),
                variant=1 if rng.random() < 0.12 else 0,
                prompt=1 if rng.random() < 0.06 else 0,
                older=rng.random() < 0.06,
            ))
            sent += 1
        elif roll < 0.60 and sent:
            ops.append(Disconnect(back=rng.randint(1, min(sent, 4))))
        elif roll < 0.67:
            ops.append(NewAttempt(group=rng.randrange(NUM_GROUPS)))
        elif roll < 0.82:
            ops.append(Advance(rng.choice(ADVANCES_S)))
        elif roll < 0.985:
            ops.append(JudgeMode(
                group=rng.randrange(NUM_GROUPS),
                mode=rng.choice(("ok", "ok", "fail", "hang", "crash", "nan")),
                delay_s=rng.choice(JUDGE_DELAYS_S),
            ))
        else:
            ops.append(Shutdown())
    return Schedule(
        ops=tuple(ops), n=n, strategy=rng.choice(("circular", "all_pairs")),
        eager=rng.random() < 0.3, max_terminal=rng.choice((2, 8)),
        ttl_s=rng.choice((30.0, 3.0, None)), max_active=rng.choice((None, None, 3)),
        judges=rng.choice((1, 1, 2)),
    )


# ------------------------------------------------------------------------------ bodies & oracle

PROMPTS = ("Why is the sky blue? Explain briefly.", "Name three prime numbers and explain.")


def answer_text(group: int, attempt: int, slot: int, variant: int) -> str:
    """A distinct final answer per coordinate; the prefix lets the scripted judge see its group."""
    filler = " because shorter wavelengths scatter more" * (1 + (slot + variant) % 3)
    return f"g{group} a{attempt} s{slot} v{variant}:{filler}."


def response_object(text: str) -> dict[str, Any]:
    return {
        "id": "resp_torture",
        "object": "response",
        "status": "completed",
        "output": [{"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": text}]}],
    }


def verify_body(group: int, attempt: int, slot: int, variant: int, prompt: int,
                group_ids: Sequence[str]) -> dict[str, Any]:
    """The ``/verify`` body of one member. Groups below :data:`FIRST_LEGACY_GROUP` carry
    ``group_ids[group]``; the others are legacy groups keyed by task index."""
    body: dict[str, Any] = {
        "responses_create_params": {"input": PROMPTS[prompt]},
        "response": response_object(answer_text(group, attempt, slot, variant)),
        "_ng_rollout_index": slot,
        "_ng_group_attempt": attempt,
        "extra_passthrough": {"g": group, "s": slot},
    }
    if group < FIRST_LEGACY_GROUP:
        body["_ng_group_id"] = group_ids[group]
    else:
        body["_ng_task_index"] = group
    return body


def reference_verdict(history: list[dict[str, str]], r1: str, r2: str) -> scoring.Verdict:
    text = scoring.heuristic_judge_text(history, r1, r2, None)
    return scoring.parse_judge_output(text, 3.0, 3.5)


def reference_rewards(cfg: Config, prompt_input: Any, answers: Sequence[str]) -> list[float]:
    """What a correct server publishes for these final answers judged by the heuristic judge."""
    history = scoring.conversation_history(prompt_input)
    comparisons = []
    for i, j, k in scoring.comparison_pairs(len(answers), cfg.comparison_strategy,
                                            cfg.num_judges_per_comparison):
        v = reference_verdict(history, answers[i], answers[j])
        comparisons.append(scoring.Comparison(
            response_i=i, response_j=j, judge_idx=k, score_1=v.score_1, score_2=v.score_2,
            ranking=v.ranking))
    rewards, _ = scoring.aggregate(comparisons, [response_object(a) for a in answers], cfg)
    return rewards


# ------------------------------------------------------------------------------ scripted judge


@dataclass(slots=True)
class JudgeCall:
    """One comparison the registry asked for: when it started (virtual time) and the
    coordinates of both answers, read back from their text (see :func:`answer_text`)."""

    started_at: float
    group: int
    attempt: int
    prompt: int
    first: tuple[int, int]  # (slot, variant) of response_1
    second: tuple[int, int]

    @classmethod
    def of(cls, request: JudgeRequest, now: float) -> JudgeCall:
        def coords(text: str) -> tuple[int, int, int, int]:
            g, a, s, v = text.split(":", 1)[0].split(" ")
            return int(g[1:]), int(a[1:]), int(s[1:]), int(v[1:])

        g, a, s1, v1 = coords(request.response_1)
        _, _, s2, v2 = coords(request.response_2)
        prompt_text = request.history[0]["content"] if request.history else ""
        prompt = PROMPTS.index(prompt_text) if prompt_text in PROMPTS else -1
        return cls(now, g, a, prompt, (s1, v1), (s2, v2))


class ScriptedJudge:
    """A pair judge whose behaviour per group the schedule sets (see :class:`JudgeMode`).

    Verdicts are the heuristic judge's, so rewards can be recomputed. ``trouble`` remembers the
    groups whose calls could fail the cohort (a failing mode, or a delay past the evaluation
    deadline), ``crashed`` those that raised a non-judge error.
    """

    def __init__(self) -> None:
        self.modes: dict[int, tuple[str, float]] = {}
        self.calls = 0
        self.trouble: set[int] = set()
        self.crashed: set[int] = set()
        self.log: list[JudgeCall] = []

    async def judge_pair(self, request: JudgeRequest, group: object = None) -> scoring.Verdict:
        group = int(request.response_1.split(" ", 1)[0][1:])
        mode, delay_s = self.modes.get(group, ("ok", 0.0))
        self.calls += 1
        self.log.append(JudgeCall.of(request, trio.current_time()))
        if mode != "ok" or delay_s >= EVALUATION_TIMEOUT_S:
            self.trouble.add(group)
        if mode in ("crash", "nan"):
            self.crashed.add(group)
        if delay_s:
            await trio.sleep(delay_s)
        if mode == "fail":
            raise JudgeFailed(f"scripted judge failure for group {group}")
        if mode == "hang":
            await trio.sleep_forever()
        if mode == "crash":
            raise RuntimeError(f"scripted judge crash for group {group}")
        if mode == "nan":
            return scoring.Verdict(math.nan, 3.0, 3.5)
        return reference_verdict(request.history, request.response_1, request.response_2)


# ------------------------------------------------------------------------------ local driver


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
        return "rewarded"
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
        self._assignments: dict[tuple[Any, ...], set[tuple[int, ...]]] = {}

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
            self.check_reward(req, outcome.reward, label)
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
        elif kind == "cancelled":
            self.violation(f"{label}: 'cancelled' while nothing cancelled the registry")

    def reference(self, key: tuple[Any, ...], prompt: int,
                  variants: tuple[int, ...]) -> list[float]:
        cache_key = (key, prompt, variants)
        cached = self._reference_cache.get(cache_key)
        if cached is None:
            group, attempt = key[1], key[-1]
            answers = [answer_text(group, attempt, s, v) for s, v in enumerate(variants)]
            cached = reference_rewards(self.cfg, PROMPTS[prompt], answers)
            self._reference_cache[cache_key] = cached
        return cached

    def check_reward(self, req: _Request, reward: float, label: str) -> None:
        """The reward must come from a full cohort of answers that were sent for this key, with
        this request's own answer in its own slot, and equal the reference for one of them."""
        now = trio.current_time()
        candidates: list[set[int]] = [set() for _ in range(self.schedule.n)]
        for r in self.requests:
            if r.key == req.key and r.sent_at <= now:
                candidates[r.slot].add(r.variant)
        candidates[req.slot] &= {req.variant}
        missing = [s for s, c in enumerate(candidates) if not c]
        if missing:
            self.violation(f"{label}: rewarded {reward!r} but slots {missing} of the cohort "
                           "were never sent with a compatible answer (incomplete cohort)")
            return
        if not math.isfinite(reward):
            self.violation(f"{label}: non-finite reward {reward!r}")
            return
        fits = {
            variants for variants in itertools.product(*(sorted(c) for c in candidates))
            if self.reference(req.key, req.prompt, variants)[req.slot] == reward
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
        for r in self.requests:
            sends.setdefault((r.key, r.slot, r.variant), []).append(r.sent_at)
            sends.setdefault((r.key, r.slot), []).append(r.sent_at)
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
            if eager:
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


def shrink_schedule(schedule: Schedule, fails: Callable[[Schedule], bool],
                    budget: int = 400) -> Schedule:
    """Greedily drop operations (chunks, then single ones) while ``fails`` still holds.

    ``fails`` is called at most ``budget`` times; the result still fails.
    """
    current = schedule
    calls = 0
    chunk = max(1, len(current.ops) // 2)
    while chunk >= 1 and calls < budget:
        start = 0
        progressed = False
        while start < len(current.ops) and calls < budget:
            ops = current.ops[:start] + current.ops[start + chunk:]
            candidate = replace(current, ops=ops)
            calls += 1
            if ops and fails(candidate):
                current = candidate
                progressed = True
            else:
                start += chunk
        if not progressed:
            chunk //= 2
    return current


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
              eager: bool | None = None) -> LocalSummary:
    """Run ``schedules`` seeded schedules (schedule ``i`` uses seed ``seed + i``); stop at the
    first failing one, shrink it and keep its violations. Blocks (one trio run per schedule).
    ``eager`` forces the judge schedule of every schedule (``None``: as generated)."""
    summary = LocalSummary()
    started = time.perf_counter()
    for i in range(schedules):
        schedule = generate_schedule(random.Random(seed + i), max_ops)
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


# ------------------------------------------------------------------------------ HTTP driver


@dataclass(slots=True)
class HttpSummary:
    """Result of :func:`run_http_torture`."""

    rounds: int = 0
    requests: int = 0
    disconnects: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    hung: int = 0
    wall_s: float = 0.0


@dataclass(slots=True)
class _HttpRequest:
    group: int
    attempt: int
    slot: int
    variant: int
    disconnect_after_s: float | None
    status: int | None = None
    body: Any = None
    error: str | None = None
    hung: bool = False


#: Faults of the mock judge the HTTP driver cycles through (by their wire names).
HTTP_FAULTS = ("none", "503", "429", "reset", "truncated", "garbage", "empty", "nonfinite",
               "incomplete", "hang")


async def run_http_torture(
    url: str,
    *,
    judge_url: str | None = None,
    num_rollouts: int | None = None,
    max_requests: int = 200,
    time_limit_s: float = 60.0,
    hang_after_s: float = 30.0,
    seed: int = 0,
    check_rewards: bool = True,
    strategy: str | None = None,
    settle_s: float = 0.0,
    token: str | None = None,
) -> HttpSummary:
    """Drive a live ``/verify`` server over HTTP in rounds of a few groups each.

    Each round sets one mock-judge fault (``POST {judge_url}/admin/fault``; skipped without a
    judge URL), sends every member of its groups concurrently, with duplicates, conflicting
    answers, newer attempts and real client disconnects (the request task is cancelled, so the
    connection closes mid-wait), and checks every answer against the contract. A request not
    answered within ``hang_after_s`` is cancelled and counted as hung. Bounded by
    ``max_requests`` and ``time_limit_s`` (wall clock). Rewards are compared with the heuristic
    reference only in fault-free rounds, and only when ``check_rewards``. With ``settle_s > 0``
    the driver then waits that long (set it past the server's collection + evaluation deadlines)
    and checks through ``GET /status`` that no cohort or waiter was left behind. ``token``: the
    server's bearer token (``auth_token_env``), sent with every request to it.

    Blocks until done; cancellation stops it (open requests are abandoned with their client).
    Raises ``httpx2.HTTPError`` only if the server cannot be reached at all at the start.
    """
    import httpx2  # the HTTP driver is the only part of the tool that needs a client

    rng = random.Random(seed)
    summary = HttpSummary()
    started = time.perf_counter()
    run_id = uuid.UUID(int=rng.getrandbits(128)).hex[:12]
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(None), limits=limits,
                                  trust_env=False, headers=bearer_headers(token)) as client:
        server_cfg: dict[str, Any] = {}
        try:
            status = await client.get("/status")
            if status.status_code == 200:
                server_cfg = status.json().get("config", {}) or {}
        except (httpx2.HTTPError, ValueError):
            server_cfg = {}
        n = num_rollouts or int(server_cfg.get("num_rollouts_per_prompt", 0) or 0)
        if n < 2:
            raise click.UsageError(
                "cannot tell the server's num_rollouts_per_prompt (>= 2 needed): pass "
                "--num-rollouts")
        chosen = strategy or server_cfg.get("comparison_strategy", "circular")
        ref_cfg = Config(
            num_rollouts_per_prompt=n,
            comparison_strategy="all_pairs" if chosen == "all_pairs" else "circular",
            num_judges_per_comparison=int(server_cfg.get("num_judges_per_comparison", 1)),
        )
        judge = httpx2.AsyncClient(base_url=judge_url, timeout=httpx2.Timeout(10.0),
                                   trust_env=False) if judge_url else None
        try:
            round_no = 0
            while (summary.requests < max_requests
                   and time.perf_counter() - started < time_limit_s):
                fault = HTTP_FAULTS[round_no % len(HTTP_FAULTS)] if judge else "none"
                if judge is not None:
                    count = None if rng.random() < 0.5 else 1
                    await judge.post("/admin/fault", json={"fault": fault, "count": count})
                await _http_round(client, rng, summary, ref_cfg, f"{run_id}-r{round_no}",
                                  fault, hang_after_s, check_rewards)
                round_no += 1
                summary.rounds = round_no
            if settle_s > 0:
                await trio.sleep(settle_s)
                answer = await client.get("/status")
                if answer.status_code == 200:
                    cohorts = answer.json().get("cohorts", {})
                    for name in ("active_cohorts", "waiters"):
                        if cohorts.get(name):
                            summary.violations.append(
                                f"left behind {settle_s:g} s after the last round: "
                                f"{name} = {cohorts[name]}")
        finally:
            if judge is not None:
                with trio.move_on_after(5, shield=True):
                    await judge.post("/admin/fault", json={"fault": "none", "count": None})
                    await judge.aclose()
    summary.wall_s = time.perf_counter() - started
    return summary


async def _http_round(client: Any, rng: random.Random, summary: HttpSummary, cfg: Config,
                      round_id: str, fault: str, hang_after_s: float,
                      check_rewards: bool) -> None:
    import httpx2

    n = cfg.num_rollouts_per_prompt
    groups = rng.randint(1, 3)
    plan: list[_HttpRequest] = []
    for g in range(groups):
        attempt = 0
        for slot in range(n):
            plan.append(_HttpRequest(g, attempt, slot, 0, None))
        if rng.random() < 0.3:  # a duplicate, a conflicting answer
            plan.append(_HttpRequest(g, attempt, rng.randrange(n), 0, None))
            plan.append(_HttpRequest(g, attempt, rng.randrange(n), 1, None))
        if rng.random() < 0.2:  # the whole group again, as a newer attempt
            plan.extend(_HttpRequest(g, attempt + 1, slot, 0, None) for slot in range(n))
    for req in plan:
        if rng.random() < 0.15:
            req.disconnect_after_s = rng.uniform(0.0, 0.05)
    rng.shuffle(plan)
    group_ids = [f"torture-{round_id}-g{g}" for g in range(groups)]

    async def one(req: _HttpRequest) -> None:
        # Every HTTP group is an explicit-id group, unique to this run and round.
        body = verify_body(0, req.attempt, req.slot, req.variant, 0, [group_ids[req.group]])
        body["response"] = response_object(answer_text(req.group, req.attempt, req.slot,
                                                       req.variant) + f" [{round_id}]")
        limit = req.disconnect_after_s if req.disconnect_after_s is not None else hang_after_s
        with trio.move_on_after(limit) as scope:
            try:
                response = await client.post("/verify", json=body)
            except httpx2.HTTPError as exc:
                req.error = f"{type(exc).__name__}: {exc}"
                return
            req.status = response.status_code
            try:
                req.body = response.json()
            except ValueError:
                req.body = None
        if scope.cancelled_caught and req.disconnect_after_s is None:
            req.hung = True

    async with trio.open_nursery() as nursery:
        for req in plan:
            nursery.start_soon(one, req)
    summary.requests += len(plan)
    published: dict[tuple[int, int], dict[int, float]] = {}
    for req in plan:
        where = f"round {round_id} (fault {fault}) group {req.group} attempt {req.attempt} " \
                f"slot {req.slot} v{req.variant}"
        if req.disconnect_after_s is not None and req.status is None:
            summary.disconnects += 1
            continue
        if req.hung:
            summary.hung += 1
            summary.violations.append(f"{where}: no answer within {hang_after_s:g} s (hung)")
            continue
        if req.error is not None:
            summary.statuses["transport_error"] += 1
            summary.violations.append(f"{where}: transport error {req.error}")
            continue
        problem = check_http_answer(req.status or 0, req.body, req.slot, req.attempt)
        body = req.body if isinstance(req.body, dict) else {}
        kind = body.get("failure_kind") or "rewarded"
        summary.statuses[f"{req.status} {kind}"] += 1
        if problem:
            summary.violations.append(f"{where}: {problem}")
            continue
        if req.status == 200 and not body.get("mask_sample"):
            published.setdefault((req.group, req.attempt), {})[req.slot] = float(body["reward"])
    if not check_rewards or fault != "none":
        return
    history_input = PROMPTS[0]
    for (g, attempt), rewards in published.items():
        answers = [answer_text(g, attempt, s, 0) + f" [{round_id}]" for s in range(n)]
        alternatives = [answers]
        for s in range(n):  # the conflicting variant may have won its slot
            alt = list(answers)
            alt[s] = answer_text(g, attempt, s, 1) + f" [{round_id}]"
            alternatives.append(alt)
        refs = [reference_rewards(cfg, history_input, a) for a in alternatives]
        if not any(all(abs(ref[s] - r) <= 1e-9 for s, r in rewards.items()) for ref in refs):
            summary.violations.append(
                f"round {round_id} group {g} attempt {attempt}: rewards {rewards} match no "
                "reference computation")


def check_http_answer(status: int, body: Any, slot: int, attempt: int) -> str | None:
    """What is wrong with one ``/verify`` answer, or None. Pure."""
    if not isinstance(body, dict):
        return f"HTTP {status} without a JSON object body"
    if status == 200:
        reward = body.get("reward")
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return f"200 with reward {reward!r}"
        if body.get("_ng_rollout_index") != slot:
            return f"200 for slot {body.get('_ng_rollout_index')!r}, asked for slot {slot}"
        if body.get("_ng_group_attempt") != attempt:
            return f"200 for attempt {body.get('_ng_group_attempt')!r}, asked for {attempt}"
        if body.get("mask_sample"):
            if body.get("failure_kind") != "judge_failed" or reward != 0.0:
                return "masked 200 without failure_kind judge_failed and reward 0.0"
            reason = body.get("failure_reason")
            if not isinstance(reason, str) or not 0 < len(reason) <= 2000:
                return "masked 200 without a bounded failure_reason"
        elif body.get("failure_kind") is not None or body.get("mask_sample") is not False:
            return "unmasked 200 with failure markers"
        return None
    kind = body.get("failure_kind")
    if not isinstance(body.get("detail"), str):
        return f"HTTP {status} without a string detail"
    expected = VERIFY_FAILURE_STATUS.get(kind) if isinstance(kind, str) else None
    if expected is None or expected == 200:
        return f"HTTP {status} with failure_kind {kind!r}, not a contract kind"
    if expected != status:
        return f"failure_kind {kind!r} answered with HTTP {status} (contract: {expected})"
    if kind in ("bad_request", "bad_coordinates", "too_large"):
        return f"a well-formed member was refused with {kind!r}: {body['detail'][:200]}"
    return None


# ------------------------------------------------------------------------------ HTTP fuzzing

_WRONG_VALUES: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "string": ("text", ""),
    "integer": (7, -3),
    "number": (2.5, -0.125),
    "boolean": (True, False),
    "array": ([], [1, "x"]),
    "object": ({}, {"k": [None]}),
    "null": (None,),
})


@dataclass(slots=True)
class FuzzSummary:
    bodies: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


def _allowed(prop: dict[str, Any]) -> set[str]:
    kinds = {o["type"] for o in prop.get("anyOf", [prop]) if "type" in o}
    if "number" in kinds:
        kinds.add("integer")
    return kinds


def fuzz_case(rng: random.Random, schemas: dict[str, Any], n: int
              ) -> tuple[str, bytes, tuple[int, ...], str | None]:
    """One malformed request: ``(path, raw body, allowed statuses, text the detail must
    contain)``. Field names and types come from the OpenAPI ``schemas``. Pure."""
    roll = rng.random()
    if roll < 0.15:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        if raw.strip().startswith(b"{"):
            raw = b"[" + raw
        return "/verify", raw, (400,), None
    if roll < 0.25:
        value = rng.choice([[], "x", 3, None, True, [{"a": 1}]])
        return rng.choice(["/verify", "/compare"]), msgspec.json.encode(value), (400,), "$"
    if roll < 0.75:
        fields = schemas["VerifyFields"]
        body = verify_body(0, 0, 0, 0, 0, ["fuzz-never-opened"])
        name = rng.choice(sorted(fields["properties"]))
        if rng.random() < 0.2 and name in fields["required"]:
            del body[name]
            return "/verify", msgspec.json.encode(body), (400,), name
        allowed = _allowed(fields["properties"][name])
        wrong = [v for kind, values in _WRONG_VALUES.items() if kind not in allowed
                 for v in values]
        body[name] = rng.choice(wrong)
        return "/verify", msgspec.json.encode(body), (400,), f"$.{name}"
    if roll < 0.87:
        body = verify_body(0, 0, 0, 0, 0, ["fuzz-never-opened"])
        if rng.random() < 0.5:
            body["_ng_rollout_index"] = rng.choice([-1, n, n + 5, -(2**40)])
            return "/verify", msgspec.json.encode(body), (422,), "_ng_rollout_index"
        body["_ng_group_attempt"] = rng.choice([-1, -(2**40)])
        return "/verify", msgspec.json.encode(body), (422,), "_ng_group_attempt"
    fields = schemas["CompareRequest"]
    body = {"conversation_history": [{"role": "user", "content": "hi"}],
            "response_objs": [response_object("a"), response_object("b")]}
    name = rng.choice(sorted(fields["properties"]))
    allowed = _allowed(fields["properties"][name])
    wrong = [v for kind, values in _WRONG_VALUES.items() if kind not in allowed for v in values]
    body[name] = rng.choice(wrong)
    return "/compare", msgspec.json.encode(body), (400,), f"$.{name}"


def bearer_headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


async def run_http_fuzz(url: str, *, bodies: int = 200, seed: int = 0,
                        token: str | None = None) -> FuzzSummary:
    """Send ``bodies`` malformed ``/verify`` and ``/compare`` requests, one at a time.

    Checks: never a 5xx; the expected 400/422 with a JSON ``detail`` that names the field and a
    contract ``failure_kind``; and, when the server has ``GET /status``, its cohort counts are
    identical before and after (run it against a quiet server). Field names and types come from
    the server's ``GET /openapi.json``, or genrm-trio's own document when it has none. Blocks
    until done; raises ``httpx2.HTTPError`` when the server cannot be reached.
    """
    import httpx2

    from genrm_trio.server.openapi import build_openapi

    rng = random.Random(seed)
    summary = FuzzSummary()
    async with httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(30.0),
                                  trust_env=False, headers=bearer_headers(token)) as client:
        schemas = build_openapi()["components"]["schemas"]
        served = await client.get("/openapi.json")
        if served.status_code == 200:
            try:
                schemas = served.json()["components"]["schemas"]
            except (ValueError, KeyError, TypeError):
                pass

        async def cohorts() -> Any:
            answer = await client.get("/status")
            return answer.json().get("cohorts") if answer.status_code == 200 else None

        n = 2
        status = await client.get("/status")
        if status.status_code == 200:
            n = int(status.json().get("config", {}).get("num_rollouts_per_prompt", 2) or 2)
        before = await cohorts()
        for i in range(bodies):
            path, raw, statuses, names = fuzz_case(rng, schemas, n)
            answer = await client.post(path, content=raw,
                                       headers={"content-type": "application/json"})
            summary.bodies += 1
            summary.statuses[answer.status_code] += 1
            where = f"fuzz {i} POST {path} {raw[:120]!r}"
            if answer.status_code >= 500:
                summary.violations.append(f"{where}: HTTP {answer.status_code}")
                continue
            try:
                body = answer.json()
            except ValueError:
                summary.violations.append(f"{where}: HTTP {answer.status_code}, not JSON")
                continue
            if answer.status_code not in statuses or not isinstance(body, dict):
                summary.violations.append(f"{where}: HTTP {answer.status_code} (expected "
                                          f"{statuses}): {str(body)[:200]}")
                continue
            detail = body.get("detail")
            kind = body.get("failure_kind")
            expected = VERIFY_FAILURE_STATUS.get(kind) if isinstance(kind, str) else None
            if not isinstance(detail, str) or expected != answer.status_code:
                summary.violations.append(f"{where}: error body {str(body)[:200]}")
            elif names is not None and names not in detail:
                summary.violations.append(f"{where}: detail does not name {names!r}: "
                                          f"{detail[:200]}")
        after = await cohorts()
        if before != after:
            summary.violations.append(f"registry changed under malformed requests: "
                                      f"{before} -> {after}")
    return summary


# ------------------------------------------------------------------------------ command line


def print_local_summary(summary: LocalSummary, seed: int) -> None:
    """The ``--local`` report: counts, outcomes, and a failing schedule shrunk, with the seed
    that reproduces it."""
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(summary.outcomes.items()))
    click.echo(f"torture --local: {summary.schedules} schedules, {summary.requests} requests, "
               f"{summary.judge_calls} judge calls in {summary.wall_s:.1f} s (seed {seed})")
    click.echo(f"  outcomes: {kinds}")
    if summary.shrunk is None:
        click.echo("  violations: 0")
        return
    click.echo(f"  VIOLATION in schedule seed {summary.failing_seed}; shrunk to "
               f"{len(summary.shrunk.ops)} ops:")
    click.echo(summary.shrunk.describe())
    for v in summary.violations:
        click.echo(f"  - {v}")
    click.echo(f"  reproduce: genrm-trio torture --local --seed {summary.failing_seed} "
               "--schedules 1")


@click.command("torture")
@click.option("--local", is_flag=True, help="Run schedules against an in-process registry "
              "with a scripted judge and a virtual clock.")
@click.option("--schedules", type=click.IntRange(min=1), default=2000, show_default=True,
              help="--local: number of random schedules.")
@click.option("--max-ops", type=click.IntRange(min=1), default=24, show_default=True,
              help="--local: operations per schedule, at most.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed; --local schedule i uses seed+i.")
@click.option("--url", help="Base URL of a live /verify server to torture over HTTP.")
@click.option("--judge-url", help="Base URL of the genrm-trio mock judge the server uses "
              "(its /admin/fault API injects the faults).")
@click.option("--num-rollouts", type=int, default=None,
              help="The server's num_rollouts_per_prompt (default: read from GET /status).")
@click.option("--requests", "max_requests", type=click.IntRange(min=1), default=300,
              show_default=True, help="--url: stop after about this many requests.")
@click.option("--time-limit-s", type=float, default=120.0, show_default=True,
              help="--url: stop starting rounds after this many seconds.")
@click.option("--hang-after-s", type=float, default=60.0, show_default=True,
              help="--url: a request unanswered this long counts as hung (set above the "
                   "server's collection + evaluation deadlines).")
@click.option("--settle-s", type=float, default=0.0, show_default=True,
              help="--url: then wait this long and check GET /status for left-behind cohorts "
                   "and waiters (set past the server's deadlines; 0 skips).")
@click.option("--fuzz", "fuzz_bodies", type=click.IntRange(min=0), default=0, show_default=True,
              help="--url: first send this many malformed /verify and /compare bodies "
                   "(expects a quiet server: its /status must not change).")
@click.option("--no-reward-check", is_flag=True,
              help="--url: do not compare rewards with the heuristic judge's reference.")
@click.option("--server-token-env", default=None, metavar="ENV",
              help="--url: environment variable holding the server's bearer token (default: "
                   "GENRM_AUTH_TOKEN, sent only when set).")
def torture_cli(local: bool, schedules: int, max_ops: int, seed: int, url: str | None,
                judge_url: str | None, num_rollouts: int | None, max_requests: int,
                time_limit_s: float, hang_after_s: float, settle_s: float, fuzz_bodies: int,
                no_reward_check: bool, server_token_env: str | None) -> None:
    """Torture the cohort lifecycle: random schedules of arrivals, duplicates, conflicts,
    disconnects, attempts, deadlines, judge faults and shutdown, checked against the contract.

    Exit 0 when no violation was found, 1 otherwise (the failing schedule is printed shrunk,
    with the seed that reproduces it).

    \b
    genrm-trio torture --local --schedules 10000
    genrm-trio torture --url http://127.0.0.1:8000 --judge-url http://127.0.0.1:9000
    """
    if local == (url is not None):
        raise click.UsageError("pass exactly one of --local and --url")
    if local:
        # The scripted judge's crashes are logged with tracebacks by the registry: expected here.
        logging.getLogger("genrm_trio").setLevel(logging.CRITICAL)
        summary = run_local(schedules, seed, max_ops,
                            progress=lambda k: click.echo(f"  ... {k} schedules", err=True))
        print_local_summary(summary, seed)
        sys.exit(1 if summary.shrunk is not None else 0)
    assert url is not None
    token = os.environ.get(server_token_env or "GENRM_AUTH_TOKEN", "").strip() or None
    if server_token_env is not None and token is None:
        raise click.UsageError(f"--server-token-env: environment variable {server_token_env!r} "
                               "is not set")
    violations = 0
    if fuzz_bodies:
        fuzzed = trio.run(functools.partial(run_http_fuzz, url, bodies=fuzz_bodies, seed=seed,
                                            token=token))
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(fuzzed.statuses.items()))
        click.echo(f"fuzz {url}: {fuzzed.bodies} malformed bodies, "
                   f"{len(fuzzed.violations)} violations (statuses {codes})")
        for v in fuzzed.violations[:50]:
            click.echo(f"  - {v}")
        violations += len(fuzzed.violations)
    result = trio.run(functools.partial(
        run_http_torture, url, judge_url=judge_url, num_rollouts=num_rollouts,
        max_requests=max_requests, time_limit_s=time_limit_s, hang_after_s=hang_after_s,
        seed=seed, check_rewards=not no_reward_check, settle_s=settle_s, token=token))
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(result.statuses.items()))
    click.echo(f"torture --url {url}: {result.rounds} rounds, {result.requests} requests, "
               f"{result.disconnects} disconnects, {result.hung} hung, "
               f"{len(result.violations)} violations in {result.wall_s:.1f} s")
    click.echo(f"  answers: {statuses}")
    for v in result.violations[:50]:
        click.echo(f"  - {v}")
    violations += len(result.violations)
    sys.exit(1 if violations else 0)
