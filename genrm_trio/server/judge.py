"""The judge client: one comparison in, one :class:`~genrm_trio.scoring.Verdict` out.

The only module of genrm-trio that imports ``httpx2``. Layers, top down::

    Judge.judge_pair(request)        retry budget, backoff, parsing, default verdict, stats
        |  per attempt: global CapacityLimiter(judge_max_concurrency)
        v
    _Backend.call(request) -> text   one attempt under the per-request trio deadline
        +-- _HttpBackend             endpoint choice + cool-down, sharded httpx2 clients,
        |                            responses or chat protocol, error classification
        +-- _PluginBackend           "module:function", trio-native or asyncio via _aio
        +-- _BuiltinBackend          scoring.heuristic_judge_text, no network

A backend attempt either returns the answer text or raises :class:`AttemptFailed`
(transient: retried within the budget) or :class:`AttemptFatal` (not retried). Third-party
errors (``httpx2``, plugin exceptions) are translated into those two at the backend boundary.
Every message that leaves this module passes through one redaction step that removes the api
key, and URLs are shown without user info.
"""

from __future__ import annotations

import datetime
import email.utils
import importlib
import inspect
import logging
import math
import os
import random
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import h11
import httpx2
import msgspec
import trio

from genrm_trio import scoring
from genrm_trio.config import Config
from genrm_trio.errors import (
    ConfigError,
    FatalJudgeError,
    JudgeFailed,
    JudgeParseError,
    TransientJudgeError,
)
from genrm_trio.server import _aio

log = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 300
_BODY_SNIPPET_CHARS = 120

PluginFn = Callable[[dict[str, Any]], Awaitable[Any]]


class JudgeRequest(msgspec.Struct, frozen=True):
    """One comparison: the conversation, the two final answers, and the request's principle."""

    history: list[dict[str, str]]
    response_1: str
    response_2: str
    principle: str | None = None


@dataclass(slots=True)
class JudgeStats:
    """Plain counters for ``/metrics``, owned by one :class:`Judge` (monotonic, never reset).

    ``failures_by_reason`` counts failed *attempts* by reason (``http_503``, ``transport``,
    ``timeout``, ``unusable``, ``parse``, ``plugin``, ...); ``comparisons_failed`` counts
    comparisons that ended in :class:`~genrm_trio.errors.JudgeFailed`.
    """

    comparisons: int = 0
    calls: int = 0
    retries: int = 0
    transient_errors: int = 0
    unusable_answers: int = 0
    parse_failures: int = 0
    defaulted_comparisons: int = 0
    comparisons_failed: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    latency_seconds_sum: float = 0.0
    backoff_seconds_sum: float = 0.0


class AttemptFailed(TransientJudgeError):
    """One attempt failed in a retryable way; ``reason`` is a short metrics label."""

    def __init__(self, reason: str, message: str, retry_after_s: float | None = None) -> None:
        self.reason = reason
        super().__init__(message, retry_after_s)


