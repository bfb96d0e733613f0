"""The schedule model: the operations a schedule throws at a server (arrivals, disconnects, newer
attempts, time advancing, judge modes, shutdown), their frozen shapes and the seeded generator.

A new operation: its class here, then its handling in :mod:`genrm_trio.torture.local`."""

from __future__ import annotations

import random
from dataclasses import dataclass

from genrm_trio.config import Config

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
    #: ``incomplete_cohort_policy: judge_present`` (needs n >= 3) with this ``min_cohort_members``.
    partial: bool = False
    min_members: int | None = None

    def config(self) -> Config:
        return Config(
            incomplete_cohort_policy="judge_present" if self.partial else "fail",
            min_cohort_members=self.min_members,
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
                f"max_active={self.max_active}, judges={self.judges}, "
                f"partial={self.partial}, min_members={self.min_members})")
        return "\n".join([head, *(f"  {i:3d}. {op!r}" for i, op in enumerate(self.ops))])


def generate_schedule(rng: random.Random, max_ops: int = 24,
                      partial: bool = False) -> Schedule:
    """A random schedule from ``rng`` (same seed, same schedule). Pure; never blocks.

    ``partial``: the partial-cohort family (``incomplete_cohort_policy: judge_present``):
    cohorts of 3 or 4, and a whole group often arrives without one straggler, which may come
    later (then after its cohort was judged, or not). Without it the draws are as they always
    were, so a seed keeps its schedule."""
    n = rng.choice((3, 3, 4)) if partial else rng.choice((2, 2, 3))
    min_members = rng.choice((None, 2)) if partial else None
    ops: list[Op] = []
    sent = 0
    for _ in range(rng.randint(1, max_ops)):
        roll = rng.random()
        if roll < 0.12:  # a whole group arrives, in random order
            group = rng.randrange(NUM_GROUPS)
            slots = list(range(n))
            rng.shuffle(slots)
            if partial and rng.random() < 0.6:  # ... but for one straggler
                straggler = slots.pop()
                ops.extend(Arrive(group=group, slot=s) for s in slots)
                if rng.random() < 0.5:
                    ops.append(Advance(rng.choice(ADVANCES_S)))
                    ops.append(Arrive(group=group, slot=straggler))
                sent += len(slots)
                continue
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
        judges=rng.choice((1, 1, 2)), partial=partial, min_members=min_members,
    )
