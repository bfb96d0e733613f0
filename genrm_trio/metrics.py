"""The one metrics function: NeMo Gym 0.7.0 reward-profile shaped metrics from verify responses.

Pure core: no I/O, no trio. ``genrm-trio collect`` (online), ``genrm-trio aggregate`` (offline)
and the server's ``POST /aggregate_metrics`` all call :func:`aggregate_metrics`, and write its
result with :func:`encode_metrics`, so the same rows always give byte-identical JSON.

Shape (names follow NeMo Gym 0.7.0's ``compute_aggregate_metrics`` so dashboards keep working)::

    {
      "group_level_metrics": [            # one entry per task with at least one scored rollout
        {"_ng_task_index": 3, "mean/reward": .., "max/reward": .., "min/reward": ..,
         "median/reward": .., "std/reward": .., <same for every other numeric field>,
         "num_rollouts": .., "expected_num_rollouts": .., "missing_num_rollouts": ..,
         "reward_profile_completion_pct": .., "rollout_infos": [...]}
      ],
      "agent_metrics": {"mean/reward": .., ..., "num_repeats": ..,
                        "coverage/...": ..,          # only when something was masked
                        "rollouts/scored": .., "rollouts/masked": ..,
                        "rollouts/failed": .., "rollouts/dropped": ..},
      "key_metrics": {"mean/...": .., "coverage/...": ..}
    }

Row rules:
- A row with ``mask_sample`` true is masked: it never enters a quality statistic; it is counted
  in ``coverage/*`` (NeMo Gym's names, present only when something was masked) and in
  ``rollouts/masked``.
- An unmasked row whose ``reward`` is missing, not a number, or not finite is dropped (counted in
  ``rollouts/dropped``): publishing a mean over an invented value would be worse than saying so.
- Numeric fields are the row's top-level keys not starting with ``_`` plus the numeric entries
  of ``response.usage``; booleans count as 0/1; ``mask_sample`` itself is a flag, not a metric.
- ``std/*`` is the sample standard deviation (n - 1), 0.0 for a single value.
- Every statistic is a Python float computed with exactly rounded sums (:func:`math.fsum`), so
  the result depends only on the multiset of rows, not on their order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

TASK_INDEX_KEY = "_ng_task_index"
ROLLOUT_INDEX_KEY = "_ng_rollout_index"
MASK_KEY = "mask_sample"
REWARD_KEY = "reward"

STATS: tuple[str, ...] = ("mean", "max", "min", "median", "std")

_ENCODER = msgspec.json.Encoder(order="sorted")


def _numeric(value: Any) -> float | None:
    """The value as a finite float if it is a JSON number or bool, else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        # + 0.0 folds -0.0 into 0.0, so equal values are also equal in every min/max/median.
        as_float = float(value) + 0.0
        return as_float if math.isfinite(as_float) else None
    return None


def _numeric_fields(row: Mapping[str, Any]) -> dict[str, float]:
    """The measurable fields of one row: public numeric keys, then ``response.usage`` numbers."""
    fields: dict[str, float] = {}
    for key, value in row.items():
        if key.startswith("_") or key == MASK_KEY:
            continue
        number = _numeric(value)
        if number is not None:
            fields[key] = number
    response = row.get("response")
    usage = response.get("usage") if isinstance(response, Mapping) else None
    if isinstance(usage, Mapping):
        for key, value in usage.items():
            number = _numeric(value)
            if number is not None and not key.startswith("_"):
                fields[key] = number
    return fields


def _median(ordered: Sequence[float]) -> float:
    n = len(ordered)
    mid = n // 2
    if n % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2.0


def describe(values: Iterable[float]) -> dict[str, float]:
    """mean, max, min, median and sample std of a non-empty collection of finite floats.

    Order-independent: the values are sorted first and sums are exactly rounded.
    Raises ValueError on an empty collection.
    """
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("describe() needs at least one value")
    mean = math.fsum(ordered) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in ordered) / (n - 1)) if n > 1 else 0.0
    return {
        "mean": mean,
        "max": ordered[-1],
        "min": ordered[0],
        "median": _median(ordered),
        "std": std,
    }


