"""Scoring: comparison pairs, judge-output parsing, aggregation, bonuses and penalties.

Pure core: no I/O, no trio, no module-level mutable state. Every function here is a plain
synchronous computation that never blocks and cannot be cancelled half-way.

The semantics follow NeMo Gym's ``genrm_compare`` (nemo-gym 0.7.0) so that, for the same judge
answers, the rewards are the same (CONTRACT.md section 5.1):

* a judged pair contributes ``score_1`` to its first member and ``score_2`` to its second; equal
  scores are broken by the ranking (``d = 3.5 - ranking``, ``score_1 += d``, ``score_2 -= d``);
* each member's base reward is the mean over all of its appearances (default score if none);
* optional length bonuses: the shortest non-empty reasoning / answer earns ``reasoning_bonus`` /
  ``answer_bonus`` if its owner is among the top ``top_percentile`` scorers, and the group length
  coefficients add zero-centred weights favouring shorter reasoning and answers;
* the optional style penalty adds zero-centred weights favouring a lower density of markdown
  headers, list items, bold spans and emoji per character (code blocks excluded).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from genrm_trio.config import Config
from genrm_trio.errors import GenRMError, JudgeParseError

__all__ = [
    "RANKING_MIDPOINT",
    "EMPTY_ANSWER",
    "Verdict",
    "Comparison",
    "comparison_pairs",
    "conversation_history",
    "final_answer",
    "reasoning_text",
    "parse_judge_output",
    "aggregate",
    "style_density",
    "heuristic_judge_text",
]

#: Rankings run from 1 (response 1 much better) to 6 (response 2 much better).
RANKING_MIDPOINT = 3.5
#: The verdict scale a GenRM judge answers on (NeMo Gym's GenRM prompt): scores 1-5 per
#: response, ranking 1-6 (1: response 1 much better ... 6: response 2 much better). A value
#: outside its scale is not a verdict the judge gave on this scale: the answer is unparseable.
SCORE_RANGE = (1.0, 5.0)
RANKING_RANGE = (1.0, 6.0)
#: Largest magnitude :func:`aggregate` accepts for any verdict value (configured defaults may lie
#: outside the judge's scale, e.g. ``default_score: 0``); beyond it the cohort fails instead of
#: summing towards overflow.
MAX_VERDICT_MAGNITUDE = 1e6

#: What a response with no final answer text is shown to the judge as.
EMPTY_ANSWER = "None"

_SCORE_KEYS = ("score_1", "score_2", "ranking")


class Verdict(msgspec.Struct, frozen=True):
    """One comparison's verdict: the two scores and the ranking, all finite.

    ``defaulted``: the default verdict stood in because no answer parsed. ``input_tokens`` and
    ``output_tokens``: what the judge reported spending on the comparison, over all its
    attempts (0 when it reports nothing); ``cached_tokens``: how many of the input tokens the
    judge reported found in its prefix cache.
    """

    score_1: float
    score_2: float
    ranking: float
    defaulted: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


class Comparison(msgspec.Struct, frozen=True):
    """One judged pair, wire-ready for ``/compare``'s ``comparison_results``.

    ``score_1`` belongs to ``response_i`` and ``score_2`` to ``response_j``; the values are the
    judge's raw verdict (before the tiebreaker).
    """

    response_i: int
    response_j: int
    judge_idx: int
    score_1: float
    score_2: float
    ranking: float


# --------------------------------------------------------------------------------------------
# Pairs
# --------------------------------------------------------------------------------------------


def comparison_pairs(n: int, strategy: str, num_judges: int) -> list[tuple[int, int, int]]:
    """The judge calls for a cohort of ``n`` responses, as ``(i, j, judge_idx)`` triples.

    ``circular`` pairs each response with the next one, wrapping around: ``(i, (i + 1) % n)``
    for every ``i``, so exactly ``n`` calls (for ``n == 2`` that is ``(0, 1)`` and ``(1, 0)``,
    each order judged once, as NeMo Gym does). ``all_pairs`` is every ``i < j``. The pair list is
    repeated ``num_judges`` times, judge-major, with ``judge_idx`` 0..num_judges-1. Fewer than two
    responses need no calls: ``[]``.

    Never blocks. Raises :class:`GenRMError` for an unknown strategy or ``num_judges < 1``.
    """
    if strategy not in ("circular", "all_pairs"):
        raise GenRMError(f"unknown comparison strategy {strategy!r}")
    if num_judges < 1:
        raise GenRMError(f"num_judges must be >= 1, got {num_judges}")
    if n < 2:
        return []
    if strategy == "circular":
        pairs = [(i, (i + 1) % n) for i in range(n)]
    else:
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    return [(i, j, k) for k in range(num_judges) for i, j in pairs]


def prefix_order(pairs: list[tuple[int, int, int]]) -> list[int]:
    """Indices of ``pairs`` in the order that issues calls sharing the longest prompt prefix
    back to back: by ``response_1``, then ``response_2``, then the judge pass (a judge prompt
    is the history, the principle, ``response_1``, ``response_2``; passes of one pair share
    all of it). For ``all_pairs`` every ``(i, j > i)`` of one ``i`` comes together. Issue
    order never changes a reward (verdicts are aggregated by index). Pure."""
    return sorted(range(len(pairs)), key=lambda index: pairs[index])


# --------------------------------------------------------------------------------------------
# Conversation history and response text
# --------------------------------------------------------------------------------------------


def _content_text(content: object) -> str:
    """Message content as plain text: list content keeps its input/output text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if (
                isinstance(part, Mapping)
                and part.get("type") in ("input_text", "output_text")
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
        return "".join(texts)
    return str(content)


def conversation_history(prompt_input: object) -> list[dict[str, str]]:
    """Normalise ``responses_create_params.input`` into ``[{"role", "content"}, ...]``.

    A string is one user message. A list keeps only message items (``type == "message"``, or no
    ``type`` but a ``role`` or ``content`` key); reasoning, tool calls and anything else are
    skipped. List content becomes the concatenation of its ``input_text``/``output_text`` parts.
    A missing role is ``"user"``. ``None`` (or any other shape) gives ``[]``.

    Never blocks, never raises. The returned list is new and owned by the caller.
    """
    if isinstance(prompt_input, str):
        return [{"role": "user", "content": prompt_input}]
    if isinstance(prompt_input, Mapping):
        items: list[object] = [prompt_input]
    elif isinstance(prompt_input, list | tuple):
        items = list(prompt_input)
    else:
        return []
    history: list[dict[str, str]] = []
    for item in items:
        if not isinstance(item, Mapping):
            continue
        item_type = item.get("type")
        if item_type is None:
            if "role" not in item and "content" not in item:
                continue
        elif item_type != "message":
            continue
        role = item.get("role")
        history.append(
            {
                "role": role if isinstance(role, str) and role else "user",
                "content": _content_text(item.get("content")),
            }
        )
    return history


def _output_items(response: Mapping[str, Any], item_type: str) -> list[Mapping[str, Any]]:
    output = response.get("output") if isinstance(response, Mapping) else None
    if not isinstance(output, list):
        return []
    return [it for it in output if isinstance(it, Mapping) and it.get("type") == item_type]


def _raw_answer(response: Mapping[str, Any]) -> str:
    """The concatenated ``output_text`` parts of the message output items, possibly blank."""
    texts: list[str] = []
    for item in _output_items(response, "message"):
        content = item.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if (
                isinstance(part, Mapping)
                and part.get("type") == "output_text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
    return "".join(texts)


def final_answer(response: Mapping[str, Any]) -> str:
    """The text the judge sees for one response: its final answer, reasoning excluded.

    The concatenated ``output_text`` parts of the ``message`` output items; a blank answer (or a
    response with no such items) is the literal ``"None"``. Never blocks, never raises.
    """
    answer = _raw_answer(response)
    return answer if answer.strip() else EMPTY_ANSWER


def reasoning_text(response: Mapping[str, Any]) -> str:
    """The reasoning of one response, for the length bonuses: the concatenated ``text`` of the
    ``summary`` parts of its ``reasoning`` output items (as NeMo Gym measures it). May be blank.

    Never blocks, never raises.
    """
    texts: list[str] = []
    for item in _output_items(response, "reasoning"):
        summary = item.get("summary")
        if not isinstance(summary, list):
            continue
        for part in summary:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return "".join(texts)


# --------------------------------------------------------------------------------------------
# Judge-output parsing
# --------------------------------------------------------------------------------------------

_FENCED_JSON = re.compile(r"```json\s*([\s\S]*?)\s*```", re.IGNORECASE)
# The only characters that change the state of the brace scanner.
_BRACE_EVENTS = re.compile(r'[{}"\\]')


# A fresh scan can only start this many times inside what earlier scans saw as strings; past
# that the rest of the text yields no more candidates. Real judge answers need one or two, and
# the cap keeps adversarial quoting from making the parse quadratic.
_MAX_SCAN_FRAMES = 16


def _scan_frame(text: str, start: int) -> dict[int, int]:
    """One brace-counting pass from ``start`` (outside any string) to the end of ``text``.

    Returns, for every ``{`` the pass sees outside strings, the position of its matching ``}``
    (or -1 if it never closes). A fresh scan from any of those braces would see exactly the
    same strings from there on, so its result is that match: one pass answers them all.
    """
    matches: dict[int, int] = {}
    open_braces: list[int] = []
    in_string = False
    skip_at = -1  # the character right after a backslash inside a string is inert
    for event in _BRACE_EVENTS.finditer(text, start):
        pos = event.start()
        if pos == skip_at:
            continue
        ch = text[pos]
        if in_string:
            if ch == "\\":
                skip_at = pos + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            open_braces.append(pos)
            matches[pos] = -1
        elif ch == "}" and open_braces:
            matches[open_braces.pop()] = pos
    return matches


def _balanced_objects(text: str) -> list[str]:
    """The top-level ``{...}`` spans of ``text``, left to right, found by brace counting.

    Braces inside double-quoted strings do not count. A balanced span is taken whole (objects
    nested in it are not reported separately); an opening brace that is never closed is passed
    over and the search resumes right after it, so objects nested inside it are still found.
    Linear in the text for ordinary answers (see ``_MAX_SCAN_FRAMES``).
    """
    spans: list[str] = []
    frames: list[dict[int, int]] = []
    start = text.find("{")
    while start != -1:
        end: int | None = None
        for frame in frames:
            if start in frame:
                end = frame[start]
                break
        if end is None:
            if len(frames) >= _MAX_SCAN_FRAMES:
                break
            frames.append(_scan_frame(text, start))
            end = frames[-1][start]
        if end == -1:
            start = text.find("{", start + 1)
        else:
            spans.append(text[start : end + 1])
            start = text.find("{", end + 1)
    return spans


def _to_finite(value: object) -> float | None:
    # float() semantics on purpose (numeric strings such as "4" count, as in NeMo Gym).
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _verdict_from(candidate: str, default_score: float, default_ranking: float) -> Verdict | None:
    """The verdict in one ``{...}`` span, or None if the span is not a usable verdict."""
    try:
        parsed = json.loads(candidate)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    overall = parsed.get("overall")
    if isinstance(overall, dict):
        parsed = overall
    if not any(key in parsed for key in _SCORE_KEYS):
        return None
    score_1 = _to_finite(parsed.get("score_1", default_score))
    score_2 = _to_finite(parsed.get("score_2", default_score))
    ranking = _to_finite(parsed.get("ranking", default_ranking))
    if score_1 is None or score_2 is None or ranking is None:
        return None
    for key, value, (low, high) in (
        ("score_1", score_1, SCORE_RANGE), ("score_2", score_2, SCORE_RANGE),
        ("ranking", ranking, RANKING_RANGE),
    ):
        if key in parsed and not low <= value <= high:  # defaults come from config, not judge
            return None
    return Verdict(score_1=score_1, score_2=score_2, ranking=ranking)


def parse_judge_output(text: str, default_score: float, default_ranking: float) -> Verdict:
    """Extract the verdict from a judge's answer text.

    Rules (CONTRACT.md 5.1): the first valid object inside a fenced ```json block wins; failing
    that, the last valid top-level ``{...}`` anywhere in the text. A valid object is a JSON
    object (its ``overall`` sub-object when that is an object) holding at least one of
    ``score_1``, ``score_2``, ``ranking``; missing ones take ``default_score`` /
    ``default_ranking``; every value must convert to a finite float (numbers, or numeric
    strings as Python's ``float`` reads them) within its scale (:data:`SCORE_RANGE`,
    :data:`RANKING_RANGE`), so aggregation can never overflow.

    Never blocks. Raises :class:`JudgeParseError` with a short reason when nothing is usable.
    """
    for block in _FENCED_JSON.finditer(text):
        for candidate in _balanced_objects(block.group(1)):
            verdict = _verdict_from(candidate, default_score, default_ranking)
            if verdict is not None:
                return verdict
    last: Verdict | None = None
    candidates = _balanced_objects(text)
    for candidate in candidates:
        verdict = _verdict_from(candidate, default_score, default_ranking)
        if verdict is not None:
            last = verdict
    if last is not None:
        return last
    if not text.strip():
        raise JudgeParseError("judge answer is blank")
    if not candidates:
        raise JudgeParseError("no JSON object in judge answer")
    raise JudgeParseError(
        "no JSON object with score_1/score_2 in [1, 5] and ranking in [1, 6] among "
        f"{len(candidates)} candidate(s)"
    )


# --------------------------------------------------------------------------------------------
# Style density
# --------------------------------------------------------------------------------------------

_CODE_BLOCK = re.compile(r"```[\s\S]*?```")
_HEADER = re.compile(r"^#{1,6}\s", re.MULTILINE)
_ORDERED_ITEM = re.compile(r"^\s*\d+\.\s", re.MULTILINE)
_UNORDERED_ITEM = re.compile(r"^\s*[-*+]\s", re.MULTILINE)
_BOLD_STARS = re.compile(r"\*\*[^*\n]+\*\*")
_BOLD_UNDERSCORES = re.compile(r"__[^_\n]+__")
# Common emoji code point ranges; each code point counts once (ZWJ sequences count per part).
_EMOJI = re.compile(
    "["
    "\U0001f600-\U0001f64f"
    "\U0001f300-\U0001f5ff"
    "\U0001f680-\U0001f6ff"
    "\U0001f1e0-\U0001f1ff"
    "\u2702-\u27b0"
    "\u24c2-\U0001f251"
    "\U0001f900-\U0001f9ff"
    "\U0001fa00-\U0001fa6f"
    "\U0001fa70-\U0001faff"
    "\u2600-\u26ff"
    "\u2700-\u27bf"
    "]"
)


def style_density(answer: str) -> float:
    """Markdown style elements per character of ``answer``, fenced code blocks excluded.

    Elements: headers (``#`` to ``######`` then a space, at line start), list items (``1.``,
    ``-``, ``*``, ``+`` then a space), bold spans (``**x**``, ``__x__`` on one line) and emoji
    code points. The length is that of the code-free text, stripped; an empty text has density
    0.0. Never blocks, never raises.
    """
    prose = _CODE_BLOCK.sub("", answer)
    length = len(prose.strip())
    if length == 0:
        return 0.0
    elements = (
        len(_HEADER.findall(prose))
        + len(_ORDERED_ITEM.findall(prose))
        + len(_UNORDERED_ITEM.findall(prose))
        + len(_BOLD_STARS.findall(prose))
        + len(_BOLD_UNDERSCORES.findall(prose))
        + len(_EMOJI.findall(prose))
    )
    return elements / length


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------


def _lower_is_better_weights(values: Sequence[float]) -> list[float]:
    """Zero-centred weights in [-1, 1]: the lowest value gets the most, all equal gives zeros."""
    low, high = min(values), max(values)
    if low == high:
        return [0.0] * len(values)
    span = high - low
    raw = [1.0 - (v - low) / span for v in values]
    mean = sum(raw) / len(raw)
    return [w - mean for w in raw]


def _shortest_nonempty(lengths: Sequence[int]) -> int | None:
    best: int | None = None
    for idx, length in enumerate(lengths):
        if length > 0 and (best is None or length < lengths[best]):
            best = idx
    return best


def _apply_length_adjustments(
    scores: list[float], responses: Sequence[Mapping[str, Any]], cfg: Config
) -> None:
    reasoning_lengths = [len(reasoning_text(r).strip()) for r in responses]
    answer_lengths = [len(_raw_answer(r).strip()) for r in responses]

    # The top-performer threshold is fixed before any bonus is added; the eligibility check of
    # the answer bonus sees the scores after the reasoning bonus (NeMo Gym's order).
    ranked = sorted(scores, reverse=True)
    threshold = ranked[max(0, int(len(scores) * cfg.top_percentile) - 1)]
    for bonus, lengths in (
        (cfg.reasoning_bonus, reasoning_lengths),
        (cfg.answer_bonus, answer_lengths),
    ):
        if bonus > 0:
            winner = _shortest_nonempty(lengths)
            if winner is not None and scores[winner] >= threshold:
                scores[winner] += bonus

    reasoning_coeff = cfg.group_reasoning_length_penalty_coeff
    answer_coeff = cfg.group_answer_length_penalty_coeff
    if reasoning_coeff > 0 or answer_coeff > 0:
        reasoning_weights = _lower_is_better_weights(reasoning_lengths)
        answer_weights = _lower_is_better_weights(answer_lengths)
        for idx in range(len(scores)):
            scores[idx] += (
                reasoning_weights[idx] * reasoning_coeff + answer_weights[idx] * answer_coeff
            )


def aggregate(
    comparisons: Sequence[Comparison],
    responses: Sequence[Mapping[str, Any]],
    cfg: Config,
    *,
    with_metrics: bool = True,
) -> tuple[list[float], dict[str, float]]:
    """Turn a cohort's judged pairs into one reward per response (``simple_tiebreaker``).

    ``responses`` are the cohort's Responses objects in rollout order; ``comparisons`` may come
    in any order (they are summed in ``(judge_idx, response_i, response_j)`` order, so eager and
    wait-for-all judging give bit-identical rewards). Returns ``(rewards, metrics)``: rewards in
    response order, and metrics ``mean_individual_score`` / ``std_individual_score`` (population
    statistics of the raw judge scores) and ``tiebreak_usage_rate`` (share of comparisons with
    equal scores); metrics is empty when there are no comparisons or ``with_metrics`` is false
    (the cohort path, which publishes rewards only, skips the statistics).

    Never blocks. Raises :class:`GenRMError` if a comparison names a response out of range or
    holds a value beyond :data:`MAX_VERDICT_MAGNITUDE`, the
    aggregator is unknown, or any reward comes out non-finite.
    """
    if cfg.aggregator_method != "simple_tiebreaker":
        raise GenRMError(f"unknown aggregator_method {cfg.aggregator_method!r}")
    n = len(responses)
    totals = [0.0] * n
    counts = [0] * n
    raw_scores: list[float] = []
    ties = 0
    ordered = sorted(comparisons, key=lambda c: (c.judge_idx, c.response_i, c.response_j))
    for comp in ordered:
        if not (0 <= comp.response_i < n and 0 <= comp.response_j < n):
            raise GenRMError(
                f"comparison ({comp.response_i}, {comp.response_j}) is outside a cohort of {n}"
            )
        score_1, score_2 = comp.score_1, comp.score_2
        for name, value in (("score_1", score_1), ("score_2", score_2),
                            ("ranking", comp.ranking)):
            # Parsed verdicts are always in scale; this guards verdicts from elsewhere (a
            # plugin, a configured default) so that no sum or deviation below can overflow.
            if not abs(value) <= MAX_VERDICT_MAGNITUDE:
                raise GenRMError(
                    f"comparison ({comp.response_i}, {comp.response_j}): {name} {value!r} is "
                    f"beyond +-{MAX_VERDICT_MAGNITUDE:g}"
                )
        raw_scores.append(score_1)
        raw_scores.append(score_2)
        if score_1 == score_2:
            ties += 1
            shift = RANKING_MIDPOINT - comp.ranking
            score_1 += shift
            score_2 -= shift
        totals[comp.response_i] += score_1
        totals[comp.response_j] += score_2
        counts[comp.response_i] += 1
        counts[comp.response_j] += 1

    rewards = [totals[idx] / counts[idx] if counts[idx] else cfg.default_score for idx in range(n)]

    if n >= 2:
        if (
            cfg.reasoning_bonus > 0
            or cfg.answer_bonus > 0
            or cfg.group_reasoning_length_penalty_coeff > 0
            or cfg.group_answer_length_penalty_coeff > 0
        ):
            _apply_length_adjustments(rewards, responses, cfg)
        if cfg.group_style_penalty_coeff > 0:
            densities = [style_density(_raw_answer(r)) for r in responses]
            for idx, weight in enumerate(_lower_is_better_weights(densities)):
                rewards[idx] += weight * cfg.group_style_penalty_coeff

    bad = [idx for idx, reward in enumerate(rewards) if not math.isfinite(reward)]
    if bad:
        raise GenRMError(f"non-finite reward for response(s) {bad[:8]}")

    metrics: dict[str, float] = {}
    if ordered and with_metrics:
        metrics["mean_individual_score"] = statistics.fmean(raw_scores)
        metrics["std_individual_score"] = statistics.pstdev(raw_scores)
        metrics["tiebreak_usage_rate"] = ties / len(ordered)
    return rewards, metrics


# --------------------------------------------------------------------------------------------
# Heuristic judge
# --------------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]{3,}")
# Answers around this many characters earn the whole length signal.
_GOOD_LENGTH_CHARS = 400


def _stable_fraction(text: str) -> float:
    """A fraction in [0, 1) that depends only on ``text`` (lone surrogates allowed)."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _answer_quality(answer: str, prompt_words: frozenset[str]) -> float:
    """A quality in [0, 1): mostly a stable hash, plus prompt overlap and a sane length."""
    stripped = answer.strip()
    if not stripped or stripped == EMPTY_ANSWER:
        return 0.0
    words = set(_WORD.findall(stripped.lower()))
    overlap = len(words & prompt_words) / len(prompt_words) if prompt_words else 0.5
    length = min(len(stripped), _GOOD_LENGTH_CHARS) / _GOOD_LENGTH_CHARS
    return 0.55 * _stable_fraction(stripped) + 0.30 * overlap + 0.15 * length * 0.999


def _score_of(quality: float) -> int:
    return min(5, 1 + int(quality * 5))


def heuristic_judge_text(
    history: Sequence[Mapping[str, str]],
    response_1: str,
    response_2: str,
    principle: str | None,
) -> str:
    """A deterministic, offline stand-in for a GenRM judge: the answer text it would write.

    Each answer gets a quality in [0, 1) from a stable hash of its text, its word overlap with
    the user turns of ``history`` and its length (blank or ``"None"`` answers get 0); scores are
    1..5 from the quality, and the ranking (1..6, 3.5 only for identical answers) says which
    answer is better and by how much. Swapping the answers swaps the scores and mirrors the
    ranking (``7 - ranking``). ``principle`` is acknowledged in the prose but does not change the
    verdict. The text ends with a fenced ```json block that :func:`parse_judge_output` accepts.

    Never blocks, never raises; same inputs, same text, in every process.
    """
    prompt_text = " ".join(m.get("content", "") for m in history if m.get("role", "user") == "user")
    prompt_words = frozenset(_WORD.findall(prompt_text.lower()))
    quality_1 = _answer_quality(response_1, prompt_words)
    quality_2 = _answer_quality(response_2, prompt_words)
    score_1, score_2 = _score_of(quality_1), _score_of(quality_2)

    ranking: float
    if response_1 == response_2:
        ranking = RANKING_MIDPOINT
    else:
        gap = quality_1 - quality_2
        if gap == 0.0:
            # Distinct answers of equal quality: still pick one, the same way in both orders.
            gap = _stable_fraction(response_1) - _stable_fraction(response_2)
        strength = 1 if abs(gap) > 0.4 else 2 if abs(gap) > 0.15 else 3
        ranking = float(strength if gap > 0 else 7 - strength)

    verdict = {"score_1": score_1, "score_2": score_2, "ranking": ranking}
    if ranking == int(ranking):
        verdict["ranking"] = int(ranking)
    lead = (
        "The two responses are identical."
        if response_1 == response_2
        else f"Response {1 if ranking < RANKING_MIDPOINT else 2} serves the user better."
    )
    preface = "Judged against the principle given. " if principle else ""
    return f"{preface}{lead}\n```json\n{json.dumps(verdict)}\n```"
