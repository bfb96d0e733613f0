"""Wire formats: msgspec structs and the shared encoders/decoders for every HTTP payload.

Pure core: no I/O, no trio. Inbound ``/verify`` bodies are echoed back as they were received
(unknown keys unchanged); only the keys the server interprets are validated, through
:class:`VerifyFields`, so msgspec's error names the JSON path (``$.response``). A validated member
(:class:`VerifyMember`) keeps its body as the bytes received, not decoded: it may wait for its
cohort for the whole collection deadline, and the bytes are a single object of about half the
size of the dicts and strings they decode into (issue 21).

Decoding a large body is a generator of steps (``*_steps``: each step one C call of bounded
cost, such as a count over the bytes, msgspec's decode, part of the walk that weighs the
result), so that the server can let the event loop run between them (server/app.py, issue 26);
the plain functions run the same steps at once (:func:`run_steps`). Still no I/O, no trio.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Generator
from types import MappingProxyType
from typing import Annotated, Any, TypeVar, cast

import msgspec

from genrm_trio.errors import BadCoordinates, BadRequest, TooManyValues

JSON_ENCODER = msgspec.json.Encoder()
JSON_DECODER = msgspec.json.Decoder()

EXACT_ABOVE_BYTES = 2**20
"""Encoded answers longer than this are copied to a buffer of their own size
(:func:`encode_answer`)."""


def encode_answer(body: Any) -> bytes:
    """``body`` as JSON, for an answer that may wait long in this process for a slow client.
    msgspec's result keeps the spare capacity its buffer grew by (up to half as much again as
    its length, measured: 12 MB allocated for an 8 MB answer), and an answer is counted in
    ``max_active_bytes`` by its length; so one longer than :data:`EXACT_ABOVE_BYTES` is copied
    to an exact buffer (a memcpy, about a millisecond for 8 MB) and the large one freed."""
    payload = JSON_ENCODER.encode(body)
    if len(payload) > EXACT_ABOVE_BYTES:
        return bytes(memoryview(payload))
    return payload

#: Old NeMo Gym spellings accepted on input; answers use only the ``_ng_`` names.
IDENTITY_ALIASES = MappingProxyType(
    {"group_id": "_ng_group_id", "group_attempt": "_ng_group_attempt"}
)

LEGACY_GUIDANCE = (
    " To recover, resend the whole group with a fresh _ng_group_id shared by every member"
    " (legacy groups keyed by task index or prompt keep their recorded failure)."
)

MAX_FAILURE_TEXT = 2000

#: The [ext] key of a rewarded ``/verify`` answer counting the cohort's comparisons that used the
#: default verdict (no judge answer parsed). ``genrm_``-prefixed so it cannot collide with other
#: servers' keys in a NeMo Gym row; a plain number, so reward-profile metrics average it.
DEFAULTED_COMPARISONS_KEY = "genrm_defaulted_comparisons"
#: The [ext] keys of a rewarded ``/verify`` answer: the cohort's size N and how many of its
#: members were judged (M; M < N only for a partial cohort, ``incomplete_cohort_policy:
#: judge_present``). On every rewarded answer, full cohorts too (M = N).
COHORT_EXPECTED_KEY = "genrm_cohort_expected"
COHORT_SCORED_KEY = "genrm_cohort_scored"
#: The [ext] key of a rewarded ``/verify`` answer counting the cohort's comparisons scored with a
#: kept verdict instead of a judge call (``verdict_reuse``: the same sample, not a new one).
REUSED_COMPARISONS_KEY = "genrm_reused_comparisons"

# ---------------------------------------------------------------------------------------------
# Bounds (README "Bounds"; /openapi.json). Every body is checked before anything is interpreted.

#: Deepest nesting of arrays and objects accepted anywhere in a body (``$`` is depth 1). A real
#: /verify body (Responses input with content parts, tool schemas) nests about 10 deep.
MAX_JSON_DEPTH = 64
#: Longest ``_ng_group_id`` / ``group_id`` / ``prompt_id``: these are kept in active keys,
#: retained records, watermarks and journal rows, so they must stay small.
MAX_IDENTITY_CHARS = 512
#: Every integer anywhere in a body must fit a signed 64-bit integer (SQLite's INTEGER, and what
#: every caller's JSON library can read back).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: Default of config ``max_json_values``: the most JSON values a body may hold, counted on its
#: bytes before it is decoded (:func:`json_value_count`, which weighs each kind by what it costs
#: to decode). msgspec decodes a body in one call that holds the event loop, about 80 ns per
#: counted value at the worst (a plain value 20 to 80 ns, an object or array 100 to 400 ns, a
#: number whose exponent sends msgspec down its exact path, ``1e300``, 9 to 11 us), so a body at
#: the bound costs one decode of about 40 ms, and each of its later decodes the same; the rest
#: of the work on a body is done in steps (issue 26). Real bodies count far less: a 200-turn
#: NeMo Gym tool-calling trajectory about 23,000; token ids count one each (a 20-turn
#: trajectory carrying NeMo RL's ids and log-probs, 1.1 MB, about 221,000; the default takes
#: about 30 such turns). README "Bounds".
DEFAULT_MAX_JSON_VALUES = 500_000
#: What an object or an array counts, in values: decoding one costs 2 to 8 plain values.
CONTAINER_WEIGHT = 8
#: What a number with an exponent counts, in values: msgspec takes up to 11 us for some
#: (``1e300``, ``9e300``), 200 plain values' worth.
EXPONENT_WEIGHT = 200

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
Attempt = Annotated[int, msgspec.Meta(le=INT64_MAX)]
IdentityText = Annotated[str, msgspec.Meta(max_length=MAX_IDENTITY_CHARS)]

#: NeMo Gym's rollout prefix: with ``observability_enabled`` its client sends every
#: resources-server call as ``/ng-rollout/<rollout_id>/<path>``.
ROLLOUT_PREFIX = "/ng-rollout/"
#: NeMo Gym's rule for a rollout id (a path segment it also uses in file names).
ROLLOUT_ID_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]*$"
#: Longest rollout id accepted (NeMo Gym sets none; ours is kept with the member).
MAX_ROLLOUT_ID_CHARS = 512
#: Where the app (server/app.py) leaves the rollout id in a prefixed request's ASGI scope.
ROLLOUT_ID_SCOPE_KEY = "genrm.rollout_id"
_PREFIXED = re.compile(r"/ng-rollout/([A-Za-z0-9][A-Za-z0-9._-]*)(/.*)", re.DOTALL)


def strip_rollout_prefix(path: str) -> tuple[str, str | None] | None:
    """Split NeMo Gym's rollout prefix off a request path: ``(path, None)`` for a plain path,
    ``(rest, rollout_id)`` for ``/ng-rollout/<rollout_id><rest>``, None for a path under the
    prefix whose id breaks :data:`ROLLOUT_ID_PATTERN` or :data:`MAX_ROLLOUT_ID_CHARS` (a 404,
    as in NeMo Gym). The prefix is taken off once: the rest is routed as it is. Pure."""
    if not path.startswith(ROLLOUT_PREFIX):
        return path, None
    match = _PREFIXED.fullmatch(path)
    if match is None or len(match[1]) > MAX_ROLLOUT_ID_CHARS:
        return None
    return match[2], match[1]


#: Top-level keys of /verify that the server interprets: each may appear once.
_INTERPRETED_KEYS: tuple[str, ...] = (
    "responses_create_params", "response", "_ng_group_id", "group_id", "_ng_group_attempt",
    "group_attempt", "_ng_rollout_index", "_ng_task_index", "prompt_id", "principle",
    "instance_config",
)
# Where an interpreted key may be a member name: the quoted name and then a colon. (A value
# such as "object": "response" is no candidate, which a bare count of the quoted name found in
# every Responses object.) A name written with escapes (\u0072esponse) is found by the check
# for a backslash-u in the body instead.
_KEY_CANDIDATE = re.compile(
    rb'"(' + b"|".join(re.escape(k.encode()) for k in _INTERPRETED_KEYS) + rb')"[ \t\r\n]*:'
)


_INTERPRETED_NAMES = frozenset(k.encode() for k in _INTERPRETED_KEYS)
_LONGEST_NAME = 2 + max(map(len, _INTERPRETED_KEYS))
_LONGEST_ESCAPED = 2 + 6 * 32
_NOT_WHITESPACE = re.compile(rb"[^ \t\r\n]")
# A key that could spell an interpreted one with escapes: letters, underscores and \uXXXX
# escapes only (the names are [a-z_], at most 23 of them), at least one escape, then a colon.
_ESCAPED_KEY = re.compile(
    rb'"(?=[A-Za-z_\\]{0,200}\\u)(?:[A-Za-z_]|\\u[0-9A-Fa-f]{4}){1,32}"(?=[ \t\r\n]*:)')


class VerifyFields(msgspec.Struct, kw_only=True):
    """The keys of a ``/verify`` body that the server interprets; the rest is carried through."""

    responses_create_params: dict[str, Any]
    response: dict[str, Any]
    group_id: IdentityText | None = msgspec.field(default=None, name="_ng_group_id")
    group_attempt: Attempt | None = msgspec.field(default=None, name="_ng_group_attempt")
    rollout_index: Int64 | None = msgspec.field(default=None, name="_ng_rollout_index")
    task_index: Int64 | None = msgspec.field(default=None, name="_ng_task_index")
    prompt_id: IdentityText | None = None
    principle: str | None = None
    instance_config: dict[str, Any] | None = None


class MemberFields(msgspec.Struct, kw_only=True):
    """What admission reads from a validated ``/verify`` body besides its coordinates: decoded
    again from the member's bytes when it is admitted (:meth:`VerifyMember.fields`), and not
    kept. None of these keys has an alias."""

    responses_create_params: dict[str, Any]
    response: dict[str, Any]
    task_index: int | None = msgspec.field(default=None, name="_ng_task_index")
    prompt_id: str | None = None
    principle: str | None = None


class _ResponseOnly(msgspec.Struct):
    response: dict[str, Any]


_MEMBER_FIELDS_DECODER = msgspec.json.Decoder(MemberFields)
_RESPONSE_DECODER = msgspec.json.Decoder(_ResponseOnly)


class VerifyMember(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A validated ``/verify`` request as it waits: the body as received (``raw``, its bytes)
    and its coordinates. The body is decoded again where it is needed: for admission
    (:meth:`fields`), for the answer (:meth:`body`) and for the judge (:meth:`response`), so a
    waiting member holds one bytes object, not the tree of Python objects it decodes into.
    ``raw`` passed :func:`decode_verify`, so decoding it again cannot fail. ``size_bytes`` is
    what the decoded body holds in memory (:func:`decoded_size`), the weight admission counts
    against ``max_active_bytes``: the member waits as its bytes, but its cohort decodes it to
    judge and to answer, and that is the peak a flood must be refused before."""

    raw: bytes
    group_id: str | None
    attempt: int
    attempt_given: bool
    rollout_index: int | None
    size_bytes: int
    #: NeMo Gym's rollout id, from the ``/ng-rollout/<rollout_id>/verify`` path (None without
    #: the prefix): kept with the member for its cohort's disposition line and traces.
    rollout_id: str | None = None
    #: The scope of a prompt-keyed cohort key built by a route rather than by the body's
    #: ``_ng_task_index`` / ``prompt_id`` (``POST /get_reward``: the label's digest); None for
    #: ``/verify`` members.
    key_scope: str | None = None

    def body(self) -> dict[str, Any]:
        """The body as received, decoded (a new dict on each call: the caller owns it)."""
        body: dict[str, Any] = JSON_DECODER.decode(self.raw)
        return body

    def fields(self) -> MemberFields:
        """The interpreted keys admission needs, decoded (a new object on each call)."""
        return _MEMBER_FIELDS_DECODER.decode(self.raw)

    def response(self) -> dict[str, Any]:
        """The ``response`` object, decoded (a new dict on each call)."""
        return member_response(self.raw)


