"""The bench's structs: server and judge settings, a case, one run's record, a case's result.

Plain data, no I/O: every other bench module builds on these. ``results.json`` is a list of
:class:`CaseResult`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec

KINDS = ("ours", "nemo")

_Params = TypeVar("_Params")


def apply_overrides(flag: str, items: Iterable[str], params: _Params,
                    convert: Callable[[str, str], Any]) -> _Params:
    """``KEY=VALUE`` strings (a preset's ``--step`` / ``--economy`` items) over the dataclass
    ``params``: each value made by ``convert(key, value)``, which raises ``ValueError`` for a bad
    one. Raises ``ValueError`` naming ``flag`` and the key for an unknown key, a bad value, or
    what the dataclass's own checks refuse. Pure."""
    names = [f.name for f in fields(params)]  # type: ignore[arg-type]
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in names:
            raise ValueError(f"{flag} {item!r}: unknown key (one of {', '.join(names)})")
        try:
            changes[key] = convert(key, value)
        except ValueError as exc:
            raise ValueError(f"{flag} {key}: bad value {value!r} ({exc})") from None
    try:
        return replace(params, **changes)  # type: ignore[type-var]
    except ValueError as exc:
        raise ValueError(f"{flag} {exc}") from None


class BenchError(Exception):
    """A benchmark could not run (a process did not start, a venv is missing, ...)."""


@dataclass(frozen=True)
class ServerSettings:
    """The knobs a case sets on the server under test (same meaning for both servers)."""

    n: int = 16
    collection_timeout_s: float = 1800.0
    result_ttl_s: float | None = 3600.0
    max_terminal_cohorts: int = 4096
    ours_extra: tuple[tuple[str, str], ...] = ()
    """More ``--set KEY=VALUE`` items for our server only (NeMo Gym has no such keys)."""
    ours_env: tuple[tuple[str, str], ...] = ()
    """Environment variables set for our server's process only (the soak's diagnostics:
    ``PYTHONTRACEMALLOC``, ``MALLOC_ARENA_MAX``)."""


@dataclass(frozen=True)
class JudgeSettings:
    """The mock judge of a case: latency (plus uniform jitter) and capacity (None: unlimited)."""

    latency_ms: float = 50.0
    jitter_ms: float = 0.0
    capacity: int | None = None


@dataclass
class BenchContext:
    """Where logs go, where NeMo Gym lives, and a counter that makes run tags unique."""

    out_dir: Path
    nemo_dir: Path | None
    runs: int = 0


class RunRecord(msgspec.Struct):
    """One run of one case against one server: scalar metrics and raw samples (for plots)."""

    metrics: dict[str, float]
    samples: dict[str, list[float]] = msgspec.field(default_factory=dict)
    notes: dict[str, Any] = msgspec.field(default_factory=dict)


RunFn = Callable[[BenchContext, str, str], Awaitable[RunRecord]]


@dataclass(frozen=True)
class Case:
    """One measured configuration of a preset: ``run(ctx, kind, label)`` does one run.

    ``higher_is_better`` lists the metrics where a larger number is better (for the table).
    """

    preset: str
    label: str
    run: RunFn
    params: dict[str, Any] = field(default_factory=dict)
    kinds: tuple[str, ...] = KINDS
    """The servers the case compares; a case that measures only ours has ``("ours",)``."""
    resize: Callable[[float], Case] | None = None
    """For a case whose length is a parameter: the same case lasting that many seconds
    (``--duration-s``)."""


class CaseResult(msgspec.Struct):
    """Every run of one case: per server the runs in order, then medians and per-pair ratios."""

    preset: str
    label: str
    params: dict[str, Any]
    runs: dict[str, list[RunRecord]]
    median: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    pair_ratios: dict[str, list[float]] = msgspec.field(default_factory=dict)
    median_ratio: dict[str, float] = msgspec.field(default_factory=dict)
    skipped: dict[str, str] = msgspec.field(default_factory=dict)