class AttemptFatal(FatalJudgeError):
    """One attempt failed in a way that ends the comparison at once."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


# ---------------------------------------------------------------------------------------------
# Pure helpers: request bodies, answer extraction, Retry-After.


def _resolved_principle(cfg: Config, request: JudgeRequest) -> str | None:
    if not cfg.use_principle:
        return None
    return request.principle or cfg.default_principle


def base_params(cfg: Config) -> dict[str, Any]:
    """The create params every judge request starts from: the configured ones plus the model."""
    params = dict(cfg.genrm_responses_create_params)
    if cfg.judge.model:
        params["model"] = cfg.judge.model
    return params


def responses_body(cfg: Config, params: Mapping[str, Any], request: JudgeRequest) -> dict[str, Any]:
    """JSON body of ``POST /v1/responses`` (NeMo Gym ``genrm_model`` shape)."""
    metadata = {"response_1": request.response_1, "response_2": request.response_2}
    principle = _resolved_principle(cfg, request)
    if principle is not None:
        metadata["principle"] = principle
    body = dict(params)
    body["input"] = [
        {"role": m.get("role", "user"), "content": m.get("content", ""), "type": "message"}
        for m in request.history
    ]
    body["metadata"] = metadata
    return body


def chat_body(cfg: Config, params: Mapping[str, Any], request: JudgeRequest) -> dict[str, Any]:
    """JSON body of ``POST /v1/chat/completions`` for a GenRM chat template."""
    messages = [
        {"role": m.get("role", "user"), "content": m.get("content", "")} for m in request.history
    ]
    principle = _resolved_principle(cfg, request)
    if principle is not None:
        messages.append({"role": "principle", "content": principle})
    messages.append({"role": "response_1", "content": request.response_1})
    messages.append({"role": "response_2", "content": request.response_2})
    body = dict(params)
    if "max_output_tokens" in body:
        body["max_tokens"] = body.pop("max_output_tokens")
    body["messages"] = messages
    return body


def responses_answer(body: Any) -> str:
    """Answer text of a Responses API body; raises :class:`AttemptFailed` when unusable."""
    if not isinstance(body, dict):
        raise AttemptFailed("unusable", "unusable answer: body is not a JSON object")
    status = body.get("status")
    if status is not None and status != "completed":
        raise AttemptFailed("unusable", f"unusable answer: status {str(status)[:40]!r}")
    parts: list[str] = []
    output = body.get("output")
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        content = item.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "output_text":
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
    return _non_blank("".join(parts))


def chat_answer(body: Any) -> str:
    """Answer text of a chat completions body; raises :class:`AttemptFailed` when unusable."""
    if not isinstance(body, dict):
        raise AttemptFailed("unusable", "unusable answer: body is not a JSON object")
    status = body.get("status")
    if status is not None and status != "completed":
        raise AttemptFailed("unusable", f"unusable answer: status {str(status)[:40]!r}")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise AttemptFailed("unusable", "unusable answer: no choices")
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        content = "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return _non_blank(content if isinstance(content, str) else "")


def _non_blank(text: str) -> str:
    if not text.strip():
        raise AttemptFailed("unusable", "unusable answer: blank answer text")
    return text


def parse_retry_after(value: str | None, now_epoch_s: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delay-seconds or HTTP date), else None."""
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - now_epoch_s)


def _display_url(url: str) -> str:
    """The URL without user info, safe for logs, errors and ``/status``."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def _endpoint_url(base_url: str, api: str) -> str:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/responses" if api == "responses" else "/chat/completions")


def _timeout_fatal(timeout_s: float) -> AttemptFatal:
    return AttemptFatal("timeout", f"judge request timed out after {timeout_s} s")


# ---------------------------------------------------------------------------------------------
# Backends: one attempt each.


class _Backend(Protocol):
    kind: str

    async def call(self, request: JudgeRequest) -> str:
        """One attempt, deadline included. Raises AttemptFailed / AttemptFatal."""
        ...

    def status(self) -> dict[str, Any]: ...


class _StaleConnection(Exception):
    """A reused keep-alive connection was closed by the peer before any answer byte."""


class _H11Connection:
    __slots__ = ("stream", "h11")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def exchange(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
        reused: bool,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        conn = self.h11
        received = False
        try:
            await self.stream.send_all(
                conn.send(h11.Request(method=method, target=target, headers=headers))
                + conn.send(h11.Data(data=body))
                + conn.send(h11.EndOfMessage())
            )
        except (trio.BrokenResourceError, OSError):
            if reused:  # the peer closed this idle connection; nothing reached the judge
                raise _StaleConnection from None
            raise
        status = 0
        answer_headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.stream.receive_some(65536)
                if not data and reused and not received:
                    # Closed while idle (its keep-alive ran out). A reset here is not retried
                    # this way: the judge may have received the request.
                    raise _StaleConnection
                received = received or bool(data)
                conn.receive_data(cast(bytes, data))
            elif isinstance(event, h11.Response):
                status = event.status_code
                answer_headers = list(event.headers)
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return status, answer_headers, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("connection closed before the answer ended")

    @property
    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE


class _Answer:
    """A judge's HTTP answer, whichever transport fetched it: status, lower-case headers, body."""

    __slots__ = ("status", "headers", "content")

    def __init__(self, status: int, headers: Mapping[str, str], content: bytes) -> None:
        self.status = status
        self.headers = headers
        self.content = content