def member_response(raw: bytes) -> dict[str, Any]:
    """The ``response`` object of a validated ``/verify`` body, decoded."""
    return _RESPONSE_DECODER.decode(raw).response


class CompareRequest(msgspec.Struct, kw_only=True):
    conversation_history: list[dict[str, Any]]
    response_objs: list[dict[str, Any]]
    principle: str | None = None


class AggregateMetricsRequest(msgspec.Struct, kw_only=True):
    verify_responses: list[dict[str, Any]]


class AggregateRow(msgspec.Struct, kw_only=True):
    """The keys of one ``/aggregate_metrics`` row that the metrics interpret (others ignored
    here, kept in the row)."""

    task_index: Int64 | str | None = msgspec.field(default=None, name="_ng_task_index")
    rollout_index: Int64 | str | None = msgspec.field(default=None, name="_ng_rollout_index")
    reward: float | None = None
    mask_sample: bool | None = None


class _TypedAggregateRequest(msgspec.Struct, kw_only=True):
    verify_responses: list[AggregateRow]


class ErrorBody(msgspec.Struct, kw_only=True, omit_defaults=False):
    detail: str
    failure_kind: str | None


def _validation_detail(exc: msgspec.ValidationError) -> str:
    return f"invalid request body: {exc}"


def _bound_violation(obj: dict[str, Any]) -> str | None:
    """The first place where ``obj`` breaks a bound (depth or int64), as a message naming its
    JSON path, or None."""
    if _weigh_within_bounds(obj) is not None:
        return None
    return _describe_violation(obj, "$", 1)


