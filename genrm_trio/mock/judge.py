"""The fault-injecting mock GenRM judge: an OpenAI-compatible fake on trio sockets and h11.

It answers ``POST /v1/responses`` and ``POST /v1/chat/completions`` with a deterministic verdict
(:func:`genrm_trio.scoring.heuristic_judge_text` of the history, the two answers and the
principle), after a configurable latency, behind an optional capacity limit, and injects faults
on demand. The HTTP layer is h11 over raw trio sockets on purpose: a connection reset, a body
shorter than its ``Content-Length``, a chunked body cut mid-way and a trickled body must be real
on the wire, which a web framework would hide or repair.

::

    run_mock_judge(settings, state=...)      one listener, one task per connection (keep-alive)
      +-- connection task                    h11 request loop
            +-- judge call                   count, pick fault, [capacity] latency, answer/fault
            +-- /health, /admin/*            stats, fault plan, reset (not counted as calls)

Layering: this module is a tool. It imports the pure core (``scoring``, ``errors``) and nothing
from ``server`` or ``caller``; it never imports httpx2.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import random
import re
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NoReturn

import click
import h11
import msgspec
import trio
import yaml

from genrm_trio import scoring
from genrm_trio.errors import ConfigError
from genrm_trio.tools.openai_shapes import chat_completion, output_message, responses_object

__all__ = [
    "Fault",
    "MockJudgeSettings",
    "MockJudgeState",
    "mock_judge_cli",
    "run_mock_judge",
    "settings_from_mapping",
]

log = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
CHAT_PATH = "/v1/chat/completions"
_JUDGE_PATHS = (RESPONSES_PATH, CHAT_PATH)

_RECV_BYTES = 65536
_MAX_BODY_BYTES = 64 * 1024 * 1024
_BACKLOG = 4096
# Small pieces so every single read succeeds quickly: only a whole-call deadline stops a trickle.
_TRICKLE_PIECE_BYTES = 4

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


class Fault(enum.StrEnum):
    """One way a judge call can go wrong (``NONE``: it does not).

    On the wire: ``503``/``408`` JSON error statuses (408 closes the connection); ``429`` with a
    ``Retry-After`` header; ``reset`` closes the socket with RST after reading the request;
    ``truncated`` declares a ``Content-Length`` larger than the bytes sent, then closes;
    ``cut_chunked`` stops a chunked body mid-way, then closes; ``trickle`` sends a valid body a
    few bytes at a time, ``trickle_interval_s`` apart; ``hang`` never answers (until the client
    leaves or the server stops); ``garbage`` is a 200 whose text has no JSON verdict; ``empty``
    a 200 with blank text; ``nonfinite`` a 200 whose verdict has ``1e999`` scores;
    ``extreme`` finite scores near the float limit with opposite signs; ``wrong_types`` a
    verdict of lists and words; ``out_of_range`` scores and ranking off their scales;
    ``incomplete`` a 200 with ``"status": "incomplete"`` and a cut verdict.
    """

    NONE = "none"
    HTTP_503 = "503"
    HTTP_429 = "429"
    HTTP_408 = "408"
    RESET = "reset"
    TRUNCATED = "truncated"
    CUT_CHUNKED = "cut_chunked"
    TRICKLE = "trickle"
    HANG = "hang"
    GARBAGE = "garbage"
    EMPTY = "empty"
    NONFINITE = "nonfinite"
    EXTREME = "extreme"
    WRONG_TYPES = "wrong_types"
    OUT_OF_RANGE = "out_of_range"
    INCOMPLETE = "incomplete"


# The random mix (fault_rate > 0 with fault "none") leaves out the two faults that only a
# client-side deadline ends; ask for them by name.
_RANDOM_MIX: tuple[Fault, ...] = tuple(
    f for f in Fault if f not in (Fault.NONE, Fault.HANG, Fault.TRICKLE)
)


class MockJudgeSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the mock judge listens, how slow it is and which faults it injects.

    ``latency_s`` plus a uniform extra in ``[0, latency_jitter_s]`` is spent on every judge call
    (inside the capacity limit). ``capacity``: at most that many calls served at once, the rest
    queue. ``fault`` applies to the first ``fault_count`` calls (``None``: every call); with
    ``fault_rate > 0`` each call is faulty with that probability instead (``fault`` ``none``
    then means a random mix), ``fault_count`` capping the total. ``seed`` drives jitter and
    random faults. Invalid values raise :class:`ConfigError` naming the key.

    ``roles``: ``genrm`` understands GenRM's ``response_1``/``response_2``/``principle`` chat
    roles and Responses ``metadata``, as vLLM with a GenRM template does; ``standard`` is a
    stock server: any other role than ``system``, ``user``, ``assistant``, ``developer`` or
    ``tool`` (and GenRM ``metadata``) gets HTTP 500 with an error body naming the roles, as
    llama.cpp's server answers. Either way a request without GenRM roles is a plain prompt: the
    answers are read from its ``<response_1>``/``<response_2>`` sections (the default plain
    template), else the verdict is derived from a hash of the prompt. ``accept_json_schema:
    false`` answers a ``json_schema`` response format with 500 and a validation error, as
    llama-cpp-python's server does.

    What a real server also does, always: an answer longer than the request's ``max_tokens`` /
    ``max_output_tokens`` (estimated at 4 characters a token) is cut there, with
    ``finish_reason: length`` (chat) or ``status: incomplete`` (responses); a ``response_format``
    (chat) or ``text.format`` (responses) of type ``json_schema`` or ``json_object`` is checked
    (400 if malformed) and honoured: the answer is the bare verdict JSON, its values moved onto
    the schema's ``enum`` when it has one.
    """

    host: str = "127.0.0.1"
    port: int = 0
    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    capacity: int | None = None
    fault: Fault = Fault.NONE
    fault_count: int | None = None
    fault_rate: float = 0.0
    seed: int = 0
    retry_after_s: float = 1.0
    trickle_interval_s: float = 0.5
    roles: Literal["genrm", "standard"] = "genrm"
    accept_json_schema: bool = True

    def __post_init__(self) -> None:
        for key in ("latency_s", "latency_jitter_s", "retry_after_s", "trickle_interval_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(key, f"must be a finite number >= 0, got {value!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port!r}")
        if self.capacity is not None and self.capacity < 1:
            raise ConfigError("capacity", f"must be >= 1 or null, got {self.capacity!r}")
        if self.fault_count is not None and self.fault_count < 0:
            raise ConfigError("fault_count", f"must be >= 0 or null, got {self.fault_count!r}")
        if not (math.isfinite(self.fault_rate) and 0.0 <= self.fault_rate <= 1.0):
            raise ConfigError("fault_rate", f"must be in [0, 1], got {self.fault_rate!r}")


_SETTINGS_KEYS = frozenset(MockJudgeSettings.__struct_fields__)
_VALIDATION_PATH = re.compile(r"\s*-\s*at `\$\.(\w+)[^`]*`$")


def settings_from_mapping(values: dict[str, Any]) -> MockJudgeSettings:
    """Build settings from a plain mapping (YAML, ``--set``); pure, no I/O.

    Raises :class:`ConfigError` naming the first unknown or invalid key.
    """
    for key in values:
        if key not in _SETTINGS_KEYS:
            raise ConfigError(str(key), "unknown mock judge setting")
    fixed = dict(values)
    if "fault" in fixed and not isinstance(fixed["fault"], str):
        # YAML reads `fault: 503` as an int; the enum's values are strings.
        fixed["fault"] = str(fixed["fault"])
    try:
        return msgspec.convert(fixed, MockJudgeSettings)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _VALIDATION_PATH.search(message)
        key = match.group(1) if match else "mock_judge"
        raise ConfigError(key, _VALIDATION_PATH.sub("", message)) from exc


class MockJudgeState:
    """Counters and the live fault plan of one mock judge; owned by whoever runs the server.

    Plain synchronous object: tests create it, hand it to :func:`run_mock_judge`, then read the
    counters or change the fault plan between calls. ``calls`` counts every judge request
    received (admin and health requests are not counted); ``in_flight`` are calls being served
    inside the capacity limit, ``queued`` those waiting for it; ``busy_s`` sums the seconds
    calls spent inside the capacity limit (busy time, for utilisation); ``connections`` counts
    accepted connections.
    """

    def __init__(
        self,
        fault: Fault | str = Fault.NONE,
        fault_count: int | None = None,
        *,
        fault_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        self.calls = 0
        self.calls_by_path: dict[str, int] = dict.fromkeys(_JUDGE_PATHS, 0)
        self.faults_injected: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.busy_s = 0.0
        self.queued = 0
        self.connections = 0
        self._changed = trio.lowlevel.ParkingLot()
        self.fault = Fault.NONE
        self.fault_remaining: int | None = None
        self.fault_rate = 0.0
        self.set_fault(fault, fault_count, rate=fault_rate)

    @classmethod
    def from_settings(cls, settings: MockJudgeSettings) -> MockJudgeState:
        """A fresh state carrying the settings' fault plan and seed."""
        return cls(
            settings.fault, settings.fault_count, fault_rate=settings.fault_rate, seed=settings.seed
        )

    def set_fault(self, fault: Fault | str, count: int | None, *, rate: float = 0.0) -> None:
        """Replace the fault plan: ``fault`` on the next ``count`` calls (``None``: all of them).

        With ``rate > 0`` each call is faulty with that probability (``count`` caps the total).
        Raises ``ValueError`` for an unknown fault, a negative count or a rate outside [0, 1].
        """
        fault = Fault(fault)
        if count is not None and count < 0:
            raise ValueError(f"fault count must be >= 0 or null, got {count!r}")
        if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
            raise ValueError(f"fault rate must be in [0, 1], got {rate!r}")
        self.fault = fault
        self.fault_remaining = count
        self.fault_rate = rate

    def reset(self) -> None:
        """Counters to zero and no fault. ``in_flight`` and ``queued`` describe live calls and
        are kept; ``max_in_flight`` restarts from the current ``in_flight``."""
        self.calls = 0
        self.connections = 0
        self.calls_by_path = dict.fromkeys(_JUDGE_PATHS, 0)
        self.faults_injected = {}
        self.max_in_flight = self.in_flight
        self.busy_s = 0.0
        self.set_fault(Fault.NONE, None)

    def notify(self) -> None:
        """Wake :meth:`wait_for` callers; the server calls it whenever a counter moves."""
        self._changed.unpark_all()

    async def wait_for(self, predicate: Callable[[MockJudgeState], bool]) -> None:
        """Block until ``predicate(state)`` holds, re-checked each time a call arrives, starts
        or ends or a connection opens. No deadline of its own: wrap it in yours."""
        while not predicate(self):
            await self._changed.park()
        await trio.lowlevel.checkpoint()

    def next_fault(self) -> Fault:
        """Decide (and count) the fault of the next judge call, in arrival order."""
        if self.fault_remaining == 0:
            return Fault.NONE
        if self.fault_rate > 0.0:
            if self.rng.random() >= self.fault_rate:
                return Fault.NONE
            fault = self.fault if self.fault is not Fault.NONE else self.rng.choice(_RANDOM_MIX)
        elif self.fault is Fault.NONE:
            return Fault.NONE
        else:
            fault = self.fault
        if self.fault_remaining is not None:
            self.fault_remaining -= 1
        self.faults_injected[fault.value] = self.faults_injected.get(fault.value, 0) + 1
        return fault

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy of the counters and the fault plan (``GET /admin/stats``)."""
        return {
            "calls": self.calls,
            "calls_by_path": dict(self.calls_by_path),
            "faults_injected": dict(self.faults_injected),
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "busy_s": self.busy_s,
            "queued": self.queued,
            "connections": self.connections,
            "fault": self.fault.value,
            "fault_remaining": self.fault_remaining,
            "fault_rate": self.fault_rate,
        }


class _BadJudgeRequest(Exception):
    """The judge request body is not what either API expects (answered with ``status``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        self.status = status
        super().__init__(message)


class _JudgeInput(msgspec.Struct, frozen=True):
    """What a judge call asks: the comparison, the model, the output budget (tokens, None:
    unlimited) and the structured-output format (None: free text)."""

    history: list[dict[str, str]]
    response_1: str
    response_2: str
    principle: str | None
    model: str
    max_tokens: int | None = None
    output_format: dict[str, Any] | None = None
    plain_prompt: str | None = None  # a request without GenRM roles: its whole prompt text


_STANDARD_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
_GENRM_ROLES = ("principle", "response_1", "response_2")
_PLAIN_SECTION = re.compile(r"<(response_1|response_2|conversation)>\n?(.*?)\n?</\1>", re.DOTALL)


def _text_of(content: Any) -> str:
    """Message content as text: a string, or the concatenated text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) and model else "mock-genrm"


def _max_tokens(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _BadJudgeRequest(f"{key} must be a positive integer")
    return value


def _format_spec(fmt: Any, where: str, settings: MockJudgeSettings) -> dict[str, Any] | None:
    """Check a structured-output request; return ``{"type": ..., "schema": ...|None}`` or None
    for free text. ``where`` names the field in errors."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _BadJudgeRequest(f"{where} must be an object with a type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise _BadJudgeRequest(f"{where}.schema must be an object")
        return {"type": kind, "schema": schema}
    if kind == "json_schema":
        if not settings.accept_json_schema:
            raise _BadJudgeRequest(
                f"{where}.type: input should be 'text' or 'json_object'", status=500)
        # chat nests {name, schema} under json_schema; responses puts them beside type
        spec = fmt.get("json_schema") if where == "response_format" else fmt
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _BadJudgeRequest(f"{where} of type json_schema needs a name")
        if not isinstance(spec.get("schema"), dict):
            raise _BadJudgeRequest(f"{where} of type json_schema needs a schema object")
        return {"type": kind, "schema": spec["schema"]}
    raise _BadJudgeRequest(f"{where}.type {kind!r} is not supported")


def _refuse_roles(roles: list[str]) -> None:
    raise _BadJudgeRequest(
        f"Invalid role(s) in messages: {', '.join(sorted(set(roles)))}; expected one of "
        "system, user, assistant, developer, tool", status=500)


def _plain_input(messages: list[dict[str, str]], body: dict[str, Any],
                 max_tokens: int | None, output_format: dict[str, Any] | None) -> _JudgeInput:
    """A plain prompt: the answers from its tagged sections when it has them."""
    text = "\n".join(m["content"] for m in messages)
    sections = {m.group(1): m.group(2) for m in _PLAIN_SECTION.finditer(text)}
    conversation = sections.get("conversation", text)
    return _JudgeInput(
        [{"role": "user", "content": conversation}], sections.get("response_1", ""),
        sections.get("response_2", ""), None, _model_of(body), max_tokens, output_format,
        plain_prompt=None if "response_1" in sections and "response_2" in sections else text,
    )


def _responses_input(body: Any, settings: MockJudgeSettings) -> _JudgeInput:
    if not isinstance(body, dict):
        raise _BadJudgeRequest("body must be a JSON object")
    max_tokens = _max_tokens(body, "max_output_tokens")
    text_field = body.get("text")
    if text_field is not None and not isinstance(text_field, dict):
        raise _BadJudgeRequest("text must be an object")
    output_format = _format_spec((text_field or {}).get("format"), "text.format", settings)
    raw_input = body.get("input")
    items = raw_input if isinstance(raw_input, list) else []
    roles = [str(i.get("role")) for i in items if isinstance(i, dict) and "role" in i]
    metadata = body.get("metadata")
    genrm = isinstance(metadata, dict) and (
        "response_1" in metadata or "response_2" in metadata)
    if settings.roles == "standard":
        bad = [r for r in roles if r not in _STANDARD_ROLES]
        if genrm:
            bad += ["response_1", "response_2"]  # what a model server would turn them into
        if bad:
            _refuse_roles(bad)
    if not genrm:
        if metadata is not None and not isinstance(metadata, dict):
            raise _BadJudgeRequest("metadata must be an object")
        messages = scoring.conversation_history(raw_input)
        if not messages:
            raise _BadJudgeRequest("input must hold the prompt's messages")
        return _plain_input(messages, body, max_tokens, output_format)
    assert isinstance(metadata, dict)
    r1, r2 = metadata.get("response_1"), metadata.get("response_2")
    if not isinstance(r1, str) or not isinstance(r2, str):
        raise _BadJudgeRequest("metadata.response_1 and metadata.response_2 must be strings")
    principle = metadata.get("principle")
    if principle is not None and not isinstance(principle, str):
        raise _BadJudgeRequest("metadata.principle must be a string")
    history = scoring.conversation_history(raw_input)
    return _JudgeInput(history, r1, r2, principle, _model_of(body), max_tokens, output_format)


def _chat_input(body: Any, settings: MockJudgeSettings) -> _JudgeInput:
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise _BadJudgeRequest("body must be a JSON object with a messages list")
    max_tokens = _max_tokens(body, "max_tokens")
    output_format = _format_spec(body.get("response_format"), "response_format", settings)
    history: list[dict[str, str]] = []
    special: dict[str, str] = {}
    roles: list[str] = []
    for message in body["messages"]:
        if not isinstance(message, dict):
            raise _BadJudgeRequest("every message must be an object")
        role = message.get("role")
        role = role if isinstance(role, str) else "user"
        roles.append(role)
        text = _text_of(message.get("content"))
        if role in _GENRM_ROLES:
            special[role] = text
        else:
            history.append({"role": role, "content": text})
    if settings.roles == "standard":
        bad = [r for r in roles if r not in _STANDARD_ROLES]
        if bad:
            _refuse_roles(bad)
    if not special:
        if not history:
            raise _BadJudgeRequest("messages must not be empty")
        return _plain_input(history, body, max_tokens, output_format)
    if "response_1" not in special or "response_2" not in special:
        raise _BadJudgeRequest("messages need a response_1 and a response_2 role")
    return _JudgeInput(
        history,
        special["response_1"],
        special["response_2"],
        special.get("principle"),
        _model_of(body),
        max_tokens,
        output_format,
    )


_GARBAGE_TEXT = (
    "Both responses have merits. After weighing helpfulness and accuracy I would rather not "
    "commit to scores for this pair."
)
_NONFINITE_TEXT = '```json\n{"score_1": 1e999, "score_2": -1e999, "ranking": 3.5}\n```'
# Poisoned verdicts that parse as JSON: each must be refused, never summed.
_POISON_TEXT = MappingProxyType({
    "extreme": '{"score_1": 1.7e308, "score_2": -1.7e308, "ranking": 1}',
    "wrong_types": '{"score_1": [4], "score_2": {"v": 2}, "ranking": "high"}',
    "out_of_range": '{"score_1": 9, "score_2": -3, "ranking": 0}',
})


def _hash_verdict(text: str) -> scoring.Verdict:
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return scoring.Verdict(1.0 + digest[0] % 5, 1.0 + digest[1] % 5, 1.0 + digest[2] % 6)


def _on_enum(value: float, prop: Any) -> float:
    """``value`` moved to the nearest member of the property's ``enum`` (ties: the lower)."""
    enum = prop.get("enum") if isinstance(prop, dict) else None
    choices = [v for v in enum if isinstance(v, int | float) and not isinstance(v, bool)] \
        if isinstance(enum, list) else []
    if not choices or value in choices:
        return value
    return float(min(choices, key=lambda c: (abs(c - value), c)))


def _structured_text(verdict: scoring.Verdict, output_format: dict[str, Any]) -> str:
    """The verdict as the bare JSON a constrained decoder would emit."""
    schema = output_format.get("schema")
    props = schema.get("properties") if isinstance(schema, dict) else None
    props = props if isinstance(props, dict) else {}
    values = {}
    for key in ("score_1", "score_2", "ranking"):
        value = _on_enum(getattr(verdict, key), props.get(key))
        values[key] = int(value) if float(value).is_integer() else value
    return _json_encode(values).decode()


def _answer_text(fault: Fault, judged: _JudgeInput) -> str:
    if fault is Fault.GARBAGE:
        return _GARBAGE_TEXT
    if fault is Fault.EMPTY:
        return ""
    if fault is Fault.NONFINITE:
        return _NONFINITE_TEXT
    if fault.value in _POISON_TEXT:
        return _POISON_TEXT[fault.value]
    if judged.plain_prompt is not None:
        verdict = _hash_verdict(judged.plain_prompt)
        text = ("```json\n" + _json_encode({"score_1": int(verdict.score_1),
                "score_2": int(verdict.score_2), "ranking": int(verdict.ranking)}).decode()
                + "\n```")
    else:
        text = scoring.heuristic_judge_text(
            judged.history, judged.response_1, judged.response_2, judged.principle
        )
    if judged.output_format is not None:
        text = _structured_text(scoring.parse_judge_output(text, 3.0, 3.5), judged.output_format)
    if fault is Fault.INCOMPLETE:
        # Output cut by the token limit: the verdict never closes.
        return text[: max(1, len(text) // 3)]
    return text


def _tokens(text: str) -> int:
    return len(text) // 4 + 1


def _answer_body(
    path: str, fault: Fault, judged: _JudgeInput, call_no: int, request_bytes: int
) -> bytes:
    text = _answer_text(fault, judged)
    incomplete = fault is Fault.INCOMPLETE
    if judged.max_tokens is not None and _tokens(text) > judged.max_tokens:
        # The output budget ran out: what fits, and the server says it stopped for length.
        text = text[: max(0, judged.max_tokens * 4 - 1)]
        incomplete = True
    status = "incomplete" if incomplete else "completed"
    input_tokens = request_bytes // 4
    output_tokens = _tokens(text)
    now = int(time.time())
    if path == RESPONSES_PATH:
        return _json_encode(responses_object(
            ident=f"resp_mock_{call_no:08d}", model=judged.model, created_at=now,
            status=status, output=[output_message(f"msg_mock_{call_no:08d}", text, status)],
            input_tokens=input_tokens, output_tokens=output_tokens,
        ))
    return _json_encode(chat_completion(
        ident=f"chatcmpl-mock-{call_no:08d}", model=judged.model, created=now, text=text,
        finish_reason="length" if incomplete else "stop", prompt_tokens=input_tokens,
        completion_tokens=output_tokens,
    ))


def _error_body(status: int, message: str) -> bytes:
    return _json_encode({"error": {"message": message, "type": "mock_judge", "code": status}})


def _seconds_header(value: float) -> bytes:
    return (str(int(value)) if value == int(value) else f"{value:g}").encode()


class _Request(msgspec.Struct):
    method: bytes
    path: str
    body: bytes


class _ConnectionGone(Exception):
    """The peer closed the connection between requests (a normal end)."""


class _Server:
    """One running mock judge: settings, shared state, the capacity limiter."""

    def __init__(self, settings: MockJudgeSettings, state: MockJudgeState) -> None:
        self.settings = settings
        self.state = state
        self.limiter = (
            trio.CapacityLimiter(settings.capacity) if settings.capacity is not None else None
        )

    # -- connection loop -------------------------------------------------------------------

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        """Serve one connection's requests until either side closes; a task boundary."""
        conn = h11.Connection(h11.SERVER)
        self.state.connections += 1
        self.state.notify()
        try:
            while True:
                try:
                    request = await self._receive_request(stream, conn)
                except _ConnectionGone:
                    return
                except h11.RemoteProtocolError as exc:
                    await self._send_protocol_error(stream, conn, exc)
                    return
                if not await self._dispatch(stream, conn, request):
                    return
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
                else:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            # The client went away mid-exchange (often on purpose: its deadline fired).
            log.debug("mock judge connection ended: %r", exc)
        finally:
            await stream.aclose()

    async def _next_event(self, stream: trio.SocketStream, conn: h11.Connection) -> Any:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(_RECV_BYTES))
                continue
            return event

    async def _receive_request(self, stream: trio.SocketStream, conn: h11.Connection) -> _Request:
        event = await self._next_event(stream, conn)
        if isinstance(event, h11.ConnectionClosed):
            raise _ConnectionGone
        if not isinstance(event, h11.Request):
            raise h11.RemoteProtocolError(f"expected a request, got {type(event).__name__}")
        method = event.method
        path = event.target.decode("ascii", "replace").split("?", 1)[0]
        if conn.client_is_waiting_for_100_continue:
            await stream.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self._next_event(stream, conn)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > _MAX_BODY_BYTES:
                    raise h11.RemoteProtocolError("request body too large", 413)
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in body")
        return _Request(method, path, b"".join(chunks))

    async def _send_protocol_error(
        self, stream: trio.SocketStream, conn: h11.Connection, exc: h11.RemoteProtocolError
    ) -> None:
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = exc.error_status_hint
        await self._send(stream, conn, status, _error_body(status, str(exc)), close=True)

    async def _send(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        status: int,
        body: bytes,
        *,
        extra: list[tuple[bytes, bytes]] | None = None,
        close: bool = False,
    ) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if extra:
            headers.extend(extra)
        if close:
            headers.append((b"connection", b"close"))
        data = conn.send(h11.Response(status_code=status, headers=headers))
        if body:
            data += conn.send(h11.Data(data=body))
        data += conn.send(h11.EndOfMessage())
        await stream.send_all(data)

    # -- routing ---------------------------------------------------------------------------

    async def _dispatch(
        self, stream: trio.SocketStream, conn: h11.Connection, request: _Request
    ) -> bool:
        """Answer one request; False when the connection must end here."""
        path, method = request.path, request.method
        if path in _JUDGE_PATHS:
            if method != b"POST":
                await self._send(stream, conn, 405, _error_body(405, "use POST"))
                return True
            return await self._judge_call(stream, conn, request)
        if path == "/health" and method == b"GET":
            body = _json_encode({"status": "ok"})
        elif path == "/admin/stats" and method == b"GET":
            body = _json_encode(self.state.snapshot())
        elif path == "/admin/fault" and method == b"POST":
            try:
                self._apply_fault_request(request.body)
            except (msgspec.DecodeError, ValueError, TypeError) as exc:
                await self._send(stream, conn, 400, _error_body(400, str(exc)))
                return True
            body = _json_encode(self.state.snapshot())
        elif path == "/admin/reset" and method == b"POST":
            self.state.reset()
            body = _json_encode(self.state.snapshot())
        else:
            await self._send(stream, conn, 404, _error_body(404, f"no route {path}"))
            return True
        await self._send(stream, conn, 200, body)
        return True

    def _apply_fault_request(self, raw: bytes) -> None:
        payload = _json_decode(raw)
        if not isinstance(payload, dict) or "fault" not in payload:
            raise ValueError('expected {"fault": NAME, "count": N|null, "rate": R}')
        count = payload.get("count")
        rate = payload.get("rate", 0.0)
        if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
            raise ValueError("count must be an integer or null")
        if not isinstance(rate, int | float) or isinstance(rate, bool):
            raise ValueError("rate must be a number")
        self.state.set_fault(str(payload["fault"]), count, rate=float(rate))

    # -- judge calls -----------------------------------------------------------------------

    async def _judge_call(
        self, stream: trio.SocketStream, conn: h11.Connection, request: _Request
    ) -> bool:
        state = self.state
        state.calls += 1
        state.calls_by_path[request.path] += 1
        call_no = state.calls
        state.notify()
        try:
            decoded = _json_decode(request.body)
            if request.path == RESPONSES_PATH:
                judged = _responses_input(decoded, self.settings)
            else:
                judged = _chat_input(decoded, self.settings)
        except msgspec.DecodeError as exc:
            await self._send(stream, conn, 400, _error_body(400, f"bad judge request: {exc}"))
            return True
        except _BadJudgeRequest as exc:
            await self._send(stream, conn, exc.status,
                             _error_body(exc.status, f"bad judge request: {exc}"))
            return True
        fault = state.next_fault()
        if self.limiter is None:
            return await self._serve_call(stream, conn, request, judged, fault, call_no)
        state.queued += 1
        state.notify()
        try:
            await self.limiter.acquire()
        finally:
            state.queued -= 1
        try:
            return await self._serve_call(stream, conn, request, judged, fault, call_no)
        finally:
            self.limiter.release()

    async def _serve_call(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        request: _Request,
        judged: _JudgeInput,
        fault: Fault,
        call_no: int,
    ) -> bool:
        state = self.state
        state.in_flight += 1
        if state.in_flight > state.max_in_flight:
            state.max_in_flight = state.in_flight
        state.notify()
        started = trio.current_time()
        try:
            delay = self.settings.latency_s
            if self.settings.latency_jitter_s > 0:
                delay += state.rng.uniform(0.0, self.settings.latency_jitter_s)
            if delay > 0:
                await trio.sleep(delay)
            return await self._answer(stream, conn, request, judged, fault, call_no)
        finally:
            state.in_flight -= 1
            state.busy_s += trio.current_time() - started
            state.notify()

    async def _answer(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        request: _Request,
        judged: _JudgeInput,
        fault: Fault,
        call_no: int,
    ) -> bool:
        if fault is Fault.HTTP_503:
            await self._send(stream, conn, 503, _error_body(503, "mock judge overloaded"))
            return True
        if fault is Fault.HTTP_429:
            retry_after = _seconds_header(self.settings.retry_after_s)
            await self._send(
                stream,
                conn,
                429,
                _error_body(429, "mock judge rate limit"),
                extra=[(b"retry-after", retry_after)],
            )
            return True
        if fault is Fault.HTTP_408:
            await self._send(stream, conn, 408, _error_body(408, "mock judge timeout"), close=True)
            return False
        if fault is Fault.RESET:
            # SO_LINGER with a zero timeout turns close() into an RST.
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if fault is Fault.HANG:
            # Keep the call (and its capacity slot) until the client leaves.
            while await stream.receive_some(_RECV_BYTES):
                pass
            return False
        body = _answer_body(request.path, fault, judged, call_no, len(request.body))
        if fault is Fault.TRUNCATED:
            await self._send_partial(stream, conn, body, chunked=False)
            return False
        if fault is Fault.CUT_CHUNKED:
            await self._send_partial(stream, conn, body, chunked=True)
            return False
        if fault is Fault.TRICKLE:
            return await self._send_trickle(stream, conn, body)
        await self._send(stream, conn, 200, body)
        return True

    async def _send_partial(
        self, stream: trio.SocketStream, conn: h11.Connection, body: bytes, *, chunked: bool
    ) -> None:
        """Headers and the first half of ``body``, never the end of the message."""
        framing = (
            (b"transfer-encoding", b"chunked")
            if chunked
            else (b"content-length", str(len(body)).encode())
        )
        headers = [(b"content-type", b"application/json"), framing]
        data = conn.send(h11.Response(status_code=200, headers=headers))
        data += conn.send(h11.Data(data=body[: len(body) // 2]))
        await stream.send_all(data)

    async def _send_trickle(
        self, stream: trio.SocketStream, conn: h11.Connection, body: bytes
    ) -> bool:
        """Send ``body`` a few bytes per ``trickle_interval_s``; False if the client left first.

        A watcher notices the client leaving (its deadline fired) so the call, and its capacity
        slot, end at once rather than at the next failed send.
        """
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        client_gone = False

        async def watch_client(cancel_scope: trio.CancelScope) -> None:
            nonlocal client_gone
            try:
                # Bytes a keep-alive client sends meanwhile are kept for h11's next cycle.
                while data := await stream.receive_some(_RECV_BYTES):
                    conn.receive_data(data)
            except trio.BrokenResourceError:
                pass
            client_gone = True
            cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_client, nursery.cancel_scope)
            try:
                await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
                for start in range(0, len(body), _TRICKLE_PIECE_BYTES):
                    await trio.sleep(self.settings.trickle_interval_s)
                    piece = body[start : start + _TRICKLE_PIECE_BYTES]
                    await stream.send_all(conn.send(h11.Data(data=piece)))
                await stream.send_all(conn.send(h11.EndOfMessage()))
            except trio.BrokenResourceError:
                client_gone = True
            nursery.cancel_scope.cancel()
        return not client_gone


async def _open_listener(host: str, port: int) -> trio.SocketListener:
    """Bind exactly one socket (the first address ``host`` resolves to), so port 0 is one port."""
    infos = await trio.socket.getaddrinfo(
        host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    sock = trio.socket.socket(family, kind, proto)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await sock.bind(address)
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


def _base_url(listener: trio.SocketListener) -> str:
    bound_host, bound_port = listener.socket.getsockname()[:2]
    if ":" in bound_host:
        bound_host = f"[{bound_host}]"
    return f"http://{bound_host}:{bound_port}"


async def run_mock_judge(
    settings: MockJudgeSettings,
    *,
    state: MockJudgeState | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the mock judge until cancelled; report ``http://HOST:PORT`` (no ``/v1``) once bound.

    Use with ``base_url = await nursery.start(run_mock_judge, settings)``. Blocks forever; the
    caller's cancellation stops it and every connection task (hung calls included) with it.
    Without ``state`` a fresh :class:`MockJudgeState` is made from the settings; a given
    ``state`` keeps its own fault plan and random generator unless the settings name a plan
    (``fault`` not ``none`` or ``fault_rate > 0``): that plan and ``seed`` then replace them.
    Pass a state with ``functools.partial(run_mock_judge, settings, state=state)``.
    Raises ``OSError`` if binding fails (before ``started``). Per-connection errors (client
    gone, bad HTTP) end only that connection.
    """
    if state is None:
        state = MockJudgeState.from_settings(settings)
    elif settings.fault is not Fault.NONE or settings.fault_rate > 0:
        state.set_fault(settings.fault, settings.fault_count, rate=settings.fault_rate)
        state.rng.seed(settings.seed)
    server = _Server(settings, state)
    listener = await _open_listener(settings.host, settings.port)
    async with listener:
        task_status.started(_base_url(listener))
        await trio.serve_listeners(server.serve_connection, [listener])


# -- command line --------------------------------------------------------------------------


def _load_yaml_settings(path: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        problem = str(exc).replace("\n", " ")
        raise ConfigError("config", f"{path} is not valid YAML: {problem}") from exc
    if not isinstance(loaded, dict) or loaded.get("mock_judge") is None:
        return {}
    section = loaded["mock_judge"]
    if not isinstance(section, dict):
        raise ConfigError("mock_judge", "must be a mapping")
    return {str(k): v for k, v in section.items()}


def _parse_set(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(key or item, "--set needs KEY=VALUE")
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"value is not valid YAML: {raw!r}") from exc


def _settings_from_cli(
    *,
    host: str | None,
    port: int | None,
    config_path: str | None,
    overrides: tuple[str, ...],
    latency_ms: float | None,
    capacity: int | None,
    fault: str | None,
    fault_count: int | None,
) -> MockJudgeSettings:
    """File, then ``--set`` items, then the explicit flags, the later winning."""
    values = _load_yaml_settings(config_path) if config_path else {}
    for item in overrides:
        key, value = _parse_set(item)
        values[key] = value
    flags: dict[str, Any] = {
        "host": host,
        "port": port,
        "latency_s": None if latency_ms is None else latency_ms / 1000.0,
        "capacity": capacity,
        "fault": fault,
        "fault_count": fault_count,
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    return settings_from_mapping(values)


async def _serve_until_signal(settings: MockJudgeSettings) -> int:
    """Serve until SIGINT or SIGTERM; returns which one arrived."""
    received: int = signal.SIGTERM
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            base_url = await nursery.start(run_mock_judge, settings)
            print(f"genrm-trio mock-judge listening on {base_url}", flush=True)
            async for signum in signals:
                log.info("mock judge stopping on signal %d", signum)
                received = signum
                nursery.cancel_scope.cancel()
                break
    return received


def _fail(code: int, message: str) -> NoReturn:
    click.echo(f"genrm-trio mock-judge: {message}", err=True)
    sys.exit(code)


@click.command("mock-judge")
@click.option("--host", default=None, help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to bind; 0 = any free port.")
@click.option("--config", "config_path", default=None, help="YAML file; its mock_judge: mapping.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Any setting.")
@click.option("--latency-ms", type=float, default=None, help="Latency of every judge call.")
@click.option("--capacity", type=int, default=None, help="At most this many calls at once.")
@click.option("--fault", default=None, help="Fault: " + ", ".join(f.value for f in Fault) + ".")
@click.option("--fault-count", type=int, default=None, help="Fault only the first N calls.")
def mock_judge_cli(
    host: str | None,
    port: int | None,
    config_path: str | None,
    overrides: tuple[str, ...],
    latency_ms: float | None,
    capacity: int | None,
    fault: str | None,
    fault_count: int | None,
) -> None:
    """Run the fault-injecting mock GenRM judge until SIGTERM (exit 0) or Ctrl-C (exit 130).

    Prints one line, ``genrm-trio mock-judge listening on http://HOST:PORT``, once bound.
    Invalid settings: exit 2 with one line naming the key.
    """
    try:
        settings = _settings_from_cli(
            host=host,
            port=port,
            config_path=config_path,
            overrides=overrides,
            latency_ms=latency_ms,
            capacity=capacity,
            fault=fault,
            fault_count=fault_count,
        )
    except ConfigError as exc:
        _fail(2, str(exc))
    try:
        received = trio.run(_serve_until_signal, settings)
    except OSError as exc:
        _fail(1, f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}")
    if received == signal.SIGINT:
        from genrm_trio.cli import exit_interrupted

        exit_interrupted()


if __name__ == "__main__":
    mock_judge_cli()
