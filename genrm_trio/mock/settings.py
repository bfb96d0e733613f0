"""The mock judge's settings (validated, from YAML or ``--set``) and its live state: counters and
the fault plan, which decides the fault of each call (:meth:`MockJudgeState.next_fault`)."""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import trio

from genrm_trio.errors import ConfigError
from genrm_trio.mock.faults import RANDOM_MIX, Fault
from genrm_trio.mock.http import JUDGE_PATHS
from genrm_trio.mock.prefix_cache import MAX_PREFIX_CACHE_TOKENS, PREFIX_CACHE_SIZES

#: Bounds of the prefix-cache model's settings (and :data:`MAX_PREFIX_CACHE_TOKENS`).
MAX_TOKEN_S = 1.0
MAX_STEP_TOKENS = 2**20


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

    The engine model (:mod:`genrm_trio.mock.prefix_cache`): ``prefix_cache_tokens`` (0: off,
    at most 2**30; ``small`` and ``large`` name 16,384 and 1,048,576) is the capacity of the
    prefix cache in tokens. Each call spends ``prompt_token_s`` per computed (not cached)
    prompt token, then its blocks enter the cache, then ``output_token_s`` per output token
    (both in [0, 1]), on top of ``latency_s``, inside the capacity limit. ``cache_report``:
    how the answer reports cached tokens: ``usage`` (OpenAI and vLLM:
    ``usage.prompt_tokens_details.cached_tokens`` in chat,
    ``usage.input_tokens_details.cached_tokens`` in responses), ``timings`` (llama.cpp's
    server: ``timings.cache_n`` cached and ``timings.prompt_n`` computed), ``both``, or
    ``none`` (a server that reports nothing).

    ``engine``: ``per_call`` times each call on its own (the above: calls never slow each
    other); ``batched`` runs every call of this mock judge through one engine with continuous
    batching (:mod:`genrm_trio.mock.engine`: a step costs ``output_token_s`` plus
    ``prompt_token_s`` per prompt token computed in it, at most ``engine_step_tokens`` tokens a
    step, in 1..2**20; the batch holds ``capacity`` calls), after ``latency_s``.
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
    prefix_cache_tokens: int = 0
    prompt_token_s: float = 0.0
    output_token_s: float = 0.0
    cache_report: Literal["usage", "timings", "both", "none"] = "usage"
    engine: Literal["per_call", "batched"] = "per_call"
    engine_step_tokens: int = 8192

    def __post_init__(self) -> None:
        if not 1 <= self.engine_step_tokens <= MAX_STEP_TOKENS:
            raise ConfigError("engine_step_tokens",
                              f"must be in 1..{MAX_STEP_TOKENS}, got {self.engine_step_tokens!r}")
        if not 0 <= self.prefix_cache_tokens <= MAX_PREFIX_CACHE_TOKENS:
            raise ConfigError("prefix_cache_tokens",
                              f"must be in 0..{MAX_PREFIX_CACHE_TOKENS} (or small, large, off), "
                              f"got {self.prefix_cache_tokens!r}")
        for key in ("prompt_token_s", "output_token_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and 0 <= value <= MAX_TOKEN_S):
                raise ConfigError(key, f"must be in [0, {MAX_TOKEN_S:g}], got {value!r}")
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
    size = fixed.get("prefix_cache_tokens")
    if isinstance(size, str) and size in PREFIX_CACHE_SIZES:
        fixed["prefix_cache_tokens"] = PREFIX_CACHE_SIZES[size]
    try:
        return msgspec.convert(fixed, MockJudgeSettings)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _VALIDATION_PATH.search(message)
        key = match.group(1) if match else "mock_judge"
        raise ConfigError(key, _VALIDATION_PATH.sub("", message)) from exc


TRACEPARENTS_KEPT = 4096
PROMPTS_REMEMBERED = 200_000
"""Distinct judge prompts a mock remembers to count repeats (about 100 bytes each in memory)."""


class MockJudgeState:
    """Counters and the live fault plan of one mock judge; owned by whoever runs the server.

    Plain synchronous object: tests create it, hand it to :func:`run_mock_judge`, then read the
    counters or change the fault plan between calls. ``calls`` counts every judge request
    received (admin and health requests are not counted); ``in_flight`` are calls being served
    inside the capacity limit, ``queued`` those waiting for it; ``busy_s`` sums the seconds
    calls spent inside the capacity limit (busy time, for utilisation); ``connections`` counts
    accepted connections. ``prompt_tokens`` and ``cached_tokens`` sum what answered calls
    were charged and found in the prefix cache (``computed_tokens``: the difference).
    ``traceparents``: the W3C ``traceparent`` header (None when absent)
    of the last :data:`TRACEPARENTS_KEPT` judge calls, oldest first. ``repeated_calls`` counts
    the judge calls answered without a fault whose prompt (the rendered conversation: one
    comparison) this mock had already answered so, over the first :data:`PROMPTS_REMEMBERED`
    distinct prompts (``distinct_prompts``); the rolling-restart bench reads it as
    "comparisons judged twice".
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
        self.calls_by_path: dict[str, int] = dict.fromkeys(JUDGE_PATHS, 0)
        self.faults_injected: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.busy_s = 0.0
        self.queued = 0
        self.connections = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.traceparents: deque[str | None] = deque(maxlen=TRACEPARENTS_KEPT)
        self._prompts: set[bytes] = set()
        self.repeated_calls = 0
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
        self.calls_by_path = dict.fromkeys(JUDGE_PATHS, 0)
        self.faults_injected = {}
        self.max_in_flight = self.in_flight
        self.busy_s = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.traceparents.clear()
        self._prompts.clear()
        self.repeated_calls = 0
        self.set_fault(Fault.NONE, None)

    def note_prompt(self, prompt: bytes) -> None:
        """Count a judge call's prompt: a repeat when this mock judged the same prompt before
        (remembered as a 16-byte digest, at most :data:`PROMPTS_REMEMBERED` of them)."""
        digest = hashlib.blake2b(prompt, digest_size=16).digest()
        if digest in self._prompts:
            self.repeated_calls += 1
        elif len(self._prompts) < PROMPTS_REMEMBERED:
            self._prompts.add(digest)

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
            fault = self.fault if self.fault is not Fault.NONE else self.rng.choice(RANDOM_MIX)
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
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.prompt_tokens - self.cached_tokens,
            "output_tokens": self.output_tokens,
            "distinct_prompts": len(self._prompts),
            "repeated_calls": self.repeated_calls,
            "fault": self.fault.value,
            "fault_remaining": self.fault_remaining,
            "fault_rate": self.fault_rate,
        }
