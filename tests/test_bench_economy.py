"""The economy preset's pure parts: the analytic minimum of computed prompt tokens and the
cases it builds (the runs themselves start processes: ``genrm-trio bench --preset economy``)."""

from __future__ import annotations

from genrm_trio.bench.cases.economy import ROUTINGS, EconomyParams, _bodies, analytic_minimum
from genrm_trio.bench.presets import PRESETS, SHOWN


def test_the_minimum_counts_each_shared_prefix_once() -> None:
    bodies = _bodies("t")
    one_min, one_total = analytic_minimum(bodies, 1, 8, "all_pairs")
    # 28 prompts of ~2,000 tokens share a ~1,500-token history and each response_1
    assert 50_000 < one_total < 65_000
    assert one_min < one_total / 4
    # cohorts have different conversations (and answers of similar length): nothing is shared
    # between them, so two cost about twice one
    two_min, two_total = analytic_minimum(bodies, 2, 8, "all_pairs")
    assert 1.95 * one_total < two_total < 2.05 * one_total
    assert 1.95 * one_min < two_min < 2.05 * one_min
    circular_min, circular_total = analytic_minimum(bodies, 1, 8, "circular")
    assert circular_min < circular_total / 3  # 8 prompts, one shared history


def test_the_preset_runs_both_routings_per_strategy_and_cohort_count() -> None:
    cases = PRESETS["economy"]()
    params = EconomyParams()
    assert len(cases) == len(params.strategies) * len(params.cohorts)
    assert all(c.kinds == ("ours",) for c in cases)
    assert {f"{r}:computed_tokens" for r in ROUTINGS} <= set(SHOWN["economy"])
