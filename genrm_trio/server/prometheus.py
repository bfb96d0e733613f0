"""Prometheus text exposition for ``GET /metrics``.

Written by hand (about forty lines) rather than with prometheus_client: that library keeps a
process-global registry, and everything here already lives in counters owned by the registry and
the judge, so rendering them is all that is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genrm_trio.server.cohort import CohortRegistry
    from genrm_trio.server.judge import Judge


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, kind: str, help_text: str,
            samples: Iterable[tuple[Mapping[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {value:g}" if label_text else f"{name} {value:g}")
    return lines


def render_metrics(registry: CohortRegistry, judge: Judge) -> str:
    snap = registry.snapshot()
    counters = registry.counters
    lines: list[str] = []
    lines += _family("genrm_active_cohorts", "gauge", "Active cohorts by phase.", [
        ({"phase": "collecting"}, snap["collecting"]),
        ({"phase": "evaluating"}, snap["evaluating"]),
    ])
    lines += _family("genrm_waiters", "gauge", "Requests waiting on a cohort outcome.",
                     [({}, snap["waiters"])])
    lines += _family("genrm_retained_records", "gauge", "Terminal cohort records retained.",
                     [({}, snap["retained_records"])])
    lines += _family("genrm_active_bytes", "gauge", "Request bytes held by active cohorts.",
                     [({}, snap["active_bytes"])])
    lines += _family("genrm_cohorts_opened_total", "counter", "Cohorts opened.",
                     [({}, counters["cohorts_opened"])])
    lines += _family("genrm_cohorts_completed_total", "counter", "Cohorts completed.",
                     [({}, counters["cohorts_completed"])])
    lines += _family("genrm_cohorts_failed_total", "counter", "Cohorts failed, by kind.", [
        ({"kind": k.removeprefix("cohorts_failed_")}, v)
        for k, v in sorted(counters.items()) if k.startswith("cohorts_failed_")
    ])
    lines += _family("genrm_comparisons_started_total", "counter",
                     "Pair comparisons started by cohorts (each one judge_pair, retries included).",
                     [({}, counters["comparisons_started"])])
    lines += _family("genrm_comparisons_wasted_total", "counter",
                     "Comparisons started by cohorts that then failed (their verdicts discarded).",
                     [({}, counters["comparisons_wasted"])])
    lines += _family("genrm_verify_answers_total", "counter", "/verify answers, by outcome.", [
        ({"outcome": k.removeprefix("verify_")}, v)
        for k, v in sorted(counters.items()) if k.startswith("verify_")
    ])
    journal = registry.journal
    if journal is not None:
        state = journal.status()
        lines += _family("genrm_journal_degraded", "gauge",
                         "1 once a state journal write failed (memory stays the truth).",
                         [({}, float(state["degraded"]))])
        lines += _family("genrm_journal_write_failures_total", "counter",
                         "State journal writes that failed.", [({}, state["failed_writes"])])
    fields: dict[str, Any] = dataclasses.asdict(judge.stats)
    for name, value in sorted(fields.items()):
        if isinstance(value, Mapping):
            lines += _family(f"genrm_judge_{name}", "counter", f"Judge {name}, by reason.", [
                ({"reason": str(k)}, float(v)) for k, v in sorted(value.items())
            ])
        elif isinstance(value, (int, float)):
            kind = "counter" if not name.endswith("in_flight") else "gauge"
            lines += _family(f"genrm_judge_{name}", kind, f"Judge {name}.", [({}, float(value))])
    return "\n".join(lines) + "\n"
