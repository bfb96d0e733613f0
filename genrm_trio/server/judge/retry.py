"""The retry loop: :class:`Judge` (one comparison with its whole budget) and :func:`open_judge`.

Per attempt the loop takes one token of the global limiter (``judge_max_concurrency`` tokens,
handed out in ``judge_order``: order.py) and calls the backend; between attempts it backs off
(full jitter, at least the judge's ``Retry-After``). Every message that leaves the judge passes
through :meth:`Judge._safe`, which removes the api key and bounds the length.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from genrm_trio import judge_prompt, scoring
from genrm_trio.config import Config, read_prompt_template
from genrm_trio.errors import ConfigError, JudgeFailed, JudgeParseError
from genrm_trio.server import _aio
from genrm_trio.server.judge.attempt import (
    MAX_ERROR_CHARS,
    AttemptFailed,
    AttemptFatal,
    JudgeCallObserver,
    JudgeRequest,
    PairState,
)
from genrm_trio.server.judge.backends import Backend, BuiltinBackend, PluginBackend, load_plugin
from genrm_trio.server.judge.endpoints import display_url
from genrm_trio.server.judge.http_backend import HttpBackend
from genrm_trio.server.judge.httpx_transport import HttpxBaseTransport
from genrm_trio.server.judge.order import GroupProgress, OrderedLimiter
from genrm_trio.server.tracing import NO_COHORT_TRACE, JudgeParent

log = logging.getLogger(__name__)

# "Bearer abc", "api_key=abc", "api-key: abc", "token": "abc" ... (the value is replaced).
_SECRET_SHAPES = re.compile(
    r"""((?:bearer\s+|(?:api[_-]?key|token|secret|password)["']?\s*[=:]\s*["']?))[^\s"',;]+""",
    re.IGNORECASE,
)

#: How long closing the judge's connections may take at exit (seconds).
CLOSE_BOUND_S = 0.5


@dataclass(slots=True)
class JudgeStats:
    """Plain counters for ``/metrics``, owned by one :class:`Judge` (monotonic, never reset).

    ``failures_by_reason`` counts failed *attempts* by reason (``http_503``, ``transport``,
    ``timeout``, ``unusable``, ``truncated``, ``parse``, ``plugin``, ...);
    ``truncated_answers`` counts answers cut by the output budget; ``comparisons_failed`` counts
    comparisons that ended in :class:`~genrm_trio.errors.JudgeFailed`; ``input_tokens`` and
    ``output_tokens`` sum the ``usage`` the judge reported, ``cached_tokens`` the prompt tokens
    it reported found in its prefix cache (per endpoint: ``Judge.status()``).
    """

    comparisons: int = 0
    calls: int = 0
    retries: int = 0
    transient_errors: int = 0
    unusable_answers: int = 0
    truncated_answers: int = 0
    parse_failures: int = 0
    defaulted_comparisons: int = 0
    comparisons_failed: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    latency_seconds_sum: float = 0.0
    backoff_seconds_sum: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


class Judge:
    """Judges comparisons with a bounded retry budget. Obtain one from :func:`open_judge`.

    Safe to share between any number of trio tasks of the run that opened it.
    """

    def __init__(self, cfg: Config, backend: Backend, api_key: str | None, rng: random.Random,
                 observer: JudgeCallObserver | None = None):
        self._cfg = cfg
        # The HTTP backend reports its own attempts (it knows the endpoint); others here.
        self._observer = observer if backend.kind != "http" else None
        self._backend = backend
        self._api_key = api_key
        self._rng = rng
        self._limiter = OrderedLimiter(max(1, cfg.judge_max_concurrency), cfg.judge_order)
        self.stats = JudgeStats()

    @property
    def kind(self) -> str:
        """``http``, ``plugin`` or ``builtin``."""
        return self._backend.kind

    async def judge_pair(self, request: JudgeRequest, group: GroupProgress | None = None,
                         trace: JudgeParent = NO_COHORT_TRACE) -> scoring.Verdict:
        """Judge one comparison, using its whole retry budget.

        Blocks until a verdict or a final failure. Each attempt holds one token of the global
        limiter (not while backing off; when tokens are short they go in ``judge_order``, by
        ``group``, see order.py) and runs under ``judge_request_timeout_s``. Backoff
        sleeps are ``trio.sleep``, so an outer deadline cuts them. An outer cancellation raises
        ``trio.Cancelled`` at once and aborts the attempt in flight.

        Returns the parsed verdict, or the default verdict (``defaulted`` set) when the budget
        ran out and some attempt did give a usable (but unparseable) answer (with
        ``unparseable_verdict_policy: mask`` that is a failure instead); either carries the
        tokens the judge reported for all attempts. The comparison's span (server/tracing.py)
        is started from ``trace`` (its cohort's span, or a ``/compare`` request's) and ended
        here, whatever the outcome. Raises
        :class:`~genrm_trio.errors.JudgeFailed` (short text, no api key, the tokens spent) on a
        non-retryable error, a per-request timeout, a Retry-After beyond the enclosing
        deadline, or an exhausted budget without any usable answer.
        """
        state = PairState(group)
        state.span = span = trace.judge_call(request.judge_idx)
        outcome, error_type = "cancelled", None
        try:
            verdict = await self._judge(request, state, group)
            outcome = "default" if verdict.defaulted else "verdict"
        except JudgeFailed as exc:
            outcome, error_type = "failed", state.last_reason
            raise JudgeFailed(str(exc), state.input_tokens, state.output_tokens,
                              state.cached_tokens) from None
        finally:
            self.stats.input_tokens += state.input_tokens
            self.stats.output_tokens += state.output_tokens
            self.stats.cached_tokens += state.cached_tokens
            span.end(outcome, error_type, state.input_tokens, state.output_tokens)
        return msgspec.structs.replace(
            verdict, input_tokens=state.input_tokens, output_tokens=state.output_tokens,
            cached_tokens=state.cached_tokens)

    async def _judge(self, request: JudgeRequest, state: PairState,
                     group: GroupProgress | None) -> scoring.Verdict:
        cfg = self._cfg
        stats = self.stats
        attempts = max(1, cfg.genrm_parse_retries + 1)
        stats.comparisons += 1
        usable_seen = False
        last_error = "no attempt made"
        truncated = 0
        retry_after: float | None = None
        for k in range(attempts):
            if k:
                if retry_after is not None:
                    self._check_hint(retry_after, last_error)
                stats.retries += 1
                delay = self._backoff_s(k - 1, retry_after)
                state.span.backoff(k, delay)
                await trio.sleep(delay)
                stats.backoff_seconds_sum += delay  # completed waits only
            retry_after = None
            try:
                text = await self._attempt(request, k, state, group)
            except AttemptFatal as exc:
                self._count(exc.reason)
                state.last_reason = exc.reason
                stats.comparisons_failed += 1
                raise JudgeFailed(self._safe(str(exc))) from None
            except AttemptFailed as exc:
                self._count(exc.reason)
                state.last_reason = exc.reason
                stats.transient_errors += 1
                if exc.reason == "unusable":
                    stats.unusable_answers += 1
                elif exc.reason == "truncated":
                    stats.truncated_answers += 1
                    truncated += 1
                last_error = str(exc)
                retry_after = exc.retry_after_s
                continue
            usable_seen = True
            try:
                return scoring.parse_judge_output(text, cfg.default_score, cfg.default_ranking)
            except JudgeParseError as exc:
                self._count("parse")
                state.last_reason = "parse"
                state.span.attempt(k, "parse", 0.0)
                stats.parse_failures += 1
                last_error = f"unparseable answer: {exc}"
        if usable_seen and cfg.unparseable_verdict_policy == "mask":
            stats.comparisons_failed += 1
            raise JudgeFailed(self._safe(
                f"no parseable verdict after {attempts} attempts "
                f"(unparseable_verdict_policy: mask): {last_error}"
            ))
        if usable_seen:
            stats.defaulted_comparisons += 1
            log.warning(
                "judge answers unparseable after %d attempts; default verdict used (%s)",
                attempts,
                self._safe(last_error),
            )
            return scoring.Verdict(cfg.default_score, cfg.default_score, cfg.default_ranking,
                                   defaulted=True)
        stats.comparisons_failed += 1
        if truncated:
            key, value = self._budget_key()
            if truncated == attempts:
                raise JudgeFailed(self._safe(
                    f"judge output budget exhausted: all {attempts} attempts were cut by the "
                    f"token limit ({key} = {value}); raise {key}"
                ))
            raise JudgeFailed(self._safe(
                f"no completed answer after {attempts} attempts ({truncated} cut by the token "
                f"limit: raise {key}, now {value}): {last_error}"
            ))
        raise JudgeFailed(
            self._safe(f"no completed answer after {attempts} attempts: {last_error}")
        )

    def _budget_key(self) -> tuple[str, object]:
        """The config key that bounds the judge's output, and its value."""
        params = self._cfg.genrm_responses_create_params
        for name in ("max_output_tokens", "max_tokens", "max_completion_tokens"):
            if name in params:
                return f"genrm_responses_create_params.{name}", params[name]
        return "genrm_responses_create_params.max_output_tokens", "the server's default"

    async def _attempt(self, request: JudgeRequest, attempt: int, state: PairState,
                       group: GroupProgress | None) -> str:
        async with self._limiter.slot(group, request.place):
            self.stats.calls += 1
            started = trio.current_time()
            ok = False
            reason = "cancelled"
            try:
                text = await self._backend.call(request, attempt, state)
                ok = True
                return text
            except (AttemptFailed, AttemptFatal) as exc:
                reason = exc.reason
                raise
            finally:
                elapsed = trio.current_time() - started
                state.span.attempt(attempt, None if ok else reason, elapsed)
                self.stats.latency_seconds_sum += elapsed
                if self._observer is not None:
                    self._observer.judge_call(self._backend.kind, ok, elapsed)

    def _check_hint(self, retry_after_s: float, last_error: str) -> None:
        """Fail the comparison now if the judge's Retry-After outlasts the enclosing deadline
        (the cohort's evaluation deadline, a cancel scope around this call): sleeping it out
        would only end in "deadline exceeded" and hide the cause."""
        left = trio.current_effective_deadline() - trio.current_time()
        if retry_after_s > left:
            self.stats.comparisons_failed += 1
            raise JudgeFailed(self._safe(
                f"judge asked to wait {retry_after_s:g} s before retrying (Retry-After), "
                f"longer than the {left:.1f} s left of the evaluation deadline; "
                f"last error: {last_error}"
            ))

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
        """``text`` fit to leave the judge: no api key (nor anything shaped like a bearer
        token or a key assignment, which a judge may echo back), bounded length."""
        if self._api_key:
            text = text.replace(self._api_key, "***")
        text = _SECRET_SHAPES.sub(lambda m: m.group(1) + "***", text)
        if len(text) > MAX_ERROR_CHARS:
            text = text[: MAX_ERROR_CHARS - 3] + "..."
        return text

    def status(self) -> dict[str, Any]:
        """Snapshot for ``GET /status``: backend kind, api, endpoints, limiter. No secrets."""
        snapshot: dict[str, Any] = {
            "kind": self._backend.kind,
            "api": self._cfg.judge.api if self._backend.kind == "http" else None,
            "limiter": {
                "in_use": self._limiter.borrowed_tokens,
                "total": self._limiter.total_tokens,
                "waiting": self._limiter.waiting,
                "order": self._cfg.judge_order,
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
    transport: HttpxBaseTransport | None = None,
    rng: random.Random | None = None,
    observer: JudgeCallObserver | None = None,
) -> AsyncIterator[Judge]:
    """Open the configured judge for the lifetime of the block.

    Backend: ``judge.plugin`` set -> the plugin (asyncio ones on a trio-asyncio loop owned
    here); else ``judge.base_urls`` non-empty -> HTTP; else the built-in heuristic judge (a
    warning is logged: rewards are synthetic). The api key is read from the environment once,
    here. ``transport`` (tests: an ``httpx2`` transport) replaces the network for every client.
    ``observer`` is told of every finished attempt (endpoint, ok, seconds).

    Raises :class:`~genrm_trio.errors.ConfigError` for a plugin that cannot be loaded or a
    missing api key variable. On exit the HTTP clients are closed under a shielded scope
    bounded by :data:`CLOSE_BOUND_S` (a constant, not another ``shutdown_grace_s``: shutdown
    has already spent its grace); judge calls must have ended by then.
    """
    api_key = _read_api_key(cfg)
    chosen_rng = rng if rng is not None else random.Random()
    async with AsyncExitStack() as stack:
        backend: Backend
        if cfg.judge.plugin:
            fn = load_plugin(cfg.judge.plugin)
            bridge = None
            if cfg.judge.plugin_flavor == "asyncio":
                bridge = await stack.enter_async_context(_aio.open_asyncio_bridge())
            backend = PluginBackend(cfg, fn, bridge)
            log.info("judge: plugin %s (%s)", cfg.judge.plugin, cfg.judge.plugin_flavor)
        elif cfg.judge.base_urls:
            prompt = None
            if cfg.judge.prompt == "plain":
                prompt = (read_prompt_template(cfg.judge.prompt_template_file)
                          if cfg.judge.prompt_template_file else judge_prompt.DEFAULT_PROMPT)
            http = HttpBackend(cfg, api_key, transport, prompt, observer)
            stack.push_async_callback(_close_shielded, http)
            backend = http
            log.info(
                "judge: %s API at %s",
                cfg.judge.api,
                ", ".join(display_url(u) for u in cfg.judge.base_urls),
            )
        else:
            backend = BuiltinBackend(cfg)
            log.warning(
                "judge: no judge configured, using the built-in heuristic judge: "
                "rewards are synthetic"
            )
        yield Judge(cfg, backend, api_key, chosen_rng, observer)


async def _close_shielded(http: HttpBackend) -> None:
    with trio.move_on_after(CLOSE_BOUND_S, shield=True) as scope:
        await http.aclose()
    if scope.cancelled_caught:
        log.warning("judge: closing HTTP connections took over %g s; left to the OS",
                    CLOSE_BOUND_S)
