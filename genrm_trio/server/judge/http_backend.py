"""The HTTP backend: one attempt = body, endpoint choice, one POST under the per-request
deadline, and the answer's classification (verdict text, retryable, or fatal)."""

from __future__ import annotations

import ssl
import time
from typing import Any

import msgspec
import trio

from genrm_trio import judge_prompt
from genrm_trio.config import Config
from genrm_trio.server.judge.answers import (
    cached_of,
    chat_answer,
    engine_of,
    error_snippet,
    responses_answer,
    usage_of,
)
from genrm_trio.server.judge.attempt import (
    AttemptFailed,
    AttemptFatal,
    JudgeCallObserver,
    JudgeRequest,
    PairState,
    timeout_fatal,
)
from genrm_trio.server.judge.bodies import BodyBuilder
from genrm_trio.server.judge.endpoints import (
    Affinity,
    Endpoint,
    Endpoints,
    display_url,
    endpoint_url,
)
from genrm_trio.server.judge.h11_pool import H11Pool
from genrm_trio.server.judge.httpx_transport import HttpxBaseTransport, HttpxTransport
from genrm_trio.server.judge.retry_after import parse_retry_after
from genrm_trio.server.judge.transport import Answer, Transport


class HttpBackend:
    """Judge endpoints over HTTP: endpoint choice, transport, protocol, classification."""

    kind = "http"

    def __init__(
        self,
        cfg: Config,
        api_key: str | None,
        transport: HttpxBaseTransport | None,
        prompt: judge_prompt.PlainPrompt | None = None,
        observer: JudgeCallObserver | None = None,
    ) -> None:
        self._cfg = cfg
        self._observer = observer
        self._api = cfg.judge.api
        urls = [endpoint_url(u, self._api) for u in cfg.judge.base_urls]
        if api_key:
            # httpx turns URL user info into Basic auth, which would replace the bearer token.
            urls = [display_url(u) for u in urls]
        self._endpoints = Endpoints(cfg, urls)
        # One SSL context for every client: building one costs tens of ms of CPU each.
        ssl_context = ssl.create_default_context()
        headers = {"content-type": "application/json", "accept": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        # The lean pool, unless httpx2 is asked for (or a test hands in an httpx2 transport).
        self._transport: Transport
        if transport is None and cfg.judge.transport == "h11":
            self._transport = H11Pool(ssl_context, headers)
        else:
            self._transport = HttpxTransport(cfg, ssl_context, headers, transport)
        self._bodies = BodyBuilder(cfg, prompt)
        self._encoder = msgspec.json.Encoder()
        self._extract = responses_answer if self._api == "responses" else chat_answer

    async def aclose(self) -> None:
        """Close every connection. Blocks while connections close; the caller bounds it."""
        await self._transport.aclose()

    async def call(self, request: JudgeRequest, attempt: int, state: PairState) -> str:
        """One attempt: pick an endpoint (``judge.routing``; another than the comparison's last
        when one is ready), wait for a slot of its ``max_concurrency_per_endpoint`` (no deadline
        of ours yet: the enclosing evaluation deadline bounds the wait), then POST under
        ``judge_request_timeout_s`` and classify the answer."""
        content = self._encoder.encode(self._bodies.build(request, attempt))
        tokens = len(content) // 4  # the prompt tokens estimate routing counts (endpoints.py)
        if self._endpoints.affinity:
            affinity = getattr(state.group, "judge_affinity", None)
            lease = await self._endpoints.acquire(
                state.last_endpoint, affinity if isinstance(affinity, Affinity) else None,
                tokens, state.group, request.place, request.response_1)
            chosen = lease.endpoint
            state.last_endpoint = chosen
            state.span.endpoint(chosen.display)
            chosen.picks += 1
            computed = False
            input_before, cached_before = state.input_tokens, state.cached_tokens
            try:
                text = await self._call_endpoint(chosen, content, state)
                computed = True
                return text
            finally:
                self._endpoints.release(lease, computed, state.input_tokens - input_before,
                                        state.cached_tokens - cached_before)
        endpoint = self._endpoints.choose(state.last_endpoint)
        state.last_endpoint = endpoint
        state.span.endpoint(endpoint.display)
        endpoint.picks += 1
        endpoint.outstanding_tokens += tokens
        try:
            if endpoint.limiter is None:
                return await self._call_endpoint(endpoint, content, state)
            endpoint.waiting += 1
            try:
                await endpoint.limiter.acquire()
            finally:
                endpoint.waiting -= 1
            try:
                return await self._call_endpoint(endpoint, content, state)
            finally:
                endpoint.limiter.release()
        finally:
            endpoint.outstanding_tokens -= tokens

    async def _call_endpoint(self, endpoint: Endpoint, content: bytes, state: PairState) -> str:
        endpoint.in_flight += 1
        # None: the attempt was cancelled from outside, which says nothing about the endpoint.
        endpoint_failed: bool | None = None
        started = trio.current_time()
        ok = False
        try:
            timeout_s = self._cfg.judge_request_timeout_s
            try:
                with trio.move_on_after(timeout_s) as deadline:
                    answer = await self._transport.post(endpoint, content,
                                                        state.span.headers())
            except AttemptFailed:
                endpoint_failed = True
                raise
            except AttemptFatal:
                endpoint_failed = False
                raise
            if deadline.cancelled_caught:
                endpoint_failed = True
                raise timeout_fatal(timeout_s)
            endpoint_failed = answer.status >= 500
            text = self._classify(endpoint, answer, state)
            ok = True
            return text
        finally:
            endpoint.in_flight -= 1
            if endpoint_failed is not None:
                self._endpoints.record(endpoint, endpoint_failed)
                if self._observer is not None:
                    self._observer.judge_call(endpoint.display, ok,
                                              trio.current_time() - started)

    def _classify(self, endpoint: Endpoint, response: Answer, state: PairState) -> str:
        code = response.status
        if 200 <= code < 300:
            try:
                body = msgspec.json.decode(response.content)
            except msgspec.DecodeError as exc:
                raise AttemptFailed(
                    "unusable", f"judge {endpoint.display}: unusable answer: body is not JSON"
                ) from exc
            # Counted whatever the answer: a truncated one cost its tokens too.
            input_tokens, output_tokens = usage_of(body)
            cached_tokens, timed_prompt = cached_of(body)
            input_tokens = input_tokens or timed_prompt  # llama.cpp: timings without usage
            cached_tokens = min(cached_tokens, input_tokens) if input_tokens else cached_tokens
            state.add(input_tokens, output_tokens, cached_tokens)
            state.span.answer(body)
            endpoint.input_tokens += input_tokens
            endpoint.output_tokens += output_tokens
            endpoint.cached_tokens += cached_tokens
            endpoint.identify(engine_of(body))
            try:
                return self._extract(body)
            except AttemptFailed as exc:
                raise AttemptFailed(exc.reason, f"judge {endpoint.display}: {exc}") from None
        message = f"judge {endpoint.display}: HTTP {code}"
        snippet = error_snippet(response.content)
        if code in (408, 429) or code >= 500:
            retry_after = parse_retry_after(response.headers.get("retry-after"), time.time())
            raise AttemptFailed(f"http_{code}", f"{message}: {snippet}".rstrip(": "), retry_after)
        raise AttemptFatal(f"http_{code}", f"{message} (not retried): {snippet}".rstrip(": "))

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        return {
            "endpoints": [
                {
                    "url": e.display,
                    "in_flight": e.in_flight,
                    "failures": e.failures,
                    "consecutive_failures": e.consecutive_failures,
                    "cooling_down": e.cooling(now),
                    "clients": self._transport.clients(e),
                    "waiting": e.waiting,
                    "max_concurrency": e.limit,
                    "input_tokens": e.input_tokens,
                    "output_tokens": e.output_tokens,
                    "cached_tokens": e.cached_tokens,
                    "outstanding_tokens": e.outstanding_tokens,
                    "prefix_waits": self._endpoints.affinity and self._endpoints.prefix_waits(e),
                    "engine": e.engine,
                }
                for e in self._endpoints.all
            ],
            "routing": self._cfg.judge.routing,
        }