class H11Pool:
    """A lean HTTP/1.1 keep-alive client for the judge's one-shot JSON POSTs (trio + h11).

    Why, next to httpx2: under trio, httpcore's pool and httpx's request/response layers cost
    about 0.6 ms of CPU per judge call; this costs about 0.2 ms (bench preset ``judge_client``).
    Idle connections sit on a stack per origin (O(1) check out and in); each answer is read
    whole. It speaks only what the judge needs: HTTP/1.1, ``Content-Length`` or chunked answers,
    no compression, no proxies, TLS through the one shared SSL context. Concurrency is bounded by
    the judge's limiter. A reused connection the peer had already closed is retried once on a
    fresh one (nothing reached the judge); other failures raise :class:`AttemptFailed` like the
    httpx2 path does. Cancellation closes the connection in use. ``judge.transport: httpx``
    selects the httpx2 client instead.
    """

    def __init__(self, ssl_context: ssl.SSLContext, max_idle_per_origin: int = 1024) -> None:
        self._ssl = ssl_context
        self._max_idle = max_idle_per_origin
        self._idle: dict[tuple[str, str, int], list[_H11Connection]] = {}

    async def _connect(self, scheme: str, host: str, port: int,
                       display: str) -> _H11Connection:
        try:
            stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
            if scheme == "https":
                tls = trio.SSLStream(stream, self._ssl, server_hostname=host)
                await tls.do_handshake()
                stream = tls
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            raise AttemptFailed(
                "transport", f"judge {display}: ConnectError: {exc or type(exc).__name__}"
            ) from exc
        return _H11Connection(stream)

    async def post(self, url: urllib.parse.SplitResult, headers: list[tuple[bytes, bytes]],
                   body: bytes, display: str) -> _Answer:
        """POST ``body`` to ``url``; blocks until the whole answer is read (the caller's trio
        deadline bounds it)."""
        scheme = url.scheme
        host = url.hostname or ""
        port = url.port or (443 if scheme == "https" else 80)
        origin = (scheme, host, port)
        target = (url.path or "/").encode() + (b"?" + url.query.encode() if url.query else b"")
        request_headers = [(b"host", url.netloc.rpartition("@")[2].encode()),
                           (b"content-length", str(len(body)).encode()), *headers]
        idle = self._idle.setdefault(origin, [])
        while True:
            reused = bool(idle)
            conn = idle.pop() if idle else await self._connect(scheme, host, port, display)
            try:
                status, answer_headers, content = await conn.exchange(
                    b"POST", target, request_headers, body, reused
                )
            except _StaleConnection:
                await trio.aclose_forcefully(conn.stream)
                continue
            except BaseException as exc:
                await trio.aclose_forcefully(conn.stream)
                if isinstance(exc, h11.ProtocolError):
                    raise AttemptFailed(
                        "transport",
                        f"judge {display}: RemoteProtocolError: {exc or 'malformed answer'}",
                    ) from exc
                if isinstance(exc, (OSError, trio.BrokenResourceError, ssl.SSLError)):
                    raise AttemptFailed(
                        "transport", f"judge {display}: ReadError: {exc or type(exc).__name__}"
                    ) from exc
                raise
            if conn.reusable and len(idle) < self._max_idle:
                conn.h11.start_next_cycle()
                idle.append(conn)
            else:
                await trio.aclose_forcefully(conn.stream)
            return _Answer(
                status, {k.decode("latin-1"): v.decode("latin-1") for k, v in answer_headers},
                content,
            )

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await trio.aclose_forcefully(conn.stream)


class _Shard:
    __slots__ = ("client", "in_flight")

    def __init__(self, client: httpx2.AsyncClient) -> None:
        self.client = client
        self.in_flight = 0


