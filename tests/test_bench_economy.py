"""The economy preset's pure parts: the analytic minimum of computed prompt tokens and the
cases it builds (the runs themselves start processes: ``genrm-trio bench --preset economy``)."""

from __future__ import annotations

import msgspec

from genrm_trio import scoring
from genrm_trio.bench.cases.economy import (
    ROUTINGS,
    EconomyParams,
    _bodies,
    _members,
    _prompts,
    analytic_minimum,
    fresh,
    minimum_tokens,
    percentile,
    replacement,
    touching,
)
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


def test_a_replacement_changes_exactly_k_answers_and_its_minimum_counts_only_new_blocks() -> None:
    bodies = _bodies("r")
    members = _members(bodies, 0, 8)
    again = [msgspec.json.decode(b) for b in replacement(members, 2, 1)]
    assert [m["_ng_group_attempt"] for m in again] == [2] * 8
    assert [m["_ng_group_id"] for m in again] == [m["_ng_group_id"] for m in members]
    texts = [scoring.final_answer(m["response"]) for m in members]
    new = [scoring.final_answer(m["response"]) for m in again]
    assert [a != b for a, b in zip(texts, new, strict=True)] == [True] + [False] * 7
    # what a fresh cohort of the same answers sends: another group, attempt 0, same answers
    same = [msgspec.json.decode(b) for b in fresh(replacement(members, 2, 1), "other")]
    assert {m["_ng_group_id"] for m in same} == {"other"}
    assert [scoring.final_answer(m["response"]) for m in same] == new
    # 1 changed answer of 8 touches 7 of 28 all_pairs comparisons and 2 of 8 circular ones
    assert (touching(8, "all_pairs", 1), touching(8, "circular", 1)) == (7, 2)
    assert (touching(8, "all_pairs", 2), touching(8, "circular", 2)) == (13, 3)
    assert touching(8, "all_pairs", 0) == 0
    # after the step computed attempt 0, the replacement's minimum is its new blocks only
    seen: set[bytes] = set()
    step_min, _ = analytic_minimum(bodies, 1, 8, "all_pairs", seen)
    prompts = [p for i, j, p in _prompts(again, "all_pairs") if i < 1 or j < 1]
    least, total = minimum_tokens(prompts, seen)
    alone, _ = minimum_tokens(prompts, set())
    assert len(prompts) == 7 and least < alone < total
    assert least > 7 * 150  # each of the 7 computes at least its new ~200-token answers


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(v) for v in range(100)], 0.99) == 98.0
    assert percentile([5.0], 0.99) == 5.0
