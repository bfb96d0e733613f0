"""The mock policy: an OpenAI-compatible generation endpoint for tests, demos and benchmarks.

Routes: ``POST /v1/responses`` (a Responses object), ``POST /v1/chat/completions`` (a chat
completion), ``GET /v1/models``, ``GET /health``. Answers are varied but deterministic: the k-th
request for a given prompt (or a request carrying ``seed``) always gets the same text and the same
latency for a given ``MockPolicySettings.seed``. Latency follows ``latency_distribution``
(``fixed``, ``uniform`` or ``exponential``) around ``latency_mean_s``. Fault injection for tests:
the first ``fail_first_n`` generation requests are answered with ``fail_status``; with
``straggler_every`` K > 0, every K-th request for a prompt (the K-th, 2K-th, ...) waits
``straggler_delay_s`` more, so with K = N each group has one straggler (its last generation
request), the member a partial cohort is judged without (``incomplete_cohort_policy``).

The server is Hypercorn on Trio with a plain ASGI callable; :func:`run_mock_policy` owns it.
It lives on the caller side because ``genrm-trio collect`` embeds it when no policy URL is
given; its command line, ``genrm-trio mock-policy``, is :mod:`genrm_trio.mock.policy`.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from typing import Annotated, Any, Literal

import click
import hypercorn.config
import hypercorn.trio
import msgspec
import trio
import yaml

from genrm_trio.openai_shapes import chat_completion, output_message, responses_object

log = logging.getLogger(__name__)

_MAX_BODY_BYTES = 16 * 1024 * 1024
_MAX_TRACKED_PROMPTS = 100_000

_WORDS = (
    "answer result because therefore first second finally value check step total note "
    "consider example approach method reason simple careful detail clear correct solution "
    "compute derive assume verify summary however instead likewise overall precise"
).split()


class MockPolicySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the mock policy binds, answers and misbehaves. Durations in seconds."""

    host: str = "127.0.0.1"
    port: int = 0
    seed: int = 0
    model: str = "mock-policy"
    min_words: int = 8
    max_words: int = 48
    with_reasoning: bool = False
    latency_distribution: Literal["fixed", "uniform", "exponential"] = "fixed"
    latency_mean_s: float = 0.0
    latency_spread_s: float = 0.0
    fail_first_n: int = 0
    fail_status: int = 500
    straggler_every: Annotated[int, msgspec.Meta(ge=0)] = 0
    straggler_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class MockPolicyState:
    """Counters a test can read: every generation request, and per-prompt sequence numbers.

    Owned by whoever creates it; one per mock-policy instance. The per-prompt map is capped
    (oldest prompts forgotten first), so a long benchmark cannot grow it without bound.
    """

    def __init__(self) -> None:
        self.generation_requests = 0
        self.failed_requests = 0
        self._per_prompt: OrderedDict[str, int] = OrderedDict()

    def next_sequence(self, prompt_digest: str) -> int:
        """The number of earlier requests for this prompt; increments it."""
        k = self._per_prompt.pop(prompt_digest, 0)
        self._per_prompt[prompt_digest] = k + 1
        if len(self._per_prompt) > _MAX_TRACKED_PROMPTS:
            self._per_prompt.popitem(last=False)
        return k


def _prompt_digest(body: dict[str, Any]) -> str:
    prompt = body.get("input", body.get("messages"))
    return hashlib.sha256(msgspec.json.encode(prompt, order="sorted")).hexdigest()


def _rng(settings: MockPolicySettings, prompt_digest: str, variant: Any) -> random.Random:
    material = f"{settings.seed}\x00{prompt_digest}\x00{variant!r}".encode()
    return random.Random(int.from_bytes(hashlib.sha256(material).digest()[:8], "big"))


def _latency_s(settings: MockPolicySettings, rng: random.Random) -> float:
    mean = settings.latency_mean_s
    if settings.latency_distribution == "uniform":
        spread = settings.latency_spread_s
        return max(0.0, rng.uniform(mean - spread, mean + spread))
    if settings.latency_distribution == "exponential":
        return rng.expovariate(1.0 / mean) if mean > 0 else 0.0
    return max(0.0, mean)


def _answer_text(settings: MockPolicySettings, rng: random.Random) -> str:
    n = rng.randint(settings.min_words, max(settings.min_words, settings.max_words))
    words = [rng.choice(_WORDS) for _ in range(n)]
    text = " ".join(words).capitalize() + "."
    style = rng.random()
    if style < 0.2:
        text = f"**{words[0]}**: {text}"
    elif style < 0.35:
        text = "\n".join(f"- {w}" for w in words[: min(4, n)]) + "\n\n" + text
    return text


def _count_tokens(value: Any) -> int:
    return len(msgspec.json.encode(value).split()) if value is not None else 0


