"""The RL-step model of the ``step`` bench preset (genrm_trio/bench/cases/step.py): the pure part
by hand-worked
examples, and a tiny real run of the preset (both schedules, real processes on loopback)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import msgspec
import pytest

from genrm_trio.bench.cases import step
from genrm_trio.bench.cases.step import StepParams, step_cases
from genrm_trio.bench.run import run_bench


def test_the_trace_is_seeded_lognormal_and_shaped_by_the_parameters() -> None:
    p = StepParams(n=8, k=64, median_gen_s=2.0, sigma=0.5, seed=3)
    trace = step.arrival_trace(p)
    assert trace == step.arrival_trace(p)
    assert trace != step.arrival_trace(StepParams(n=8, k=64, median_gen_s=2.0, seed=4))
    assert len(trace) == 64 and all(len(g) == 8 for g in trace)
    flat = [t for g in trace for t in g]
    assert 1.8 < statistics.median(flat) < 2.2
    logs = [math.log(t) for t in flat]
    assert 0.45 < statistics.stdev(logs) < 0.55
    assert max(flat) <= 40.0


ARRIVALS = [[0.0, 1.0, 4.0], [2.0, 2.0, 3.0]]
CIRCULAR = [(0, 1), (1, 2), (2, 0)]


def test_ready_times_peak_demand_and_the_lower_bound_by_hand() -> None:
    assert step.ready_times(ARRIVALS, CIRCULAR, "eager") == [1.0, 4.0, 4.0, 2.0, 3.0, 3.0]
    assert step.ready_times(ARRIVALS, CIRCULAR, "wait_for_all") == [4.0] * 3 + [3.0] * 3
    assert step.peak_demand(step.ready_times(ARRIVALS, CIRCULAR, "eager"), 0.5) == 2
    assert step.peak_demand(step.ready_times(ARRIVALS, CIRCULAR, "wait_for_all"), 2.0) == 6
    # 6 calls of 1 s: capacity 1 -> first pair at 1 + 6 s of work; capacity 6 -> last (4) + 1
    assert step.lower_bound(ARRIVALS, CIRCULAR, 1.0, 1) == 7.0
    assert step.lower_bound(ARRIVALS, CIRCULAR, 1.0, 6) == 5.0


def test_the_ideal_judge_queue_by_hand() -> None:
    eager = step.ready_times(ARRIVALS, CIRCULAR, "eager")
    wait = step.ready_times(ARRIVALS, CIRCULAR, "wait_for_all")
    # one slot, 1 s each: eager runs 1-2, 2-3, 3-4, 4-5, 5-6, 6-7; wait_for_all starts at 3
    assert step.ideal_makespan(eager, 1.0, 1, 0.0) == 7.0
    assert step.ideal_makespan(wait, 1.0, 1, 0.0) == 9.0
    assert step.ideal_makespan(eager, 1.0, 6, 0.0) == 5.0


def test_the_smallest_capacity_for_a_perfect_judge_by_hand() -> None:
    # Last arrival 4: within 10% means done by 4.4. With 0.25 s calls eager needs 2 slots (the
    # two calls of the last member at 4.0, the rest trickled in before), wait_for_all 3 (group
    # 0's three calls all land at 4.0).
    assert step.smallest_capacity(ARRIVALS, CIRCULAR, 0.25, "eager") == 2
    assert step.smallest_capacity(ARRIVALS, CIRCULAR, 0.25, "wait_for_all") == 3
    assert step.smallest_capacity(ARRIVALS, CIRCULAR, 0.5, "eager") is None  # 4.5 > 4.4


def test_the_default_sweep_spans_below_and_above_the_peak_demand() -> None:
    p = StepParams(n=8, k=16, judge_ms=500.0)
    caps = step.default_capacities(p)
    trace = step.arrival_trace(p)
    pairs = step.pairs_of(p)
    eager_peak = step.peak_demand(step.ready_times(trace, pairs, "eager"), p.judge_s)
    wait_peak = step.peak_demand(step.ready_times(trace, pairs, "wait_for_all"), p.judge_s)
    assert min(caps) < eager_peak <= wait_peak == max(caps)
    assert math.ceil(step.mean_demand(p)) in caps


def test_overrides_are_parsed_and_bad_ones_name_the_key() -> None:
    p = step.parse_overrides(["n=16", "strategy=all_pairs", "capacities=4,8", "judge_ms=30",
                              "orders=arrival,closest_group"])
    assert (p.n, p.strategy, p.capacities, p.judge_ms) == (16, "all_pairs", (4, 8), 30.0)
    assert p.orders == ("arrival", "closest_group")
    for bad, key in (("nope=1", "unknown key"), ("n=x", "n"), ("strategy=ring", "strategy"),
                     ("n=1", "n >= 2"), ("capacities=0", "capacities")):
        with pytest.raises(ValueError, match=key):
            step.parse_overrides([bad])


async def test_the_step_preset_runs_both_schedules_side_by_side(tmp_path: Path) -> None:
    params = StepParams(n=3, k=3, median_gen_s=0.05, sigma=0.5, judge_ms=20.0,
                        capacities=(1, 6), seed=2)
    assert {c.kinds for c in step_cases(params)} == {("ours",)}  # NeMo has no eager
    results = await run_bench(["step"], out_dir=tmp_path, kinds=("ours",),
                                    repeats=1, echo=lambda _: None, step_params=params)
    assert [r.params["capacity"] for r in results] == [1, 6]
    for r in results:
        (run,) = r.runs["ours"]
        assert "error" not in run.notes, run.notes
        m = run.metrics
        for key in ("wait_for_all", "eager"):
            assert m[f"{key}:failed_groups"] == 0.0
            assert m[f"{key}:rewards_equal"] == 1.0
            assert m[f"{key}:judge_calls"] == 9.0  # 3 groups of 3 circular comparisons
            assert m[f"{key}:wasted"] == 0.0
            # Physical bounds: nothing beats the lower bound; the judge is never over-busy.
            assert m[f"{key}:makespan_s"] >= m[f"{key}:lower_bound_s"] > 0
            assert 0 < m[f"{key}:utilisation"] <= 1.0
            assert m[f"{key}:makespan_s"] >= m[f"{key}:last_arrival_s"]
            assert 0 < m[f"{key}:group_p50_s"] <= m[f"{key}:group_p99_s"]
            assert len(run.samples[f"{key}:t"]) == len(run.samples[f"{key}:in_flight"]) > 0
            assert max(run.samples[f"{key}:in_flight"]) <= r.params["capacity"]
    saved = msgspec.json.decode((tmp_path / "results.json").read_bytes())
    assert saved[0]["preset"] == "step"
    summary = (tmp_path / "summary.md").read_text()
    assert "### step: makespan against judge capacity" in summary
    assert "| 1 | eager |" in summary and "| 6 | wait_for_all |" in summary
    assert "eager: smallest judge capacity finishing within 10% of the last arrival" in summary
    assert "for a perfect judge on this trace" in summary
