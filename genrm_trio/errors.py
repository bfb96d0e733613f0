"""The exception tree of genrm-trio.

::

    GenRMError                      base of everything we raise on purpose
    +-- ConfigError                 config.py: invalid configuration (one key, one problem)
    +-- WireError                   wire.py: a request body that cannot be accepted
    |   +-- BadRequest              400 bad_request: not JSON, not an object, wrong type ($.path)
    |   +-- TooLarge                413 too_large: body over max_request_bytes
    |   +-- TooManyValues           413 too_large: more JSON values than max_json_values (read
    |                               whole, so the connection stays usable)
    |   +-- UnsupportedMediaType    415 bad_request: a Content-Type that is not JSON
    |   +-- BadCoordinates          422 bad_coordinates: rollout index / attempt out of range
    +-- JudgeError                  server/judge/: one comparison could not be judged
    |   +-- TransientJudgeError     retryable: connection error, cut body, 408/429/5xx, bad answer
    |   +-- FatalJudgeError         not retryable: other 4xx, per-request deadline
    |   +-- JudgeFailed             the comparison failed for good (budget exhausted or fatal)
    +-- JudgeParseError             scoring.py: judge text has no usable verdict
    +-- ExportStartError            server/trace_export.py: the span export process cannot
                                    start (open_tracer turns it into a ConfigError)

Cohort outcomes (409/429/503 answers) are not exceptions: they are values
(:class:`genrm_trio.server.cohort.Failure`) handed to every waiter, so one
outcome object is shared by all the waiters of a cohort.
"""

from __future__ import annotations


class GenRMError(Exception):
    """Base class of every error genrm-trio raises on purpose."""


class ConfigError(GenRMError):
    """Invalid configuration: ``key`` names the offending key (dotted), ``problem`` says why."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"config key {key!r}: {problem}")


class WireError(GenRMError):
    """A request body that cannot be accepted; maps to one HTTP status and failure kind."""

    status: int = 400
    failure_kind: str = "bad_request"

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class BadRequest(WireError):
    status = 400
    failure_kind = "bad_request"


class TooLarge(WireError):
    status = 413
    failure_kind = "too_large"


class TooManyValues(WireError):
    """Not a :class:`TooLarge`: the body was read whole, so the connection is not closed."""

    status = 413
    failure_kind = "too_large"


class UnsupportedMediaType(WireError):
    status = 415
    failure_kind = "bad_request"


class BadCoordinates(WireError):
    status = 422
    failure_kind = "bad_coordinates"


class JudgeError(GenRMError):
    """One judge call or comparison went wrong; the message is safe to show (no secrets)."""


class TransientJudgeError(JudgeError):
    """Retryable within the comparison's budget. ``retry_after_s`` is the judge's hint, if any."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class FatalJudgeError(JudgeError):
    """Not retryable: the comparison fails at once."""


class JudgeFailed(JudgeError):
    """A comparison failed for good; the cohort is masked with this text. ``input_tokens`` and
    ``output_tokens``: what the judge reported spending on it before it failed (``cached_tokens``
    of the input found in its prefix cache)."""

    def __init__(self, message: str, input_tokens: int = 0, output_tokens: int = 0,
                 cached_tokens: int = 0) -> None:
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.cached_tokens = cached_tokens
        super().__init__(message)


class JudgeParseError(GenRMError):
    """The judge's answer text holds no usable verdict."""


class ExportStartError(GenRMError):
    """The span export process could not start, or did not say it was ready in time; the
    text says why, in one line."""
