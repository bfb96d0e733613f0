"""Shrinking a failing schedule: drop operations while it still fails."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from genrm_trio.torture.schedules import Schedule


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