class _Endpoint:
    __slots__ = (
        "url",
        "display",
        "shards",
        "in_flight",
        "picks",
        "consecutive_failures",
        "cooling_until",
        "cooldown_started",
        "split_url",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        self.split_url = urllib.parse.urlsplit(url)
        self.display = _display_url(url)
        self.shards: list[_Shard] = []
        self.in_flight = 0
        self.picks = 0
        self.consecutive_failures = 0
        self.cooling_until = -math.inf
        self.cooldown_started = -math.inf

    def cooling(self, now: float) -> bool:
        return now < self.cooling_until


class _HttpBackend:
    """Judge endpoints over HTTP: endpoint choice, client shards, protocol, classification."""

    kind = "http"

    def __init__(
        self,
        cfg: Config,
        api_key: str | None,
        transport: httpx2.AsyncBaseTransport | None,
    ) -> None:
        self._cfg = cfg
        self._api = cfg.judge.api
        self._transport = transport
        urls = [_endpoint_url(u, self._api) for u in cfg.judge.base_urls]
        if api_key:
            # httpx turns URL user info into Basic auth, which would replace the bearer token.
            urls = [_display_url(u) for u in urls]
        self._endpoints = [_Endpoint(u) for u in urls]
        self._per_client = max(1, cfg.judge.max_connections_per_client)
        self._max_shards = max(1, math.ceil(max(1, cfg.judge_max_concurrency) / self._per_client))
        # One SSL context for every client: building one costs tens of ms of CPU each.
        self._ssl = ssl.create_default_context()
        # The lean pool, unless httpx2 is asked for (or a test hands in an httpx2 transport).
        self._h11 = (
            H11Pool(self._ssl) if transport is None and cfg.judge.transport == "h11" else None
        )
        self._params = base_params(cfg)
        self._encoder = msgspec.json.Encoder()
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._raw_headers = [(k.encode(), v.encode()) for k, v in self._headers.items()]
        self._build = responses_body if self._api == "responses" else chat_body
        self._extract = responses_answer if self._api == "responses" else chat_answer

    async def aclose(self) -> None:
        """Close every client shard. Blocks while connections close; the caller bounds it."""
        for endpoint in self._endpoints:
            shards, endpoint.shards = endpoint.shards, []
            for shard in shards:
                await shard.client.aclose()
        if self._h11 is not None:
            await self._h11.aclose()

    def _choose_endpoint(self) -> _Endpoint:
        now = trio.current_time()
        ready = [e for e in self._endpoints if not e.cooling(now)]
        if ready:
            # Fewest in flight; ties go to the least used so sequential calls spread out.
            return min(ready, key=lambda e: (e.in_flight, e.picks))
        return min(self._endpoints, key=lambda e: e.cooldown_started)

    def _choose_shard(self, endpoint: _Endpoint) -> _Shard:
        best = min(endpoint.shards, key=lambda s: s.in_flight, default=None)
        if best is not None and (
            best.in_flight < self._per_client or len(endpoint.shards) >= self._max_shards
        ):
            return best
        client = httpx2.AsyncClient(
            verify=self._ssl,
            transport=self._transport,
            limits=httpx2.Limits(
                max_connections=self._per_client, max_keepalive_connections=self._per_client
            ),
            # The per-request trio deadline rules; httpx timeouts apply per read only.
            timeout=httpx2.Timeout(None),
            trust_env=False,
        )
        shard = _Shard(client)
        endpoint.shards.append(shard)
        return shard

    def _record(self, endpoint: _Endpoint, failed: bool) -> None:
        if not failed:
            endpoint.consecutive_failures = 0
            return
        endpoint.consecutive_failures += 1
        threshold = self._cfg.judge.endpoint_failure_threshold
        if threshold > 0 and endpoint.consecutive_failures >= threshold:
            now = trio.current_time()
            was_cooling = endpoint.cooling_until > now
            endpoint.cooldown_started = now
            endpoint.cooling_until = now + self._cfg.judge.endpoint_cooldown_s
            if was_cooling:  # its other calls were still in flight: one line per cool-down
                return
            log.warning(
                "judge endpoint %s cooling down for %s s after %d consecutive failures",
                endpoint.display,
                self._cfg.judge.endpoint_cooldown_s,
                endpoint.consecutive_failures,
            )

    async def call(self, request: JudgeRequest) -> str:
        content = self._encoder.encode(self._build(self._cfg, self._params, request))
        endpoint = self._choose_endpoint()
        endpoint.picks += 1
        endpoint.in_flight += 1
        # None: the attempt was cancelled from outside, which says nothing about the endpoint.
        endpoint_failed: bool | None = None
        try:
            timeout_s = self._cfg.judge_request_timeout_s
            try:
                with trio.move_on_after(timeout_s) as deadline:
                    answer = await self._post(endpoint, content)
            except AttemptFailed:
                endpoint_failed = True
                raise
            except AttemptFatal:
                endpoint_failed = False
                raise
            if deadline.cancelled_caught:
                endpoint_failed = True
                raise _timeout_fatal(timeout_s)
            endpoint_failed = answer.status >= 500
            return self._classify(endpoint, answer)
        finally:
            endpoint.in_flight -= 1
            if endpoint_failed is not None:
                self._record(endpoint, endpoint_failed)

    async def _post(self, endpoint: _Endpoint, content: bytes) -> _Answer:
        if self._h11 is not None:
            return await self._h11.post(endpoint.split_url, self._raw_headers, content,
                                        endpoint.display)
        shard = self._choose_shard(endpoint)
        shard.in_flight += 1
        try:
            response = await shard.client.post(endpoint.url, content=content,
                                               headers=self._headers)
        except (httpx2.UnsupportedProtocol, httpx2.InvalidURL) as exc:
            raise AttemptFatal("config", f"judge {endpoint.display}: {exc}") from exc
        except (httpx2.RequestError, httpx2.StreamError) as exc:
            detail = str(exc) or type(exc).__name__
            raise AttemptFailed(
                "transport", f"judge {endpoint.display}: {type(exc).__name__}: {detail}"
            ) from exc
        finally:
            shard.in_flight -= 1
        return _Answer(response.status_code, response.headers, response.content)

    def _classify(self, endpoint: _Endpoint, response: _Answer) -> str:
        code = response.status
        if 200 <= code < 300:
            try:
                body = msgspec.json.decode(response.content)
            except msgspec.DecodeError as exc:
                raise AttemptFailed(
                    "unusable", f"judge {endpoint.display}: unusable answer: body is not JSON"
                ) from exc
            try:
                return self._extract(body)
            except AttemptFailed as exc:
                raise AttemptFailed(exc.reason, f"judge {endpoint.display}: {exc}") from None
        message = f"judge {endpoint.display}: HTTP {code}"
        if code in (408, 429) or code >= 500:
            retry_after = parse_retry_after(response.headers.get("retry-after"), time.time())
            raise AttemptFailed(f"http_{code}", message, retry_after)
        snippet = response.content[: _BODY_SNIPPET_CHARS * 4].decode("utf-8", "replace")
        snippet = snippet[:_BODY_SNIPPET_CHARS].strip()
        raise AttemptFatal(f"http_{code}", f"{message} (not retried): {snippet}".rstrip(": "))

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        return {
            "endpoints": [
                {
                    "url": e.display,
                    "in_flight": e.in_flight,
                    "consecutive_failures": e.consecutive_failures,
                    "cooling_down": e.cooling(now),
                    "clients": len(e.shards),
                }
                for e in self._endpoints
            ]
        }


class _PluginBackend:
    """A user's async callable, trio-flavoured or run on a trio-asyncio loop."""

    kind = "plugin"

    def __init__(self, cfg: Config, fn: PluginFn, bridge: _aio.AsyncioBridge | None) -> None:
        self._cfg = cfg
        self._fn = fn
        self._bridge = bridge
        self._params = base_params(cfg)

    async def call(self, request: JudgeRequest) -> str:
        payload: dict[str, Any] = {
            "history": [dict(m) for m in request.history],
            "response_1": request.response_1,
            "response_2": request.response_2,
            "principle": _resolved_principle(self._cfg, request),
            "params": dict(self._params),
        }
        timeout_s = self._cfg.judge_request_timeout_s
        with trio.move_on_after(timeout_s) as deadline:
            try:
                if self._bridge is not None:
                    answer = await self._bridge.call(self._fn, payload)
                else:
                    answer = await self._fn(payload)
            except Exception as exc:
                # The plugin is a task boundary: any error it raises is one failed attempt.
                detail = str(exc)[:_MAX_ERROR_CHARS] or type(exc).__name__
                raise AttemptFailed(
                    "plugin", f"judge plugin raised {type(exc).__name__}: {detail}"
                ) from exc
        if deadline.cancelled_caught:
            raise _timeout_fatal(timeout_s)
        if not isinstance(answer, str):
            raise AttemptFailed(
                "unusable", f"judge plugin returned {type(answer).__name__}, not str"
            )
        return _non_blank(answer)

    def status(self) -> dict[str, Any]:
        return {
            "plugin": self._cfg.judge.plugin,
            "plugin_flavor": self._cfg.judge.plugin_flavor,
            "endpoints": [],
        }


class _BuiltinBackend:
    """The heuristic judge: deterministic, no network; rewards are synthetic."""

    kind = "builtin"

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg

    async def call(self, request: JudgeRequest) -> str:
        await trio.lowlevel.checkpoint()
        return scoring.heuristic_judge_text(
            request.history,
            request.response_1,
            request.response_2,
            _resolved_principle(self._cfg, request),
        )

    def status(self) -> dict[str, Any]:
        return {"endpoints": []}


def load_plugin(spec: str) -> PluginFn:
    """Import ``module:function`` (attribute path may be dotted); raises ConfigError."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError("judge.plugin", f"{spec!r} is not of the form 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            "judge.plugin", f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for name in attr_path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError as exc:
            raise ConfigError("judge.plugin", f"{spec!r}: no attribute {name!r}") from exc
    is_async = inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(
        getattr(obj, "__call__", None)  # noqa: B004 - async callable objects are fine
    )
    if not callable(obj) or not is_async:
        raise ConfigError("judge.plugin", f"{spec!r} is not an async function")
    fn: PluginFn = obj
    return fn


# ---------------------------------------------------------------------------------------------
# The public face.


class Judge:
    """Judges comparisons with a bounded retry budget. Obtain one from :func:`open_judge`.

    Safe to share between any number of trio tasks of the run that opened it.
    """

    def __init__(self, cfg: Config, backend: _Backend, api_key: str | None, rng: random.Random):
        self._cfg = cfg
        self._backend = backend
        self._api_key = api_key
        self._rng = rng
        self._limiter = trio.CapacityLimiter(max(1, cfg.judge_max_concurrency))
        self.stats = JudgeStats()

    @property
    def kind(self) -> str:
        """``http``, ``plugin`` or ``builtin``."""
        return self._backend.kind

    async def judge_pair(self, request: JudgeRequest) -> scoring.Verdict:
        """Judge one comparison, using its whole retry budget.

        Blocks until a verdict or a final failure. Each attempt holds one token of the global
        limiter (not while backing off) and runs under ``judge_request_timeout_s``. Backoff
        sleeps are ``trio.sleep``, so an outer deadline cuts them. An outer cancellation raises
        ``trio.Cancelled`` at once and aborts the attempt in flight.

        Returns the parsed verdict, or the default verdict when the budget ran out and some
        attempt did give a usable (but unparseable) answer. Raises
        :class:`~genrm_trio.errors.JudgeFailed` (short text, no api key) on a non-retryable
        error, a per-request timeout, or an exhausted budget without any usable answer.
        """
        cfg = self._cfg
        stats = self.stats
        attempts = max(1, cfg.genrm_parse_retries + 1)
        stats.comparisons += 1
        usable_seen = False
        last_error = "no attempt made"
        retry_after: float | None = None
        for k in range(attempts):
            if k:
                stats.retries += 1
                delay = self._backoff_s(k - 1, retry_after)
                stats.backoff_seconds_sum += delay
                await trio.sleep(delay)
            retry_after = None
            try:
                text = await self._attempt(request)
            except AttemptFatal as exc:
                self._count(exc.reason)
                stats.comparisons_failed += 1
                raise JudgeFailed(self._safe(str(exc))) from None
            except AttemptFailed as exc:
                self._count(exc.reason)
                stats.transient_errors += 1
                if exc.reason == "unusable":
                    stats.unusable_answers += 1
                last_error = str(exc)
                retry_after = exc.retry_after_s
                continue
            usable_seen = True
            try:
                return scoring.parse_judge_output(text, cfg.default_score, cfg.default_ranking)
            except JudgeParseError as exc:
                self._count("parse")
                stats.parse_failures += 1
                last_error = f"unparseable answer: {exc}"
        if usable_seen:
            stats.defaulted_comparisons += 1
            log.warning(
                "judge answers unparseable after %d attempts; default verdict used (%s)",
                attempts,
                self._safe(last_error),
            )
            return scoring.Verdict(cfg.default_score, cfg.default_score, cfg.default_ranking)
        stats.comparisons_failed += 1
        raise JudgeFailed(
            self._safe(f"no completed answer after {attempts} attempts: {last_error}")
        )

    async def _attempt(self, request: JudgeRequest) -> str:
        async with self._limiter:
            self.stats.calls += 1
            started = trio.current_time()
            try:
                return await self._backend.call(request)
            finally:
                self.stats.latency_seconds_sum += trio.current_time() - started

    def _backoff_s(self, k: int, retry_after_s: float | None) -> float:
        """Full jitter: uniform(0, min(cap, base * 2**k)), and at least the judge's hint."""
        cap = self._cfg.judge_retry_backoff_max_s
        high = min(cap, self._cfg.genrm_parse_retry_sleep_s * 2.0 ** min(k, 64))
        delay = self._rng.uniform(0.0, high) if high > 0 else 0.0
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return delay

    def _count(self, reason: str) -> None:
        reasons = self.stats.failures_by_reason
        reasons[reason] = reasons.get(reason, 0) + 1

    def _safe(self, text: str) -> str:
        if self._api_key:
            text = text.replace(self._api_key, "***")
        if len(text) > _MAX_ERROR_CHARS:
            text = text[: _MAX_ERROR_CHARS - 3] + "..."
        return text

    def status(self) -> dict[str, Any]:
        """Snapshot for ``GET /status``: backend kind, api, endpoints, limiter. No secrets."""
        snapshot: dict[str, Any] = {
            "kind": self._backend.kind,
            "api": self._cfg.judge.api if self._backend.kind == "http" else None,
            "limiter": {
                "in_use": self._limiter.borrowed_tokens,
                "total": int(self._limiter.total_tokens),
            },
        }
        snapshot.update(self._backend.status())
        return snapshot


def _read_api_key(cfg: Config) -> str | None:
    env = cfg.judge.api_key_env
    if not env:
        return None
    key = os.environ.get(env)
    if not key:
        raise ConfigError("judge.api_key_env", f"environment variable {env!r} is not set")
    return key


@asynccontextmanager
async def open_judge(
    cfg: Config,
    *,
    transport: httpx2.AsyncBaseTransport | None = None,
    rng: random.Random | None = None,
) -> AsyncIterator[Judge]:
    """Open the configured judge for the lifetime of the block.

    Backend: ``judge.plugin`` set -> the plugin (asyncio ones on a trio-asyncio loop owned
    here); else ``judge.base_urls`` non-empty -> HTTP; else the built-in heuristic judge (a
    warning is logged: rewards are synthetic). The api key is read from the environment once,
    here. ``transport`` (tests) replaces the network for every client shard.

    Raises :class:`~genrm_trio.errors.ConfigError` for a plugin that cannot be loaded or a
    missing api key variable. On exit the HTTP clients are closed under a shielded scope
    bounded by ``shutdown_grace_s``; judge calls must have ended by then.
    """
    api_key = _read_api_key(cfg)
    chosen_rng = rng if rng is not None else random.Random()
    async with AsyncExitStack() as stack:
        backend: _Backend
        if cfg.judge.plugin:
            fn = load_plugin(cfg.judge.plugin)
            bridge = None
            if cfg.judge.plugin_flavor == "asyncio":
                bridge = await stack.enter_async_context(_aio.open_asyncio_bridge())
            backend = _PluginBackend(cfg, fn, bridge)
            log.info("judge: plugin %s (%s)", cfg.judge.plugin, cfg.judge.plugin_flavor)
        elif cfg.judge.base_urls:
            http = _HttpBackend(cfg, api_key, transport)
            stack.push_async_callback(_close_shielded, http, cfg.shutdown_grace_s)
            backend = http
            log.info(
                "judge: %s API at %s",
                cfg.judge.api,
                ", ".join(_display_url(u) for u in cfg.judge.base_urls),
            )
        else:
            backend = _BuiltinBackend(cfg)
            log.warning(
                "judge: no judge configured, using the built-in heuristic judge: "
                "rewards are synthetic"
            )
        yield Judge(cfg, backend, api_key, chosen_rng)


async def _close_shielded(http: _HttpBackend, grace_s: float) -> None:
    with trio.move_on_after(grace_s, shield=True):
        await http.aclose()