def _describe_violation(value: Any, path: str, depth: int) -> str | None:
    # Only called once a violation is known to exist, so the recursion is bounded by the depth
    # limit (it stops descending at MAX_JSON_DEPTH + 1).
    if isinstance(value, (dict, list)):
        if depth > MAX_JSON_DEPTH:
            return f"JSON nesting deeper than {MAX_JSON_DEPTH} levels - at `{path}`"
        items = (
            ((f"{path}.{k}" if str(k).isidentifier() else f"{path}[{json.dumps(k)}]", v)
             for k, v in value.items())
            if isinstance(value, dict) else ((f"{path}[{i}]", v) for i, v in enumerate(value))
        )
        for child_path, child in items:
            found = _describe_violation(child, child_path, depth + 1)
            if found is not None:
                return found
        return None
    if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
        return f"integer outside the signed 64-bit range - at `{path}`"
    return None


_T = TypeVar("_T")
#: A computation in steps: each ``yield`` is a point where the caller may let other work run;
#: the generator's return value is the result.
Steps = Generator[None, None, _T]
#: The structural bytes :func:`json_value_count` adds up first, each with its weight (monotone:
#: the count may stop as soon as it passes the limit).
_COUNTED = ((b",", 1), (b":", 1), (b"{", CONTAINER_WEIGHT), (b"[", CONTAINER_WEIGHT))
#: :func:`_weigh_steps` yields after visiting about this many members.
_WEIGH_STEP_ITEMS = 16384
#: :func:`json_value_count_steps` splits strings out of this many bytes at a time.
_COUNT_WINDOW = 1 << 20
QUICK_CHECK_BYTES = 64 * 1024
"""A body of at most this many bytes is checked by the quick paths first (the value count's
upper bound, the duplicated-key count of quoted names, the recursive weighing): each is one
short call, where the exact, stepped forms are built for bodies of megabytes (issue 27: they
cost an ordinary 2.5 KB member 21 us more than the checks before issue 26, 0.34 ms of a
cohort of 16 on its critical path)."""


