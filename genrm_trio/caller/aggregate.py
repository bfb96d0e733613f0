"""Collection artifacts -> metrics input -> metrics; and ``genrm-trio aggregate``.

The artifacts of a collection to ``<out>.jsonl``:

- ``<out>.jsonl``: successes only, one verify response a line (a later line for the same
  (task, rollout) replaces an earlier one: a replaced group's new rows win);
- ``<out>_failures.jsonl``: one row per failed attempt, each with ``_ng_failure_class``;
- ``<out>_aggregate_metrics.json``: :func:`genrm_trio.metrics.encode_metrics` of the metrics.

:func:`build_metrics_input` turns successes and sidecar rows into the metrics function's input.
The collector calls it on the rows it holds in memory, ``genrm-trio aggregate`` on the rows it
reads back; rows survive the JSON round trip unchanged, so both give byte-identical metrics.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import msgspec

from genrm_trio.errors import GenRMError
from genrm_trio.metrics import (
    MASK_KEY,
    REWARD_KEY,
    ROLLOUT_INDEX_KEY,
    TASK_INDEX_KEY,
    aggregate_metrics,
    encode_metrics,
)

FAILURE_CLASS_KEY = "_ng_failure_class"

_DECODER = msgspec.json.Decoder()


class ArtifactError(GenRMError):
    """An artifact file is unreadable or holds a line that is not a JSON object."""


def failures_path_for(output_path: Path) -> Path:
    """``out.jsonl`` -> ``out_failures.jsonl`` (NeMo Gym's sidecar name)."""
    return output_path.with_name(output_path.stem + "_failures.jsonl")


def metrics_path_for(output_path: Path) -> Path:
    """``out.jsonl`` -> ``out_aggregate_metrics.json`` (NeMo Gym's metrics file name)."""
    return output_path.with_name(output_path.stem + "_aggregate_metrics.json")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every non-blank line of a JSONL file as a dict; a missing file reads as empty.

    Blocking file I/O (call it from a thread inside trio). Raises ArtifactError naming the file
    and line for anything that is not a JSON object.
    """
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    with path.open("rb") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = _DECODER.decode(line)
            except msgspec.DecodeError as exc:
                raise ArtifactError(f"{path}:{line_no}: not JSON ({exc})") from exc
            if not isinstance(row, dict):
                raise ArtifactError(f"{path}:{line_no}: not a JSON object")
            rows.append(row)
    return rows


def rollout_key(row: Mapping[str, Any]) -> tuple[Any, Any]:
    """(task index, rollout index) of a row; keys as stored, absent means None."""
    return row.get(TASK_INDEX_KEY), row.get(ROLLOUT_INDEX_KEY)


def slim_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a row the metrics can see: coordinates, mask, failure class, public numbers
    and ``response.usage``. Collector memory holds only these; the files keep the full rows."""
    slim: dict[str, Any] = {}
    for key, value in row.items():
        if key in (TASK_INDEX_KEY, ROLLOUT_INDEX_KEY, MASK_KEY, FAILURE_CLASS_KEY):
            slim[key] = value
        elif not key.startswith("_") and isinstance(value, bool | int | float):
            slim[key] = value
    response = row.get("response")
    if isinstance(response, Mapping) and isinstance(response.get("usage"), Mapping):
        slim["response"] = {"usage": dict(response["usage"])}
    return slim


@dataclass(frozen=True)
class MetricsInput:
    """What the metrics function is fed, and what the no-result guard looks at."""

    rows: list[dict[str, Any]]
    failed_rollouts: int
    successes: int
    counted_failures: int

    @property
    def has_result(self) -> bool:
        """False when there is no success and no counted failure: then no metrics are written."""
        return self.successes > 0 or self.counted_failures > 0


def _order(key: tuple[Any, Any]) -> tuple[str, str]:
    return repr(key[0]), repr(key[1])


def build_metrics_input(
    successes: Iterable[Mapping[str, Any]],
    failures: Iterable[Mapping[str, Any]],
    count_failure_classes_as_zero: Iterable[str] = (),
) -> MetricsInput:
    """Combine successes and sidecar rows into metrics input (pure; never raises on JSON rows).

    - Successes: the last row per (task, rollout) stands.
    - Sidecar: only the last row per (task, rollout) of a rollout that never succeeded counts.
      Its class listed in ``count_failure_classes_as_zero``: it enters as reward 0.0, unmasked,
      without its failure fields (the files are never touched). Else a masked row
      (``mask_sample`` true) enters as masked, for coverage. Else it is a failed rollout.
    """
    counted_classes = frozenset(count_failure_classes_as_zero)
    success_by_key: dict[tuple[Any, Any], dict[str, Any]] = {}
    for row in successes:
        success_by_key[rollout_key(row)] = slim_row(row)
    latest_failure: dict[tuple[Any, Any], Mapping[str, Any]] = {}
    for row in failures:
        latest_failure[rollout_key(row)] = row

    rows = [success_by_key[k] for k in sorted(success_by_key, key=_order)]
    failed = 0
    counted = 0
    for key in sorted(latest_failure, key=_order):
        if key in success_by_key:
            continue
        row = latest_failure[key]
        if row.get(FAILURE_CLASS_KEY) in counted_classes:
            zero = {
                k: v
                for k, v in slim_row(row).items()
                if not k.startswith("_ng_failure_") and k not in ("failure_kind", "failure_reason")
            }
            zero[MASK_KEY] = False
            zero[REWARD_KEY] = 0.0
            rows.append(zero)
            counted += 1
        elif row.get(MASK_KEY) is True:
            rows.append(slim_row(row))
        else:
            failed += 1
    return MetricsInput(
        rows=rows, failed_rollouts=failed, successes=len(success_by_key), counted_failures=counted
    )


def compute_metrics(metrics_input: MetricsInput) -> dict[str, Any]:
    """The metrics of a run: :func:`genrm_trio.metrics.aggregate_metrics` on the input rows."""
    return aggregate_metrics(metrics_input.rows, failed_rollouts=metrics_input.failed_rollouts)


NO_RESULT_REASON = (
    "no result: no rollout succeeded and no failure is counted as zero "
    "(see --count-failure-classes-as-zero); no metrics written"
)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write a file so readers see the old or the new content, never half (blocking I/O)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def aggregate_artifacts(
    output_path: Path, count_failure_classes_as_zero: Sequence[str] = ()
) -> tuple[bytes | None, MetricsInput]:
    """Recompute the metrics of ``output_path``'s artifacts (blocking file reads).

    Returns the canonical metrics bytes (None when the no-result guard applies) and the input.
    Raises ArtifactError for unreadable artifacts.
    """
    successes = read_jsonl(output_path)
    failures = read_jsonl(failures_path_for(output_path))
    metrics_input = build_metrics_input(successes, failures, count_failure_classes_as_zero)
    if not metrics_input.has_result:
        return None, metrics_input
    return encode_metrics(compute_metrics(metrics_input)), metrics_input


def split_classes(values: Iterable[str]) -> tuple[str, ...]:
    """Flatten repeated/comma-separated failure class options, order kept, duplicates dropped."""
    seen: dict[str, None] = {}
    for value in values:
        for part in value.replace(",", " ").split():
            seen[part] = None
    return tuple(seen)


@click.command("aggregate")
@click.argument("output", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--count-failure-classes-as-zero",
    "count_classes",
    multiple=True,
    metavar="CLASS[,CLASS...]",
    help="Sidecar failure classes that enter the metrics as reward 0.0 (repeatable).",
)
@click.option(
    "--metrics-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the metrics (default <out>_aggregate_metrics.json).",
)
def aggregate_cli(output: Path, count_classes: tuple[str, ...], metrics_out: Path | None) -> None:
    """Recompute a collection's metrics offline from OUTPUT.jsonl and its failure sidecar.

    Prints the metrics JSON and writes it; exits 1 (writing nothing) when there is no success
    and no counted failure. The sidecar and the rollouts file are only read.
    """
    if not output.exists() and not failures_path_for(output).exists():
        click.echo(f"genrm-trio aggregate: {output}: no such artifacts", err=True)
        raise SystemExit(2)
    try:
        encoded, _ = aggregate_artifacts(output, split_classes(count_classes))
    except ArtifactError as exc:
        click.echo(f"genrm-trio aggregate: {exc}", err=True)
        raise SystemExit(2) from exc
    if encoded is None:
        click.echo(f"genrm-trio aggregate: {NO_RESULT_REASON}", err=True)
        raise SystemExit(1)
    write_bytes_atomic(metrics_out or metrics_path_for(output), encoded)
    click.echo(encoded.decode(), nl=False)
