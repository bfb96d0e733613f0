"""Endpoint choice: which judge URL an attempt goes to, and the cool-down of failing ones.

Calls go to the ready endpoint with the fewest calls in flight or waiting for it (ties: the
least used, so sequential calls spread out); a retry avoids the endpoint its comparison's last
attempt used whenever another is ready. An endpoint with ``judge.endpoint_failure_threshold``
consecutive failures is skipped for ``judge.endpoint_cooldown_s``; when every endpoint cools
down, the one whose cool-down started first is used.

``judge.max_concurrency_per_endpoint`` gives each endpoint a ``CapacityLimiter``: a call waits
for a slot here, on our side, before its per-request deadline starts, so a judge that serves
fewer calls at once than we could send does not time calls out in its own queue. State is plain
counters, touched only from trio tasks of the run that owns the judge.
"""

from __future__ import annotations

import logging
import math
import urllib.parse

import trio

from genrm_trio.config import Config

log = logging.getLogger(__name__)


def display_url(url: str) -> str:
    """The URL without user info, safe for logs, errors and ``/status``."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def endpoint_url(base_url: str, api: str) -> str:
    """The full URL of ``api`` (``responses`` or ``chat``) under a server root."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/responses" if api == "responses" else "/chat/completions")


class Endpoint:
    """One judge URL and its counters."""

    __slots__ = (
        "url",
        "display",
        "in_flight",
        "picks",
        "failures",
        "consecutive_failures",
        "cooling_until",
        "cooldown_started",
        "split_url",
        "limiter",
        "waiting",
        "input_tokens",
        "output_tokens",
    )

    def __init__(self, url: str, max_concurrency: int | None = None) -> None:
        self.url = url
        self.split_url = urllib.parse.urlsplit(url)
        self.display = display_url(url)
        self.in_flight = 0
        self.picks = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.cooling_until = -math.inf
        self.cooldown_started = -math.inf
        self.limiter = trio.CapacityLimiter(max_concurrency) if max_concurrency else None
        self.waiting = 0
        self.input_tokens = 0
        self.output_tokens = 0

    def cooling(self, now: float) -> bool:
        return now < self.cooling_until


class Endpoints:
    """The configured endpoints, the choice between them and their failure bookkeeping."""

    def __init__(self, cfg: Config, urls: list[str]) -> None:
        self._cfg = cfg
        limit = cfg.judge.max_concurrency_per_endpoint
        self.all = [Endpoint(u, limit) for u in urls]

    def choose(self, avoid: object | None = None) -> Endpoint:
        """The endpoint for the next attempt, not ``avoid`` when another is ready (never
        blocks)."""
        now = trio.current_time()
        ready = [e for e in self.all if not e.cooling(now)]
        if len(ready) > 1:
            ready = [e for e in ready if e is not avoid]
        if ready:
            # Least loaded; ties go to the least used so sequential calls spread out.
            return min(ready, key=lambda e: (e.in_flight + e.waiting, e.picks))
        return min(self.all, key=lambda e: e.cooldown_started)

    def record(self, endpoint: Endpoint, failed: bool) -> None:
        """Count one finished attempt of ``endpoint``; may start its cool-down."""
        if not failed:
            endpoint.consecutive_failures = 0
            return
        endpoint.failures += 1
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