def run_steps(steps: Generator[None, None, _T]) -> _T:
    """Run ``steps`` to the end at once and return its result (callers with no loop to let
    run: the plain ``decode_*`` functions, tools, tests)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(_T, done.value)


def json_value_count(raw: bytes, limit: int | None = None) -> int:
    """The JSON values in ``raw``, weighed by what they cost to decode (see
    :func:`json_value_count_steps`)."""
    return run_steps(json_value_count_steps(raw, limit))


def json_value_count_steps(raw: bytes, limit: int | None = None) -> Steps[int]:
    """The JSON values in ``raw``, weighed by what they cost to decode, counted on the bytes
    with C-speed passes (``bytes.replace``, ``count``, and per :data:`_COUNT_WINDOW` of the
    body ``split``, ``join`` and ``count``: 10 to 60 ms for 16 MiB in all, a step per pass or
    window, none over about 10 ms). Strings are taken out first (after the escaped backslashes
    and quotes), so the characters inside them count nothing; outside them, every value but the
    outermost follows a ``[``, ``,`` or ``:`` and every key a ``{`` or ``,``, so the count is 1
    plus those, each object or array counting :data:`CONTAINER_WEIGHT` and each number with an
    exponent (an ``e`` or ``E`` outside strings, ``true`` and ``false`` aside)
    :data:`EXPONENT_WEIGHT` (a ``true`` or ``false`` cut by a window's edge counts as one).
    With ``limit`` the count stops once it is past ``limit`` (a body whose strings alone are
    more stops before any is split out): 15 MB of ``{}`` is refused after one window. For a
    body that is not JSON the count is an estimate, which decoding then refuses anyway. Pure."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"")
        yield
        raw = raw.replace(b'\\"', b"")
        yield
    strings = raw.count(b'"') // 2
    if limit is not None and strings > limit:
        return strings
    yield
    total = 1
    in_string = False  # whether the window starts inside a string
    for start in range(0, len(raw), _COUNT_WINDOW):
        window = raw[start:start + _COUNT_WINDOW]
        if b'"' in window:
            parts = window.split(b'"')
            outside = b"".join(parts[1 if in_string else 0::2])
            in_string ^= len(parts) % 2 == 0  # an odd number of quotes in the window
            del parts
        elif in_string:
            continue
        else:
            outside = window
        count = outside.count
        total += sum(weight * count(byte) for byte, weight in _COUNTED)
        total += EXPONENT_WEIGHT * (count(b"e") + count(b"E") - count(b"true")
                                    - count(b"false"))
        if limit is not None and total > limit:
            return total
        yield
    return total


def _value_count_bound(raw: bytes) -> int:
    """An upper bound of :func:`json_value_count`: the same weighted count over the whole
    body, strings included, with nothing taken back for ``true`` and ``false``. Three
    ``bytes.translate`` passes, the first over the body (keeping the counted bytes), the others
    over what it kept: cheaper than a count per byte value."""
    counted = raw.translate(None, _NOT_COUNTED)
    weighty = counted.translate(None, b",:")  # containers and exponents
    exponents = len(weighty.translate(None, b"{["))
    return (1 + len(counted) - len(weighty) + CONTAINER_WEIGHT * (len(weighty) - exponents)
            + EXPONENT_WEIGHT * exponents)


#: Every byte value :func:`_value_count_bound` does not count.
_NOT_COUNTED = bytes(b for b in range(256) if b not in b",:{[eE")


def check_json_values_steps(raw: bytes, max_values: int) -> Steps[int]:
    """The body's :func:`json_value_count`, or :class:`TooManyValues` (413) past
    ``max_values`` (config ``max_json_values``), before anything decodes it. A body of at most
    :data:`QUICK_CHECK_BYTES` whose :func:`_value_count_bound` is within ``max_values`` passes
    without the exact count (that bound is returned instead): the strings need not be split
    out of an ordinary body to know it is far below the bound (issue 27)."""
    if len(raw) <= QUICK_CHECK_BYTES:
        bound = _value_count_bound(raw)
        if bound <= max_values:
            return bound  # within max_values whatever the strings hold: not counted exactly
    values = yield from json_value_count_steps(raw, max_values)
    if values > max_values:
        raise TooManyValues(
            f"request body holds more JSON values than max_json_values ({max_values}): "
            f"counted at least {values} (objects and arrays count {CONTAINER_WEIGHT}, numbers "
            f"with an exponent {EXPONENT_WEIGHT})"
        )
    return values


def decoded_size(obj: dict[str, Any]) -> int:
    """The bytes a decoded JSON body holds: ``sys.getsizeof`` of every object, string and
    number in it (cached small ints and singletons counted too, a slight overcount).

    Not the body's length: one character outside Latin-1 doubles a string's size in memory
    (U+2014, an em dash, makes every character of a long answer take 2 bytes), one outside the
    BMP (an emoji) quadruples it, and a list of small objects (``[{}, {}, ...]``) takes 20 and
    more times its text. Equal to :func:`_weigh_within_bounds` of a body within the bounds."""
    size = _weigh_within_bounds(obj)
    if size is None:
        raise ValueError("decoded_size: the object breaks a bound (depth or int64)")
    return size


def _weigh_within_bounds(obj: dict[str, Any] | list[Any]) -> int | None:
    return run_steps(_weigh_steps(obj))


def _weigh_steps(obj: dict[str, Any] | list[Any]) -> Steps[int | None]:
    """:func:`decoded_size` of ``obj``, or None when it breaks a bound (depth or int64): one
    walk for both, since each visit of a Python object costs the event loop (issue 26). The
    shallow sizes of a container's members are summed in C (``map``); the Python loop only
    picks out the containers to visit and the integers to range-check, and only in a container
    that holds some (``set(map(type, ...))``; a list of integers alone, token ids, is
    range-checked by ``min`` and ``max``). A step every :data:`_WEIGH_STEP_ITEMS` members.
    Iterative: a hostile body cannot exhaust the Python stack."""
    getsize = sys.getsizeof
    size = getsize(obj)
    stack: list[tuple[Any, int]] = [(obj, 1)]
    pop, push = stack.pop, stack.append
    visited = 0
    while stack:
        value, depth = pop()
        if depth > MAX_JSON_DEPTH:
            return None
        if type(value) is dict:
            size += sum(map(getsize, value))
            items: Any = value.values()
        else:
            items = value
        if len(items) <= _WEIGH_STEP_ITEMS:
            chunks: Any = (items,)
        else:  # a long one in chunks, a step each
            members = items if type(items) is list else list(items)
            chunks = (members[i:i + _WEIGH_STEP_ITEMS]
                      for i in range(0, len(members), _WEIGH_STEP_ITEMS))
        for chunk in chunks:
            visited += len(chunk)
            if visited >= _WEIGH_STEP_ITEMS:  # a step's worth of members: let others run
                visited = 0
                yield
            size += sum(map(getsize, chunk))
            kinds = set(map(type, chunk))
            if kinds == _INTS:  # token ids: range-checked in C
                if not (INT64_MIN <= min(chunk) and max(chunk) <= INT64_MAX):
                    return None
            elif not kinds.isdisjoint(_VISITED):
                for item in chunk:
                    kind = type(item)
                    if kind is dict or kind is list:
                        push((item, depth + 1))
                    elif kind is int and not INT64_MIN <= item <= INT64_MAX:
                        return None
    return size


def _weigh_quick(obj: dict[str, Any] | list[Any], depth: int = 1) -> int | None:
    """:func:`_weigh_steps` at once, by recursion: for a body of at most
    :data:`QUICK_CHECK_BYTES` (its depth, at most :data:`MAX_JSON_DEPTH` frames here, is
    checked on the way down), where the walk's own bookkeeping cost more than the visits."""
    if depth > MAX_JSON_DEPTH:
        return None
    getsize = sys.getsizeof
    size = getsize(obj)
    if type(obj) is dict:
        size += sum(map(getsize, obj))
        items: Any = obj.values()
    else:
        items = obj
    for item in items:
        kind = type(item)
        if kind is dict or kind is list:
            inner = _weigh_quick(item, depth + 1)
            if inner is None:
                return None
            size += inner
        else:
            if kind is int and not INT64_MIN <= item <= INT64_MAX:
                return None
            size += getsize(item)
    return size


def _weigh_body_steps(obj: dict[str, Any], raw: bytes) -> Steps[int | None]:
    """:func:`_weigh_steps` of ``obj`` decoded from ``raw``; quick for a small body."""
    if len(raw) <= QUICK_CHECK_BYTES:
        return _weigh_quick(obj)
    return (yield from _weigh_steps(obj))


_INTS = frozenset({int})
# The kinds of member :func:`_weigh_within_bounds` visits one by one.
_VISITED = frozenset({dict, list, int})


def decode_object(raw: bytes, max_values: int = DEFAULT_MAX_JSON_VALUES) -> dict[str, Any]:
    """Decode a JSON body that must be an object within the bounds (values, depth, int64).

    Raises :class:`TooManyValues` past ``max_values`` (config ``max_json_values``), before
    decoding, and :class:`BadRequest` naming the problem and its JSON path."""
    return run_steps(decode_object_steps(raw, max_values))


def decode_object_steps(raw: bytes,
                        max_values: int = DEFAULT_MAX_JSON_VALUES) -> Steps[dict[str, Any]]:
    """:func:`decode_object` in steps."""
    obj = yield from _decode_object_steps(raw, max_values)
    if (yield from _weigh_body_steps(obj, raw)) is None:
        raise BadRequest(f"invalid request body: {_describe_violation(obj, '$', 1)}")
    return obj


def _decode_object_steps(raw: bytes, max_values: int) -> Steps[dict[str, Any]]:
    yield from check_json_values_steps(raw, max_values)
    try:
        obj = JSON_DECODER.decode(raw)
    except RecursionError as exc:
        raise BadRequest(
            f"invalid request body: JSON nesting deeper than {MAX_JSON_DEPTH} levels - at `$`"
        ) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest(f"request body must be a JSON object, got {_json_type(obj)} at `$`")
    yield
    return obj


def _keys_in_windows(pattern: re.Pattern[bytes], raw: bytes, reach: int, group: int,
                     window: int = 1 << 20) -> Steps[list[bytes]]:
    """``pattern``'s matches (its ``group``) in ``raw``, a key and its colon each, found a
    ``window`` of bytes at a time (a step each): those that start in the window. A key and its
    colon have only whitespace between them, so the first byte that is not whitespace past the
    window's end plus ``reach`` (the longest key) ends every match that starts in it."""
    found: list[bytes] = []
    for start in range(0, len(raw), window):
        end = start + window
        after = _NOT_WHITESPACE.search(raw, end + reach)
        stop = len(raw) if after is None else after.end()
        found += (m[group] for m in pattern.finditer(raw, start, stop) if m.start() < end)
        yield
    return found


def _duplicated_key(raw: bytes) -> str | None:
    return run_steps(_duplicated_key_steps(raw))


def _duplicated_key_steps(raw: bytes) -> Steps[str | None]:
    """An interpreted top-level key that appears more than once in ``raw``, else None.

    JSON parsers disagree on duplicated names (first or last wins), so a body that names one of
    these twice could be routed by one value (a proxy) and judged by another: refused. The cheap
    byte scan (a step per MiB) finds candidates (an interpreted name followed by a colon more
    than once, or any key spelled with ``\\u`` escapes that unescapes to one of them); only
    then is the top level parsed with every pair kept."""
    if len(raw) <= QUICK_CHECK_BYTES and (b"\\" not in raw or b"\\u" not in raw):
        names = _KEY_CANDIDATE.findall(raw)  # one search where the windows cost more
        if len(names) == len(set(names)):
            return None
    candidates = yield from _keys_in_windows(_KEY_CANDIDATE, raw, _LONGEST_NAME, 1)
    if b"\\u" in raw:
        escaped = yield from _keys_in_windows(_ESCAPED_KEY, raw, _LONGEST_ESCAPED, 0, 1 << 18)
        for spelled in escaped:
            name = json.loads(spelled).encode()
            if name in _INTERPRETED_NAMES:
                candidates.append(name)
    if len(candidates) == len(set(candidates)):
        return None
    yield
    top: list[list[tuple[str, Any]]] = []

    def keep(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        top.append(pairs)
        return {}

    try:
        json.loads(raw, object_pairs_hook=keep)
    except (ValueError, RecursionError):
        return None
    if not top:
        return None
    names = [name for name, _value in top[-1]]  # the outermost object is completed last
    for key in _INTERPRETED_KEYS:
        if names.count(key) > 1:
            return key
    return None


def decode_verify(raw: bytes, num_rollouts: int, rollout_id: str | None = None,
                  arrival_slots: bool = False, *,
                  max_values: int = DEFAULT_MAX_JSON_VALUES) -> VerifyMember:
    """:func:`decode_verify_steps` at once."""
    return run_steps(decode_verify_steps(raw, num_rollouts, rollout_id, arrival_slots,
                                         max_values=max_values))


def decode_verify_steps(raw: bytes, num_rollouts: int, rollout_id: str | None = None,
                        arrival_slots: bool = False, *,
                        max_values: int = DEFAULT_MAX_JSON_VALUES) -> Steps[VerifyMember]:
    """Validate a ``/verify`` body (``rollout_id``: NeMo Gym's, from the request path).

    Raises :class:`TooManyValues` (413) past ``max_values`` (config ``max_json_values``),
    :class:`BadRequest` (400) for malformed JSON or wrong types, naming the JSON path, and
    :class:`BadCoordinates` (422) for a missing or out-of-range rollout index or a negative
    attempt. With ``arrival_slots`` (config ``legacy_slots: arrival``) a legacy member (no group
    id) may leave the rollout index out: the registry gives it the next free slot of its
    prompt-keyed cohort. The decoded body is not kept: the member holds ``raw`` (see
    :class:`VerifyMember`).
    """
    body = yield from _decode_object_steps(raw, max_values)
    size_bytes = yield from _weigh_body_steps(body, raw)
    if size_bytes is None:
        raise BadRequest(f"invalid request body: {_describe_violation(body, '$', 1)}")
    yield
    duplicated = yield from _duplicated_key_steps(raw)
    yield
    if duplicated is not None:
        raise BadRequest(f"invalid request body: key appears more than once - at `$.{duplicated}`")
    view = body
    for alias, canonical in IDENTITY_ALIASES.items():
        if alias in body:
            if canonical in body:
                if body[alias] != body[canonical]:
                    raise BadRequest(
                        f"invalid request body: `{alias}` and `{canonical}` disagree - at "
                        f"`$.{alias}`"
                    )
                continue
            if view is body:
                view = dict(body)
            view[canonical] = view.pop(alias)
    try:
        fields = msgspec.convert(view, VerifyFields)
    except msgspec.ValidationError as exc:
        raise BadRequest(_validation_detail(exc)) from exc
    prompt_input = fields.responses_create_params.get("input")
    if not isinstance(prompt_input, (str, list)):
        raise BadRequest(
            "invalid request body: Expected `str | array`, got "
            f"`{_json_type(prompt_input)}` - at `$.responses_create_params.input`"
        )
    attempt = fields.group_attempt
    if attempt is not None and attempt < 0:
        raise BadCoordinates(f"_ng_group_attempt must be >= 0, got {attempt}")
    if num_rollouts > 1:
        index = fields.rollout_index
        if index is None and not (arrival_slots and fields.group_id is None):
            hint = ("" if fields.group_id is not None else
                    " (a legacy member, without _ng_group_id, may leave it out when the server "
                    "runs with legacy_slots: arrival)")
            raise BadCoordinates(
                f"_ng_rollout_index is required when num_rollouts_per_prompt = {num_rollouts}"
                + hint
            )
        if index is not None and not 0 <= index < num_rollouts:
            raise BadCoordinates(
                f"_ng_rollout_index must be in [0, {num_rollouts}), got {index}"
            )
    return VerifyMember(
        raw=raw,
        group_id=fields.group_id,
        attempt=attempt or 0,
        attempt_given=attempt is not None,
        rollout_index=fields.rollout_index,
        size_bytes=size_bytes,
        rollout_id=rollout_id,
    )


def decode_compare(raw: bytes, max_responses: int,
                   max_values: int = DEFAULT_MAX_JSON_VALUES) -> CompareRequest:
    """Validate a ``/compare`` body; raises :class:`TooManyValues` past ``max_values``,
    :class:`BadRequest` naming the JSON path, also when ``response_objs`` holds more than
    ``max_responses`` (config ``max_compare_responses``)."""
    return run_steps(decode_compare_steps(raw, max_responses, max_values))


def decode_compare_steps(raw: bytes, max_responses: int,
                         max_values: int = DEFAULT_MAX_JSON_VALUES) -> Steps[CompareRequest]:
    """:func:`decode_compare` in steps."""
    obj = yield from decode_object_steps(raw, max_values)
    try:
        request = msgspec.convert(obj, CompareRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(_validation_detail(exc)) from exc
    if len(request.response_objs) > max_responses:
        raise BadRequest(
            f"invalid request body: Expected `array` of length <= {max_responses} "
            f"(max_compare_responses), got {len(request.response_objs)} - at `$.response_objs`"
        )
    return request


def decode_aggregate(raw: bytes,
                     max_values: int = DEFAULT_MAX_JSON_VALUES) -> AggregateMetricsRequest:
    """Validate an ``/aggregate_metrics`` body: each row's interpreted keys are typed
    (:class:`AggregateRow`); raises :class:`TooManyValues` past ``max_values``,
    :class:`BadRequest` naming the JSON path."""
    return run_steps(decode_aggregate_steps(raw, max_values))


def decode_aggregate_steps(
        raw: bytes, max_values: int = DEFAULT_MAX_JSON_VALUES) -> Steps[AggregateMetricsRequest]:
    """:func:`decode_aggregate` in steps."""
    obj = yield from decode_object_steps(raw, max_values)
    try:
        msgspec.convert(obj, _TypedAggregateRequest)
        return msgspec.convert(obj, AggregateMetricsRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(_validation_detail(exc)) from exc


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def bound_text(text: str, limit: int = MAX_FAILURE_TEXT) -> str:
    """Cut ``text`` to at most ``limit`` characters, marking the cut."""
    if len(text) <= limit:
        return text
    marker = " ...[cut]"
    return text[: limit - len(marker)] + marker


def identity_fields(member: VerifyMember) -> dict[str, Any]:
    return {
        "_ng_group_id": member.group_id,
        "_ng_group_attempt": member.attempt,
        "_ng_rollout_index": member.rollout_index,
    }


def success_body(member: VerifyMember, reward: float, defaulted_comparisons: int | None = 0,
                 cohort_expected: int | None = 1, cohort_scored: int | None = 1,
                 reused_comparisons: int | None = 0,
                 assigned_slot: int | None = None) -> dict[str, Any]:
    """The 200 answer for a rewarded member: its body (identity keys only under ``_ng_`` names)
    plus the reward, the unmasked markers, :data:`DEFAULTED_COMPARISONS_KEY` and
    :data:`REUSED_COMPARISONS_KEY` (each None when unknown: a record reloaded from the
    journal), :data:`COHORT_EXPECTED_KEY` and :data:`COHORT_SCORED_KEY` (1 and 1 without
    cohorts, N <= 1). ``assigned_slot``: the slot a member sent without ``_ng_rollout_index``
    was given by arrival (``legacy_slots: arrival``), answered as its ``_ng_rollout_index``."""
    if not math.isfinite(reward):  # guarded by the registry; never publish a non-finite reward
        raise ValueError("non-finite reward")
    out = {k: v for k, v in member.body().items() if k not in IDENTITY_ALIASES}
    out.update(identity_fields(member))
    if member.rollout_index is None and assigned_slot is not None:
        out["_ng_rollout_index"] = assigned_slot
    out["reward"] = reward
    out["mask_sample"] = False
    out["failure_kind"] = None
    out["failure_reason"] = None
    out[DEFAULTED_COMPARISONS_KEY] = defaulted_comparisons
    out[COHORT_EXPECTED_KEY] = cohort_expected
    out[COHORT_SCORED_KEY] = cohort_scored
    out[REUSED_COMPARISONS_KEY] = reused_comparisons
    return out


def masked_body(member: VerifyMember, reason: str) -> dict[str, Any]:
    """The masked judge-failure 200 (contract 3.3): the body as received plus the mask keys.
    The body is decoded afresh for it; ``instance_config`` is copied."""
    text = bound_text(reason)
    out = member.body()
    instance_config = out.get("instance_config")
    merged = dict(instance_config) if isinstance(instance_config, dict) else {}
    merged["mask_sample"] = True
    out["reward"] = 0.0
    out["mask_sample"] = True
    out["failure_kind"] = "judge_failed"
    out["failure_reason"] = text
    out["instance_config"] = merged
    out["_ng_failure_class"] = "judge_failed"
    out["_ng_failure_judge_error"] = text
    return out


def error_body(detail: str, failure_kind: str | None) -> dict[str, Any]:
    return {"detail": detail, "failure_kind": failure_kind}


# --------------------------------------------------------------------------- POST /get_reward

#: Most samples one ``POST /get_reward`` may carry (OpenRLHF >= 0.9.1 sends one; up to 0.9.0 a
#: whole batch).
MAX_GET_REWARD_SAMPLES = 4096
#: Longest label, as canonical JSON, accepted in ``labels`` (it is hashed into the cohort key).
MAX_LABEL_CHARS = 65536
#: The prefix of the cohort key scope of a ``/get_reward`` sample (then the label's digest).
GET_REWARD_SCOPE = "openrlhf-label"


class GetRewardRequest(msgspec.Struct, kw_only=True):
    """OpenRLHF's remote reward request: ``query`` (prompt + response texts), ``prompts`` and
    ``labels``, one entry per sample, in the same order."""

    query: list[str]
    prompts: list[str]
    labels: list[Any] | None = None


def decode_get_reward(raw: bytes,
                      max_values: int = DEFAULT_MAX_JSON_VALUES) -> GetRewardRequest:
    """Validate a ``/get_reward`` body; raises :class:`TooManyValues` past ``max_values``
    (config ``max_json_values``), :class:`BadRequest` naming the JSON path: wrong types, more
    than :data:`MAX_GET_REWARD_SAMPLES` samples, lists of different lengths, a label longer
    than :data:`MAX_LABEL_CHARS` as JSON. Pure."""
    return run_steps(decode_get_reward_steps(raw, max_values))


def decode_get_reward_steps(raw: bytes,
                            max_values: int = DEFAULT_MAX_JSON_VALUES) -> Steps[GetRewardRequest]:
    """:func:`decode_get_reward` in steps."""
    obj = yield from decode_object_steps(raw, max_values)
    try:
        request = msgspec.convert(obj, GetRewardRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(_validation_detail(exc)) from exc
    n = len(request.query)
    if n > MAX_GET_REWARD_SAMPLES:
        raise BadRequest(
            f"invalid request body: Expected `array` of length <= {MAX_GET_REWARD_SAMPLES}, "
            f"got {n} - at `$.query`")
    if len(request.prompts) != n:
        raise BadRequest(
            f"invalid request body: `prompts` has {len(request.prompts)} entries, `query` {n} "
            "- at `$.prompts`")
    if request.labels is not None:
        if len(request.labels) != n:
            raise BadRequest(
                f"invalid request body: `labels` has {len(request.labels)} entries, `query` "
                f"{n} - at `$.labels`")
        for i, label in enumerate(request.labels):
            if len(JSON_ENCODER.encode(label)) > MAX_LABEL_CHARS:
                raise BadRequest(
                    f"invalid request body: label longer than {MAX_LABEL_CHARS} characters as "
                    f"JSON - at `$.labels[{i}]`")
    return request
