"""Smoke runs of the ``hostile_body`` and ``slow_readers`` bench presets (issue 26), small.

Real processes (mock judge, ``genrm-trio serve``) on loopback port 0, a few seconds each. They
check the harness and the outcome (bodies refused, connections reset and counted), and that the
report carries the figures; not the latency goals, which are the presets' (bench/README.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from genrm_trio.bench.cases.hostile_body import SHAPES, hostile_body, hostile_body_case
from genrm_trio.bench.cases.slow_readers import slow_readers_case
from genrm_trio.bench.presets import NOT_IN_ALL, PRESETS, SHOWN
from genrm_trio.bench.records import BenchContext
from genrm_trio.wire import DEFAULT_MAX_JSON_VALUES, decode_verify, json_value_count

SMOKE_BOUND_S = 120.0
PROBE_FIGURES = ("probe_p50_ms", "probe_p99_ms", "probe_max_ms")


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "at_bound"])
def test_every_hostile_shape_is_past_the_default_bound(shape: str) -> None:
    raw = hostile_body(shape, 4_000_000, "g")
    assert 3_900_000 < len(raw) <= 4_000_000
    assert json_value_count(raw, DEFAULT_MAX_JSON_VALUES) > DEFAULT_MAX_JSON_VALUES


def test_the_at_bound_body_is_exactly_at_the_bound_and_accepted() -> None:
    raw = hostile_body("at_bound", 200_000, "g", slot=1, max_values=5000)
    assert json_value_count(raw) == 5000 and 199_000 < len(raw) <= 200_000
    member = decode_verify(raw, 2, max_values=5000)
    assert member.group_id == "g" and member.rollout_index == 1


def test_the_presets_are_registered_and_kept_out_of_all() -> None:
    assert [c.label for c in PRESETS["hostile_body"]()] == list(SHAPES)
    assert [c.preset for c in PRESETS["slow_readers"]()] == ["slow_readers"]
    assert {"hostile_body", "slow_readers"} <= NOT_IN_ALL
    for preset in ("hostile_body", "slow_readers"):
        assert set(PROBE_FIGURES) <= set(SHOWN[preset])


async def test_a_short_hostile_body_run_refuses_every_body_and_rewards_every_cohort(
        tmp_path: Path) -> None:
    case = hostile_body_case("objects", body_bytes=400_000, interval_s=0.5, duration_s=2.0,
                             cohort_interval_s=0.5, probe_interval_s=0.1)
    with trio.fail_after(SMOKE_BOUND_S):  # a hang guard, not a timing goal
        run = await case.run(BenchContext(tmp_path, None), "ours", "hostile-smoke")
    metrics = run.metrics
    assert metrics["hostile_sent"] == 4 and metrics["hostile_413"] == 4, run.notes
    assert metrics["cohorts"] == 4 and metrics["rewarded"] == 4, run.notes
    assert metrics["rewarded_within_1s"] <= metrics["rewarded"]
    assert metrics["probes"] >= 1 and metrics["failed_probes"] == 0
    for name in (*PROBE_FIGURES, "cohort_p50_ms", "cohort_max_ms", "hostile_max_ms"):
        assert metrics[name] > 0, name


async def test_a_short_slow_readers_run_resets_the_stalled_connections(tmp_path: Path) -> None:
    # Three readers of an 8 MB answer (more than the kernel buffers between them and the
    # server) against a 20 MiB budget and a 1 s send timeout: every admitted replay stalls and
    # is reset, counted in /metrics; nothing is left unsent.
    case = slow_readers_case(readers=3, budget_bytes=20 * 2**20, send_timeout_s=1.0,
                             hold_s=4.0, probe_interval_s=0.1, label="smoke")
    with trio.fail_after(SMOKE_BOUND_S):
        run = await case.run(BenchContext(tmp_path, None), "ours", "readers-smoke")
    metrics = run.metrics
    assert metrics["send_timeout_s_set"] == 1.0
    assert metrics["send_timeouts"] >= 1 and metrics["ended_reset"] >= 1, run.notes
    assert metrics["ended_reset"] + metrics["ended_429"] == 3, run.notes
    assert metrics["ended_unfinished"] == 0 and metrics["unsent_end_mb"] == 0
    assert metrics["unsent_peak_mb"] > 0
    assert metrics["peak_rss_mb"] >= metrics["baseline_rss_mb"] > 0
    for name in PROBE_FIGURES:
        assert metrics[name] > 0, name