def _responses_object(
    settings: MockPolicySettings, body: dict[str, Any], text: str, rng: random.Random
) -> dict[str, Any]:
    ident = f"{rng.getrandbits(64):016x}"
    output: list[dict[str, Any]] = []
    reasoning_tokens = 0
    if settings.with_reasoning:
        thought = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24)))
        reasoning_tokens = len(thought.split())
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{ident}",
                "summary": [{"type": "summary_text", "text": thought}],
            }
        )
    output.append(output_message(f"msg_{ident}", text))
    input_tokens = _count_tokens(body.get("input"))
    output_tokens = len(text.split()) + reasoning_tokens
    return responses_object(
        ident=f"resp_{ident}", model=body.get("model") or settings.model, created_at=0,
        status="completed", output=output, input_tokens=input_tokens,
        output_tokens=output_tokens,
        output_tokens_details={"reasoning_tokens": reasoning_tokens},
    )


def _chat_object(
    settings: MockPolicySettings, body: dict[str, Any], text: str, rng: random.Random
) -> dict[str, Any]:
    return chat_completion(
        ident=f"chatcmpl-{rng.getrandbits(64):016x}", model=body.get("model") or settings.model,
        created=0, text=text, finish_reason="stop",
        prompt_tokens=_count_tokens(body.get("messages")),
        completion_tokens=len(text.split()),
    )


Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class MockPolicyApp:
    """The ASGI application. Request handlers own nothing beyond their own request."""

    def __init__(self, settings: MockPolicySettings, state: MockPolicyState) -> None:
        self.settings = settings
        self.state = state

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        status, payload = await self._handle(scope, receive)
        body = msgspec.json.encode(payload)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _handle(
        self, scope: MutableMapping[str, Any], receive: Receive
    ) -> tuple[int, Any]:
        method, path = scope["method"], scope["path"]
        if method == "GET" and path in ("/health", "/healthz"):
            return 200, {"status": "ok"}
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.settings.model, "object": "model"}]}
        if method != "POST" or path not in ("/v1/responses", "/v1/chat/completions"):
            return 404, {"error": {"message": f"no route {method} {path}"}}
        raw = bytearray()
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if len(raw) > _MAX_BODY_BYTES:
                return 413, {"error": {"message": "request body too large"}}
            if not message.get("more_body", False):
                break
        try:
            body = msgspec.json.decode(bytes(raw))
        except msgspec.DecodeError as exc:
            return 400, {"error": {"message": f"invalid JSON: {exc}"}}
        if not isinstance(body, dict):
            return 400, {"error": {"message": "body must be a JSON object"}}
        self.state.generation_requests += 1
        if self.state.generation_requests <= self.settings.fail_first_n:
            self.state.failed_requests += 1
            return self.settings.fail_status, {"error": {"message": "injected mock-policy failure"}}
        digest = _prompt_digest(body)
        variant: Any = body["seed"] if "seed" in body else self.state.next_sequence(digest)
        rng = _rng(self.settings, digest, variant)
        delay_s = _latency_s(self.settings, rng)
        every = self.settings.straggler_every
        if every and isinstance(variant, int) and (variant + 1) % every == 0:
            delay_s += self.settings.straggler_delay_s
        await trio.sleep(delay_s)
        text = _answer_text(self.settings, rng)
        if path == "/v1/responses":
            return 200, _responses_object(self.settings, body, text, rng)
        return 200, _chat_object(self.settings, body, text, rng)


async def run_mock_policy(
    settings: MockPolicySettings,
    *,
    state: MockPolicyState | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the mock policy until cancelled; report ``http://HOST:PORT`` through task_status.

    Blocks forever (use ``await nursery.start(run_mock_policy, settings)`` and cancel the
    nursery to stop it). Port 0 binds a free port; the reported URL has the real one. Raises
    OSError when the address cannot be bound. ``state`` (created when omitted) is only read and
    updated by the handlers.
    """
    config = hypercorn.config.Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger(f"{__name__}.hypercorn")
    config.graceful_timeout = 1.0
    app = MockPolicyApp(settings, state if state is not None else MockPolicyState())
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn.trio.serve, app, config, shutdown_trigger=trio.sleep_forever)  # type: ignore[arg-type]
        )
        task_status.started(binds[0])


def load_mock_policy_settings(
    config_path: str | None, overrides: tuple[str, ...], **flags: Any
) -> MockPolicySettings:
    """Settings from an optional YAML mapping, then ``KEY=VALUE`` overrides (YAML values), then
    explicit flags (None means not given). Raises click.BadParameter naming the bad key."""
    data: dict[str, Any] = {}
    if config_path is not None:
        with open(config_path, encoding="utf-8") as handle:
            loaded = yaml.safe_load(handle) or {}
        if not isinstance(loaded, dict):
            raise click.BadParameter(f"{config_path}: top level must be a mapping")
        data.update(loaded.get("mock_policy", loaded))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"--set {item!r}: expected KEY=VALUE")
        data[key.strip()] = yaml.safe_load(value)
    data.update({k: v for k, v in flags.items() if v is not None})
    try:
        return msgspec.convert(data, MockPolicySettings)
    except msgspec.ValidationError as exc:
        raise click.BadParameter(f"mock-policy settings: {exc}") from exc
