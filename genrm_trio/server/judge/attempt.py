"""What one judge attempt takes and what it can raise: the request and the two attempt errors.

Every other file of the judge package speaks in these terms: a backend attempt either returns
the answer text or raises :class:`AttemptFailed` (transient: retried within the comparison's
budget) or :class:`AttemptFatal` (the comparison ends at once).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from genrm_trio.errors import FatalJudgeError, TransientJudgeError
from genrm_trio.server.tracing import NO_JUDGE_SPAN, JudgeSpan

#: Longest error text that leaves the judge (failure reasons, logs).
MAX_ERROR_CHARS = 600


class JudgeRequest(msgspec.Struct, frozen=True):
    """One comparison: the conversation, the two final answers, the request's principle, and
    which of ``num_judges_per_comparison`` passes this is (it varies the sampling seed).
    ``place``: its position in its cohort's issue order (prefix order); never part of what is
    judged, it only orders the cohort's waiting calls."""

    history: list[dict[str, str]]
    response_1: str
    response_2: str
    principle: str | None = None
    judge_idx: int = 0
    place: int = 0


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


class JudgeCallObserver(Protocol):
    """Told of every finished attempt (server/prometheus.py's ServerMetrics is one).
    ``endpoint``: the endpoint's display URL (no user info), or ``plugin`` / ``builtin``."""

    def judge_call(self, endpoint: str, ok: bool, seconds: float) -> None: ...


class PairState:
    """What the attempts of one comparison share: the token tally (the backend adds what each
    answer's ``usage`` reports, cached prompt tokens included), where the last attempt went
    (``last_endpoint``, so a retry can prefer another), the comparison's group (``group``: its
    cohort, for ``cohort_affinity`` routing; None for ``/compare``), the comparison's span
    (``span``, server/tracing.py) and the label of the last failed attempt. Owned by the retry
    loop of that comparison."""

    __slots__ = ("input_tokens", "output_tokens", "cached_tokens", "last_endpoint", "group",
                 "span", "last_reason")

    def __init__(self, group: object | None = None) -> None:
        self.input_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0
        self.last_endpoint: object | None = None
        self.group = group
        self.span: JudgeSpan = NO_JUDGE_SPAN
        self.last_reason: str | None = None

    def add(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> None:
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cached_tokens += cached_tokens


def timeout_fatal(timeout_s: float) -> AttemptFatal:
    """The error of an attempt that ran out of ``judge_request_timeout_s``."""
    return AttemptFatal("timeout", f"judge request timed out after {timeout_s} s")
