"""What the server must answer: the failure kinds by HTTP status, the bodies the drivers send and
the reference rewards (the heuristic judge over the same pairs) they compare against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from genrm_trio import scoring
from genrm_trio.config import Config
from genrm_trio.torture.schedules import FIRST_LEGACY_GROUP

#: Failure kinds a ``/verify`` request may be answered with (contract 3.3/3.4), by HTTP status.
VERIFY_FAILURE_STATUS: Mapping[str, int] = MappingProxyType({
    "judge_failed": 200,
    "bad_request": 400,
    "too_large": 413,
    "bad_coordinates": 422,
    "conflict": 409,
    "prompt_mismatch": 409,
    "stale_attempt": 409,
    "result_expired": 409,
    "cohort_closed": 409,
    "overloaded": 429,
    "cohort_incomplete": 503,
    "superseded": 503,
    "shutdown": 503,
    "evaluation_error": 503,
    "cancelled": 503,
})


PROMPTS = ("Why is the sky blue? Explain briefly.", "Name three prime numbers and explain.")


def answer_text(group: int, attempt: int, slot: int, variant: int) -> str:
    """A distinct final answer per coordinate; the prefix lets the scripted judge see its group."""
    filler = " because shorter wavelengths scatter more" * (1 + (slot + variant) % 3)
    return f"g{group} a{attempt} s{slot} v{variant}:{filler}."


def response_object(text: str) -> dict[str, Any]:
    return {
        "id": "resp_torture",
        "object": "response",
        "status": "completed",
        "output": [{"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": text}]}],
    }


def verify_body(group: int, attempt: int, slot: int, variant: int, prompt: int,
                group_ids: Sequence[str]) -> dict[str, Any]:
    """The ``/verify`` body of one member. Groups below :data:`FIRST_LEGACY_GROUP` carry
    ``group_ids[group]``; the others are legacy groups keyed by task index."""
    body: dict[str, Any] = {
        "responses_create_params": {"input": PROMPTS[prompt]},
        "response": response_object(answer_text(group, attempt, slot, variant)),
        "_ng_rollout_index": slot,
        "_ng_group_attempt": attempt,
        "extra_passthrough": {"g": group, "s": slot},
    }
    if group < FIRST_LEGACY_GROUP:
        body["_ng_group_id"] = group_ids[group]
    else:
        body["_ng_task_index"] = group
    return body


def reference_verdict(history: list[dict[str, str]], r1: str, r2: str) -> scoring.Verdict:
    text = scoring.heuristic_judge_text(history, r1, r2, None)
    return scoring.parse_judge_output(text, 3.0, 3.5)


def reference_rewards(cfg: Config, prompt_input: Any, answers: Sequence[str]) -> list[float]:
    """What a correct server publishes for these final answers judged by the heuristic judge."""
    history = scoring.conversation_history(prompt_input)
    comparisons = []
    for i, j, k in scoring.comparison_pairs(len(answers), cfg.comparison_strategy,
                                            cfg.num_judges_per_comparison):
        v = reference_verdict(history, answers[i], answers[j])
        comparisons.append(scoring.Comparison(
            response_i=i, response_j=j, judge_idx=k, score_1=v.score_1, score_2=v.score_2,
            ranking=v.ranking))
    rewards, _ = scoring.aggregate(comparisons, [response_object(a) for a in answers], cfg)
    return rewards