def _profile(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``stat/field`` for every numeric field present in at least one of the rows."""
    columns: dict[str, list[float]] = {}
    for row in rows:
        for key, value in _numeric_fields(row).items():
            columns.setdefault(key, []).append(value)
    out: dict[str, float] = {}
    for field in sorted(columns):
        for stat, value in describe(columns[field]).items():
            out[f"{stat}/{field}"] = value
    return out


def _coordinate(row: Mapping[str, Any], key: str) -> Any:
    """A task or rollout index as stored; absent or null means 0 (NeMo Gym's default)."""
    value = row.get(key)
    return 0 if value is None else value


def _sort_key(value: Any) -> tuple[int, Any]:
    """Total order over mixed index types (ints before anything else, then by text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (0, value)
    return (1, repr(value))


def _rollout_info(row: Mapping[str, Any]) -> dict[str, Any]:
    task = _coordinate(row, TASK_INDEX_KEY)
    rollout = _coordinate(row, ROLLOUT_INDEX_KEY)
    info: dict[str, Any] = {
        "rollout_id": f"{task}:{rollout}",
        TASK_INDEX_KEY: task,
        ROLLOUT_INDEX_KEY: rollout,
    }
    # Values as stored (an int stays an int), like NeMo Gym's per-rollout infos.
    for key, value in row.items():
        if key.startswith("_") or key == MASK_KEY or _numeric(value) is None:
            continue
        info[key] = int(value) if isinstance(value, bool) else value + 0
    response = row.get("response")
    usage = response.get("usage") if isinstance(response, Mapping) else None
    if isinstance(usage, Mapping):
        for key, value in usage.items():
            if not key.startswith("_") and _numeric(value) is not None:
                info[key] = int(value) if isinstance(value, bool) else value + 0
    return info


def aggregate_metrics(
    verify_responses: Sequence[Mapping[str, Any]],
    *,
    failed_rollouts: int = 0,
) -> dict[str, Any]:
    """Compute the run's metrics from verify responses (successes, masked rows, counted zeros).

    ``verify_responses``: the rows, each a JSON-like mapping with ``_ng_task_index``,
    ``_ng_rollout_index`` (absent means 0) and ``reward``. ``failed_rollouts``: how many rollouts
    failed without producing a row here (reported as ``rollouts/failed``; the server's
    ``/aggregate_metrics`` leaves it 0). Pure and synchronous: never blocks, raises nothing for
    any JSON-decoded input (bad rows are dropped and counted). The returned dict is new, owned by
    the caller, and JSON-serialisable; pass it to :func:`encode_metrics` for canonical bytes.
    """
    scored: list[Mapping[str, Any]] = []
    masked: list[Mapping[str, Any]] = []
    dropped = 0
    for row in verify_responses:
        if not isinstance(row, Mapping):
            dropped += 1
        elif row.get(MASK_KEY) is True:
            masked.append(row)
        elif _numeric(row.get(REWARD_KEY)) is None or isinstance(row.get(REWARD_KEY), bool):
            dropped += 1
        else:
            scored.append(row)

    counts = {
        "rollouts/scored": len(scored),
        "rollouts/masked": len(masked),
        "rollouts/failed": failed_rollouts,
        "rollouts/dropped": dropped,
    }
    coverage: dict[str, Any] = {}
    if masked:
        all_tasks = {_coordinate(r, TASK_INDEX_KEY) for r in (*scored, *masked)}
        scored_tasks = {_coordinate(r, TASK_INDEX_KEY) for r in scored}
        coverage = {
            "coverage/measured_rollouts": len(scored),
            "coverage/masked_rollouts": len(masked),
            "coverage/measured_tasks": len(scored_tasks),
            "coverage/fully_masked_tasks": len(all_tasks - scored_tasks),
        }

    if not scored:
        # Nothing was measured: a mean over an empty set would invent a number.
        return {
            "group_level_metrics": [],
            "agent_metrics": {**coverage, **counts},
            "key_metrics": dict(coverage),
        }

    by_task: dict[Any, list[Mapping[str, Any]]] = {}
    for row in scored:
        by_task.setdefault(_coordinate(row, TASK_INDEX_KEY), []).append(row)
    masked_by_task: dict[Any, int] = {}
    for row in masked:
        task = _coordinate(row, TASK_INDEX_KEY)
        masked_by_task[task] = masked_by_task.get(task, 0) + 1

    group_level_metrics: list[dict[str, Any]] = []
    for task in sorted(by_task, key=_sort_key):
        rows = by_task[task]
        infos = sorted(
            (_rollout_info(r) for r in rows),
            key=lambda info: (
                _sort_key(info[ROLLOUT_INDEX_KEY]), info["rollout_id"], _ENCODER.encode(info)
            ),
        )
        expected = len(rows) + masked_by_task.get(task, 0)
        group: dict[str, Any] = {TASK_INDEX_KEY: task, **_profile(rows)}
        group["num_rollouts"] = len(rows)
        group["expected_num_rollouts"] = expected
        group["missing_num_rollouts"] = expected - len(rows)
        group["reward_profile_completion_pct"] = 100.0 * len(rows) / expected
        group["rollout_infos"] = infos
        group_level_metrics.append(group)

    agent_metrics: dict[str, Any] = _profile(scored)
    agent_metrics["num_repeats"] = len(
        {repr(_coordinate(r, ROLLOUT_INDEX_KEY)) for r in (*scored, *masked)}
    )
    agent_metrics.update(coverage)
    agent_metrics.update(counts)
    key_metrics = {k: v for k, v in agent_metrics.items() if k.startswith("mean/")}
    key_metrics.update(coverage)
    return {
        "group_level_metrics": group_level_metrics,
        "agent_metrics": agent_metrics,
        "key_metrics": key_metrics,
    }


def encode_metrics(metrics: Mapping[str, Any]) -> bytes:
    """Canonical bytes of a metrics dict: sorted keys, 2-space indent, trailing newline.

    Equal dicts give identical bytes (floats use the shortest round-tripping repr).
    Raises ``msgspec.EncodeError`` for values JSON cannot hold.
    """
    return msgspec.json.format(_ENCODER.encode(metrics), indent=2) + b"\n"
