"""The economy preset: the analytic minimum of computed prompt tokens, the cases it builds and
their overrides (``--economy KEY=VALUE``), and one tiny run in real processes (a mock judge and
``genrm-trio serve`` on loopback port 0) that shows a numeric cache capacity reaches the mock."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from genrm_trio import scoring
from genrm_trio.bench.cases.economy import (
    ROUTINGS,
    EconomyParams,
    _bodies,
    _members,
    _mock_command,
    _prompts,
    analytic_minimum,
    economy_cases,
    fresh,
    minimum_tokens,
    parse_economy_overrides,
    percentile,
    replacement,
    touching,
)
from genrm_trio.bench.cli import bench_cli
from genrm_trio.bench.presets import PRESETS, SHOWN
from genrm_trio.bench.run import run_bench
from genrm_trio.mock.prefix_cache import BLOCK_TOKENS, PREFIX_CACHE_SIZES


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


def test_the_default_cache_is_the_small_setting_by_name() -> None:
    params = EconomyParams()
    assert (params.cache, params.cache_tokens) == ("small", PREFIX_CACHE_SIZES["small"])
    cases = PRESETS["economy"]()
    assert all(c.label.endswith("-2ep-small") for c in cases)
    assert {c.params["cache_tokens"] for c in cases} == {PREFIX_CACHE_SIZES["small"]}
    command = _mock_command(params)
    assert command[command.index("--prefix-cache") + 1] == str(PREFIX_CACHE_SIZES["small"])


def test_overrides_set_a_numeric_capacity_and_the_sweep_shape() -> None:
    params = parse_economy_overrides(["cache=8192", "endpoints=4", "cohorts=1,8",
                                      "strategies=all_pairs", "replaced=0", "capacity=2",
                                      "prompt_token_s=1e-5"])
    assert (params.cache_tokens, params.endpoints, params.cohorts, params.strategies,
            params.replaced, params.capacity, params.prompt_token_s) == (
        8192, 4, (1, 8), ("all_pairs",), (0,), 2, 1e-5)
    command = _mock_command(params)
    assert command[command.index("--prefix-cache") + 1] == "8192"
    assert command[command.index("--capacity") + 1] == "2"
    cases = economy_cases(params)
    assert [c.label for c in cases] == ["n8-k1-all_pairs-4ep-8192tok",
                                        "n8-k8-all_pairs-4ep-8192tok"]
    assert {c.params["cache_tokens"] for c in cases} == {8192}
    batched = parse_economy_overrides(["engine=batched", "step_tokens=2048"])
    command = _mock_command(batched)
    assert "engine=batched" in command and "engine_step_tokens=2048" in command
    assert economy_cases(batched)[0].label.endswith("-2ep-small-batched")
    assert "engine=per_call" in _mock_command(EconomyParams())
    assert parse_economy_overrides(["cache=large"]).cache_tokens == PREFIX_CACHE_SIZES["large"]
    assert economy_cases(parse_economy_overrides(["cache=off"]))[0].label.endswith("-2ep-off")


@pytest.mark.parametrize(("item", "says"), [
    ("cache=huge", "cache: must be off, small, large or a token count"),
    ("cache=-4096", "cache: must be off, small, large or a token count"),
    ("cache=8k", "cache: must be off, small, large or a token count"),
    ("cache=", "cache: must be off, small, large or a token count"),
    ("cache=2000000000", "cache: must be off, small, large or a token count"),
    ("size=8192", "unknown key"),
    ("cache", "unknown key"),
    ("endpoints=two", "endpoints: bad value"),
    ("endpoints=0", "endpoints >= 1"),
    ("cohorts=0,8", "cohorts"),
    ("strategies=ring", "strategies"),
    ("replaced=9", "replaced"),
    ("latency_ms=-1", "latency_ms"),
    ("spill_factor=0.5", "spill_factor"),
    ("engine=vllm", "engine: one of per_call, batched"),
    ("step_tokens=0", "step_tokens"),
])
def test_a_bad_override_is_refused_naming_the_key(item: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_economy_overrides([item])


def test_a_bad_cache_value_fails_the_constructor_too() -> None:
    with pytest.raises(ValueError, match="cache: must be off, small, large or a token count"):
        EconomyParams(cache="16k")


def test_the_bench_command_refuses_a_bad_capacity_before_running_anything(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(bench_cli, ["--preset", "economy", "--servers", "ours",
                                            "--economy", "cache=big", "--out", str(out)])
    assert result.exit_code == 2
    assert "--economy cache: must be off, small, large or a token count" in result.output
    assert not out.exists()


async def test_a_numeric_capacity_reaches_the_mock_judges(tmp_path: Path) -> None:
    """One endpoint with one slot, so the three comparisons of a group of 3 run one after
    another; a cache of two blocks keeps only the first two blocks of the shared conversation
    (LRU, a prefix's first block evicted last), so each later call finds exactly those: the
    run reports 2 x 2 blocks cached in both arms, where ``small`` would find the whole
    conversation and ``off`` nothing."""
    params = parse_economy_overrides(["cache=" + str(2 * BLOCK_TOKENS), "endpoints=1", "n=3",
                                      "cohorts=1", "strategies=all_pairs", "capacity=1",
                                      "replaced=0"])
    results = await run_bench(["economy"], out_dir=tmp_path, kinds=("ours",), repeats=1,
                              echo=lambda _: None, economy_params=params)
    (result,) = results
    assert result.label == f"n3-k1-all_pairs-1ep-{2 * BLOCK_TOKENS}tok"
    (run,) = result.runs["ours"]
    assert "error" not in run.notes, run.notes
    m = run.metrics
    for routing in ROUTINGS:
        assert m[f"{routing}:judge_calls"] == 3.0
        assert m[f"{routing}:failed_groups"] == 0.0
        computed, fraction = m[f"{routing}:computed_tokens"], m[f"{routing}:cached_fraction"]
        cached = fraction * computed / (1.0 - fraction)  # cached / (computed + cached)
        assert cached == pytest.approx(2 * 2 * BLOCK_TOKENS)
    assert m["rewards_equal"] == 1.0
