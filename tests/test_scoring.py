"""Tests for genrm_trio.scoring. Expected values are worked out by hand in the comments."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genrm_trio.config import Config
from genrm_trio.errors import GenRMError, JudgeParseError
from genrm_trio.scoring import (
    Comparison,
    Verdict,
    _balanced_objects,
    aggregate,
    comparison_pairs,
    conversation_history,
    final_answer,
    heuristic_judge_text,
    parse_judge_output,
    reasoning_text,
    style_density,
)


def resp(answer: str = "", reasoning: str = "") -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": reasoning}]}
        )
    output.append({"type": "message", "content": [{"type": "output_text", "text": answer}]})
    return {"output": output}


def comp(i: int, j: int, s1: float, s2: float, r: float, k: int = 0) -> Comparison:
    return Comparison(response_i=i, response_j=j, judge_idx=k, score_1=s1, score_2=s2, ranking=r)


# ------------------------------------------------------------------------------------ pairs


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("strategy", ["circular", "all_pairs"])
def test_fewer_than_two_responses_need_no_pairs(n: int, strategy: str) -> None:
    assert comparison_pairs(n, strategy, 1) == []
    assert comparison_pairs(n, strategy, 3) == []


def test_circular_pairs() -> None:
    # Two responses: each order is judged once (N calls for N responses, as NeMo Gym).
    assert comparison_pairs(2, "circular", 1) == [(0, 1, 0), (1, 0, 0)]
    assert comparison_pairs(3, "circular", 1) == [(0, 1, 0), (1, 2, 0), (2, 0, 0)]
    assert comparison_pairs(4, "circular", 1) == [(0, 1, 0), (1, 2, 0), (2, 3, 0), (3, 0, 0)]


def test_all_pairs() -> None:
    assert comparison_pairs(2, "all_pairs", 1) == [(0, 1, 0)]
    assert comparison_pairs(3, "all_pairs", 1) == [(0, 1, 0), (0, 2, 0), (1, 2, 0)]
    assert comparison_pairs(4, "all_pairs", 1) == [
        (0, 1, 0), (0, 2, 0), (0, 3, 0), (1, 2, 0), (1, 3, 0), (2, 3, 0),
    ]  # fmt: skip


def test_two_judges_repeat_the_pair_list_judge_major() -> None:
    assert comparison_pairs(3, "circular", 2) == [
        (0, 1, 0), (1, 2, 0), (2, 0, 0),
        (0, 1, 1), (1, 2, 1), (2, 0, 1),
    ]  # fmt: skip
    assert comparison_pairs(2, "all_pairs", 2) == [(0, 1, 0), (0, 1, 1)]
    assert len(comparison_pairs(16, "all_pairs", 2)) == 2 * 16 * 15 // 2
    assert len(comparison_pairs(16, "circular", 2)) == 2 * 16


def test_bad_pair_arguments_raise() -> None:
    with pytest.raises(GenRMError, match="strategy"):
        comparison_pairs(3, "round_robin", 1)
    with pytest.raises(GenRMError, match="num_judges"):
        comparison_pairs(3, "circular", 0)


# ------------------------------------------------------------------- history and answers


def test_history_from_a_string_is_one_user_message() -> None:
    assert conversation_history("hello") == [{"role": "user", "content": "hello"}]
    assert conversation_history(None) == []
    assert conversation_history([]) == []


def test_history_keeps_message_items_only() -> None:
    prompt = [
        {"role": "system", "content": "be nice"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "2+"},
                {"type": "input_image", "image_url": "x"},
                {"type": "input_text", "text": "2?"},
            ],
        },
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hidden"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"type": "function_call", "name": "f", "arguments": "{}"},
        {"type": "message", "content": "no role"},
        {"content": "untyped, no role"},
        {"type": "message", "role": "user", "content": None},
        "not a dict",
        {"unrelated": True},
    ]
    assert conversation_history(prompt) == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "no role"},
        {"role": "user", "content": "untyped, no role"},
        {"role": "user", "content": ""},
    ]


def test_final_answer_concatenates_output_text_of_messages() -> None:
    response = {
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think "}]},
            {"type": "message", "content": [
                {"type": "output_text", "text": "Par"},
                {"type": "refusal", "refusal": "no"},
                {"type": "output_text", "text": "is"},
            ]},
            {"type": "function_call", "arguments": "{}"},
            {"type": "message", "content": [{"type": "output_text", "text": "!"}]},
        ]
    }  # fmt: skip
    assert final_answer(response) == "Paris!"
    assert reasoning_text(response) == "think "


@pytest.mark.parametrize(
    "response",
    [
        {"output": []},
        {},
        {"output": "text"},
        {"output": [{"type": "message", "content": [{"type": "output_text", "text": "  \n"}]}]},
        {"output": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]}]},
    ],
)
def test_blank_final_answer_is_the_literal_none(response: dict[str, Any]) -> None:
    assert final_answer(response) == "None"


def test_reasoning_text_joins_summary_parts() -> None:
    response = resp("x", "a")
    response["output"].insert(1, {"type": "reasoning", "summary": [{"text": "b"}, {"text": 3}]})
    assert reasoning_text(response) == "ab"
    assert reasoning_text(resp("x")) == ""


# ------------------------------------------------------------------------------ parsing


def test_fenced_json_wins_over_later_objects() -> None:
    text = (
        'Draft {"score_1": 1, "score_2": 1, "ranking": 6}\n'
        '```json\n{"score_1": 4, "score_2": 3, "ranking": 2}\n```\n'
        'Afterthought {"score_1": 5, "score_2": 5, "ranking": 1}'
    )
    assert parse_judge_output(text, 3.0, 3.5) == Verdict(4.0, 3.0, 2.0)


def test_first_valid_object_among_fenced_blocks() -> None:
    text = (
        '```json\n{"note": "no scores"}\n```\n'
        '```JSON\n{"also": 1} {"score_1": 2} {"score_1": 5}\n```'
    )
    assert parse_judge_output(text, 3.0, 3.5) == Verdict(2.0, 3.0, 3.5)


def test_last_valid_top_level_object_without_fence() -> None:
    text = (
        'First {"score_1": 1, "score_2": 2, "ranking": 5}, then\n'
        '{\n  "score_1": 5,\n  "score_2": 4,\n  "ranking": 1\n}\n'
        'and some trailing prose {"not": "scores"}'
    )
    assert parse_judge_output(text, 3.0, 3.5) == Verdict(5.0, 4.0, 1.0)


def test_overall_sub_object_is_used() -> None:
    text = (
        '{"rubric_evaluations": [{"score_1": 1, "score_2": 5, "ranking": 6}],'
        ' "overall": {"score_1": 5, "score_2": 2, "ranking": 1}}'
    )
    assert parse_judge_output(text, 3.0, 3.5) == Verdict(5.0, 2.0, 1.0)
    # An "overall" that is not an object is just another key.
    assert parse_judge_output('{"overall": 3, "score_1": 2}', 3.0, 3.5) == Verdict(2.0, 3.0, 3.5)


def test_missing_fields_take_the_given_defaults() -> None:
    assert parse_judge_output('{"score_1": 4}', 2.5, 4.0) == Verdict(4.0, 2.5, 4.0)
    assert parse_judge_output('{"ranking": 1}', 2.5, 4.0) == Verdict(2.5, 2.5, 1.0)


def test_braces_inside_strings_do_not_count() -> None:
    text = '{"why": "use } and { and \\" quotes", "score_1": 2, "score_2": 5, "ranking": 6}'
    assert parse_judge_output(text, 3.0, 3.5) == Verdict(2.0, 5.0, 6.0)


def test_unclosed_brace_is_skipped_but_a_balanced_outer_object_hides_its_inner_ones() -> None:
    # The outer "{" never closes: the scan moves on and finds the inner object.
    assert parse_judge_output('{ "x": {"score_1": 4}', 3.0, 3.5) == Verdict(4.0, 3.0, 3.5)
    # The outer object is balanced but not JSON: it is one candidate, and it is invalid.
    with pytest.raises(JudgeParseError):
        parse_judge_output('{bad {"score_1": 4}}', 3.0, 3.5)


def test_numeric_strings_count_like_numbers() -> None:
    text = '{"score_1": "4", "score_2": " 2.5 ", "ranking": "1"}'
    assert parse_judge_output(text, 3.0, 3.5) == Verdict(4.0, 2.5, 1.0)


@pytest.mark.parametrize("key", ["score_1", "score_2", "ranking"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e309", '"nan"', '"inf"'])
def test_non_finite_values_are_rejected(key: str, value: str) -> None:
    fields = {"score_1": "4", "score_2": "2", "ranking": "1"} | {key: value}
    text = "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"
    with pytest.raises(JudgeParseError):
        parse_judge_output(text, 3.0, 3.5)
    # A non-finite object is skipped like any invalid one: an earlier valid object wins.
    assert parse_judge_output('{"score_1": 1} ' + text, 3.0, 3.5) == Verdict(1.0, 3.0, 3.5)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "I prefer response 1.",
        '{"foo": 1}',
        '{"score_1": "four"}',
        '{"score_1": null}',
        '{"score_1": [4]}',
        '{"score_1": 4',
        "```json\nnot json\n```",
        '{"score_1": 1' + "0" * 400 + "}",
    ],
)
def test_unusable_answers_raise_a_parse_error(text: str) -> None:
    with pytest.raises(JudgeParseError) as info:
        parse_judge_output(text, 3.0, 3.5)
    assert 0 < len(str(info.value)) < 120


def _reference_objects(text: str) -> list[str]:
    """A character-at-a-time brace scanner with the documented semantics, to check the fast one."""
    spans: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "{":
            depth, in_string, escaped = 0, False, False
            for j in range(i, len(text)):
                ch = text[j]
                if escaped:
                    escaped = False
                elif in_string and ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = not in_string
                elif in_string:
                    pass
                elif ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        spans.append(text[i : j + 1])
                        i = j
                        break
        i += 1
    return spans


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet='{}"\\ a1:', max_size=40))
def test_fast_brace_scanner_matches_the_reference(text: str) -> None:
    assert _balanced_objects(text) == _reference_objects(text)


@pytest.mark.parametrize("text", ["{" * 60_000, '{"' * 30_000, '{"\\' * 20_000, "}{" * 30_000])
def test_degenerate_answers_parse_quickly(text: str) -> None:
    # Repetition loops are a real judge failure mode; each of these is a fast parse failure.
    with pytest.raises(JudgeParseError):
        parse_judge_output(text + '"', 3.0, 3.5)


# -------------------------------------------------------------------------- aggregation


def test_tiebreaker_and_means_worked_example() -> None:
    cfg = Config()
    comparisons = [
        comp(0, 1, 4, 2, 2),  # no tie: R0 += 4, R1 += 2
        comp(1, 2, 3, 3, 5),  # tie, d = 3.5 - 5 = -1.5: R1 += 1.5, R2 += 4.5
        comp(2, 0, 2, 5, 6),  # no tie: R2 += 2, R0 += 5
    ]
    responses = [resp("a"), resp("b"), resp("c")]
    rewards, metrics = aggregate(comparisons, responses, cfg)
    # R0 = (4 + 5) / 2, R1 = (2 + 1.5) / 2, R2 = (4.5 + 2) / 2
    assert rewards == [4.5, 1.75, 3.25]
    # Raw scores 4, 2, 3, 3, 2, 5: mean 19/6, population variance 67/6 - (19/6)^2 = 41/36.
    assert metrics["mean_individual_score"] == pytest.approx(19 / 6)
    assert metrics["std_individual_score"] == pytest.approx(math.sqrt(41) / 6)
    assert metrics["tiebreak_usage_rate"] == pytest.approx(1 / 3)
    assert set(metrics) == {"mean_individual_score", "std_individual_score", "tiebreak_usage_rate"}

    shuffled = list(comparisons)
    random.Random(7).shuffle(shuffled)
    assert aggregate(shuffled, responses, cfg) == (rewards, metrics)


def test_tie_favouring_response_one_and_multiple_judges() -> None:
    # Judge 0: tie at 3 with ranking 2 -> d = 1.5: R0 4.5, R1 1.5.
    # Judge 1: 2 vs 4, no tie. R0 = (4.5 + 2) / 2 = 3.25, R1 = (1.5 + 4) / 2 = 2.75.
    rewards, metrics = aggregate(
        [comp(0, 1, 3, 3, 2, k=0), comp(0, 1, 2, 4, 5, k=1)], [resp("a"), resp("b")], Config()
    )
    assert rewards == [3.25, 2.75]
    assert metrics["tiebreak_usage_rate"] == 0.5


def test_members_without_comparisons_get_the_default_score() -> None:
    rewards, _ = aggregate(
        [comp(0, 1, 5, 1, 1)], [resp("a"), resp("b"), resp("c")], Config(default_score=2.5)
    )
    assert rewards == [5.0, 1.0, 2.5]
    assert aggregate([], [resp("a")], Config()) == ([3.0], {})
    assert aggregate([], [], Config()) == ([], {})


def _four_member_cohort() -> tuple[list[Comparison], list[dict[str, Any]]]:
    # Base rewards: R0 = 5, R1 = 1, R2 = 4, R3 = 2.
    comparisons = [comp(0, 1, 5, 1, 1), comp(2, 3, 4, 2, 2)]
    # Reasoning lengths 10, 0, 3, 2; answer lengths 6, 20, 2, 8.
    responses = [
        resp("x" * 6, "r" * 10),
        resp("y" * 20),
        resp("zz", "rrr"),
        resp("w" * 8, "rr"),
    ]
    return comparisons, responses


def test_top_performer_bonuses() -> None:
    comparisons, responses = _four_member_cohort()
    # top_percentile 0.5: threshold = sorted desc [5, 4, 2, 1][int(4 * 0.5) - 1] = 4.
    # Shortest non-empty reasoning is R3 (2 chars) but R3 scores 2 < 4: no reasoning bonus.
    # Shortest answer is R2 (2 chars), R2 scores 4 >= 4: R2 gets the answer bonus.
    cfg = Config(reasoning_bonus=1.0, answer_bonus=0.5, top_percentile=0.5)
    rewards, _ = aggregate(comparisons, responses, cfg)
    assert rewards == [5.0, 1.0, 4.5, 2.0]
    # With every member eligible (threshold = the lowest score) R3 gets the reasoning bonus.
    cfg = Config(reasoning_bonus=1.0, top_percentile=1.0)
    assert aggregate(comparisons, responses, cfg)[0] == [5.0, 1.0, 4.0, 3.0]
    # top_percentile 0.2 of 4 members: int(0.8) - 1 < 0, so index 0: only the best (5) is eligible.
    cfg = Config(answer_bonus=0.5, top_percentile=0.2)
    assert aggregate(comparisons, responses, cfg)[0] == [5.0, 1.0, 4.0, 2.0]


def test_group_length_adjustments_are_zero_centred() -> None:
    comparisons, responses = _four_member_cohort()
    # Reasoning lengths 10, 0, 3, 2: raw weights 1 - len/10 = 0, 1, .7, .8 (mean .625)
    #   -> -.625, .375, .075, .175; times 0.2 -> -.125, .075, .015, .035.
    # Answer lengths 6, 20, 2, 8: raw weights 1 - (len - 2)/18 = 14/18, 0, 1, 12/18 (mean 11/18)
    #   -> 3/18, -11/18, 7/18, 1/18; times 0.18 -> .03, -.11, .07, .01.
    cfg = Config(group_reasoning_length_penalty_coeff=0.2, group_answer_length_penalty_coeff=0.18)
    rewards, _ = aggregate(comparisons, responses, cfg)
    assert rewards == pytest.approx([4.905, 0.965, 4.085, 2.045])
    assert sum(rewards) == pytest.approx(5 + 1 + 4 + 2)


def test_equal_lengths_give_no_length_adjustment() -> None:
    cfg = Config(group_answer_length_penalty_coeff=1.0, group_reasoning_length_penalty_coeff=1.0)
    rewards, _ = aggregate([comp(0, 1, 4, 2, 2)], [resp("ab"), resp("cd")], cfg)
    assert rewards == [4.0, 2.0]


def test_style_density_counts_markdown_outside_code() -> None:
    # Header, list item, bold: 3 elements over 23 characters.
    assert style_density("# Title\n- item\n**bold**") == pytest.approx(3 / 23)
    # Ordered item, unordered item, bold, two emoji: 5 elements over 25 characters.
    assert style_density("1. one\n+ two\n__three__ \U0001f600\u2705") == pytest.approx(5 / 25)
    assert style_density("```md\n# no\n- no\n**no**\n```\nplain") == 0.0
    assert style_density("####### seven hashes\ninline # no\n1.no\n-no\n**open") == 0.0
    assert style_density("") == 0.0
    assert style_density("```\n# only code\n```") == 0.0


def test_style_penalty_is_zero_centred_and_ignores_code_blocks() -> None:
    responses = [
        resp("plain answer"),  # density 0
        resp("# Title\n- item\n**bold**"),  # density 3/23
        resp("```\n# not a header\n- nope\n```\nplain"),  # density 0: the code block is ignored
    ]
    comparisons = [comp(0, 1, 3, 3, 3.5), comp(1, 2, 3, 3, 3.5), comp(2, 0, 3, 3, 3.5)]
    # Base rewards 3, 3, 3. Raw weights 1, 0, 1 (mean 2/3) -> 1/3, -2/3, 1/3; times 0.3.
    rewards, metrics = aggregate(comparisons, responses, Config(group_style_penalty_coeff=0.3))
    assert rewards == pytest.approx([3.1, 2.8, 3.1])
    assert metrics["tiebreak_usage_rate"] == 1.0


def test_bonuses_use_raw_answers_and_skip_singletons() -> None:
    # A single response is never adjusted.
    cfg = Config(answer_bonus=1.0, group_style_penalty_coeff=1.0, top_percentile=1.0)
    assert aggregate([], [resp("# styled")], cfg)[0] == [3.0]
    # A blank answer has length 0, so it cannot win the shortest-answer bonus.
    rewards, _ = aggregate([comp(0, 1, 4, 4, 3.5)], [resp(""), resp("long answer")], cfg)
    assert rewards == [4.0, 5.0]


def test_out_of_range_comparison_raises() -> None:
    with pytest.raises(GenRMError, match="outside"):
        aggregate([comp(0, 2, 1, 2, 3)], [resp("a"), resp("b")], Config())


def test_verdicts_that_could_overflow_raise() -> None:
    huge = 1.7e308
    with pytest.raises(GenRMError, match="beyond"):
        aggregate(
            [comp(0, 1, huge, huge, 3.5), comp(1, 0, huge, huge, 3.5)], [resp(), resp()], Config()
        )


# ------------------------------------------------------------------------ heuristic judge

HISTORY = [{"role": "user", "content": "What is the capital of France and why?"}]


def _verdict(a: str, b: str, principle: str | None = None) -> Verdict:
    return parse_judge_output(heuristic_judge_text(HISTORY, a, b, principle), 3.0, 3.5)


def test_heuristic_judge_is_deterministic_and_parseable() -> None:
    a = "Paris is the capital of France, because the government sits there."
    b = "I am not sure."
    text = heuristic_judge_text(HISTORY, a, b, None)
    assert text == heuristic_judge_text(list(HISTORY), a, b, None)
    assert "```json\n" in text
    verdict = parse_judge_output(text, 3.0, 3.5)
    # Different answers: a clear preference, with the ranking on the side of the higher score.
    assert verdict.ranking in {1, 2, 3, 4, 5, 6}
    assert (verdict.score_1 - verdict.score_2) * (3.5 - verdict.ranking) >= 0


def test_heuristic_judge_accepts_lone_surrogates() -> None:
    verdict = _verdict("Paris \ud800", "Lyon \udc00", "be \ud800 brief")
    assert verdict == _verdict("Paris \ud800", "Lyon \udc00", "be \ud800 brief")
    assert verdict.ranking != 3.5


def test_heuristic_judge_equal_answers_tie_at_the_midpoint() -> None:
    verdict = _verdict("Paris.", "Paris.")
    assert verdict.score_1 == verdict.score_2 and verdict.ranking == 3.5


def test_heuristic_judge_puts_empty_answers_last() -> None:
    verdict = _verdict("None", "Paris is the capital of France.")
    assert verdict.score_1 == 1.0 and verdict.score_2 > 1.0 and verdict.ranking > 3.5


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80), st.text(max_size=80), st.one_of(st.none(), st.text(max_size=10)))
def test_heuristic_judge_is_symmetric_and_consistent(a: str, b: str, principle: str | None) -> None:
    forward = _verdict(a, b, principle)
    backward = _verdict(b, a, principle)
    assert backward == Verdict(forward.score_2, forward.score_1, 7 - forward.ranking)
    assert forward.score_1 in {1, 2, 3, 4, 5} and forward.score_2 in {1, 2, 3, 4, 5}
    assert 1 <= forward.ranking <= 6
    if forward.score_1 > forward.score_2:
        assert forward.ranking < 3.5
    if forward.score_1 < forward.score_2:
        assert forward.ranking > 3.5
    assert (forward.ranking == 3.5) == (a == b)


def test_heuristic_judge_rewards_through_aggregate() -> None:
    answers = ["Paris is the capital of France.", "Lyon.", "None", "Paris, because history."]
    responses = [resp(a) for a in answers]
    history = conversation_history(HISTORY)
    comparisons = []
    for i, j, k in comparison_pairs(len(answers), "all_pairs", 1):
        text = heuristic_judge_text(
            history, final_answer(responses[i]), final_answer(responses[j]), None
        )
        v = parse_judge_output(text, 3.0, 3.5)
        comparisons.append(Comparison(i, j, k, v.score_1, v.score_2, v.ranking))
    rewards, metrics = aggregate(comparisons, responses, Config())
    assert len(rewards) == 4 and all(math.isfinite(r) for r in rewards)
    assert rewards[2] == min(rewards)  # the empty answer loses every comparison
    assert 1.0 <= metrics["mean_individual_score"] <= 5.0
