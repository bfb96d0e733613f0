"""Log output: JSON lines for machines, ``key=value`` text for people, and rate-limited notes.

Pure: stdlib ``logging`` only, no trio. :func:`setup_logging` installs one stderr handler on the
root logger. ``log_format``:

- ``json``: one JSON object per line: ``ts`` (UTC, ISO 8601 with milliseconds), ``level``,
  ``logger``, ``msg``, then every field the call passed with ``extra={...}``, then ``exc`` (the
  traceback) when there is one;
- ``text``: ``HH:MM:SS LEVEL logger: msg key=value ...`` (values with spaces are quoted);
- ``auto`` (default): ``json`` when the stream is not a terminal (a file, a pipe, a container's
  log collector), ``text`` on a terminal.

Bounds: ``msg`` at most 2,000 characters, each extra field's value at most 500 (non-scalar values
are encoded as JSON first), at most 32 extra fields, a traceback at most 8,000 characters; longer
text is cut and ends with ``...``. Secrets: nothing here reads one, and an extra field whose name
says it holds one (a word ``token``, ``secret``, ``password``, ``authorization``, ``cookie``,
``credential``, or ``api_key`` / ``private_key`` / ``access_key`` in it) is written as ``"***"``,
so a careless ``extra=`` cannot leak it.

:class:`RateLimitedNote` turns a burst of similar events (client disconnects, 429s) into at most
one line per interval that says how many there were.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, TextIO

import msgspec

LogFormat = Literal["auto", "json", "text"]
LOG_FORMATS: tuple[str, ...] = ("auto", "json", "text")

MAX_MESSAGE_CHARS = 2000
MAX_FIELD_CHARS = 500
MAX_FIELDS = 32
MAX_TRACEBACK_CHARS = 8000

_SECRET_WORDS = frozenset({"apikey", "token", "secret", "password", "passwd", "authorization",
                           "cookie", "credential", "credentials"})
_SECRET_PHRASES = ("api_key", "private_key", "access_key")
# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName",
}
_ENCODER = msgspec.json.Encoder()


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_secret(name: str) -> bool:
    # "key" alone is not a secret here: cohort keys are what the disposition line is about.
    norm = name.lower().replace("-", "_")
    return bool(_SECRET_WORDS.intersection(norm.split("_"))) or any(
        p in norm for p in _SECRET_PHRASES)


def _scalar(value: Any) -> Any:
    """A bounded JSON scalar for one extra field."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, str):
        return _cut(value, MAX_FIELD_CHARS)
    try:
        text = _ENCODER.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        text = repr(value)
    return _cut(text, MAX_FIELD_CHARS)


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of a record, bounded and with secret-named fields masked."""
    fields: dict[str, Any] = {}
    for name, value in vars(record).items():
        if name in _RECORD_ATTRS or name.startswith("_"):
            continue
        if len(fields) >= MAX_FIELDS:
            break
        fields[_cut(name, 64)] = "***" if _is_secret(name) else _scalar(value)
    return fields


def _timestamp(created: float) -> str:
    whole = time.gmtime(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", whole) + f".{int(created % 1 * 1000):03d}Z"


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": _cut(record.getMessage(), MAX_MESSAGE_CHARS),
        }
        for name, value in record_fields(record).items():
            obj.setdefault(name, value)
        if record.exc_info:
            obj["exc"] = _cut(self.formatException(record.exc_info), MAX_TRACEBACK_CHARS)
        return _ENCODER.encode(obj).decode()


class KeyValueFormatter(logging.Formatter):
    """``HH:MM:SS LEVEL logger: msg key=value ...`` for a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        parts = [f"{clock} {record.levelname:<7} {record.name}: "
                 f"{_cut(record.getMessage(), MAX_MESSAGE_CHARS)}"]
        for name, value in record_fields(record).items():
            text = value if isinstance(value, str) else _ENCODER.encode(value).decode()
            if not text or any(c.isspace() or c in "\"=" for c in text):
                text = _ENCODER.encode(text).decode()
            parts.append(f"{name}={text}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + _cut(self.formatException(record.exc_info), MAX_TRACEBACK_CHARS)
        return line


def choose_format(log_format: str, stream: TextIO) -> Literal["json", "text"]:
    """``json`` or ``text``: ``auto`` means text on a terminal, JSON anywhere else."""
    if log_format == "json":
        return "json"
    if log_format == "text":
        return "text"
    isatty = getattr(stream, "isatty", None)
    return "text" if callable(isatty) and isatty() else "json"


def setup_logging(level: str, log_format: str = "auto", stream: TextIO | None = None) -> None:
    """Send every log record at ``level`` or above to ``stream`` (default stderr), formatted
    per ``log_format`` (``auto``, ``json`` or ``text``). Replaces the root logger's handlers,
    so calling it again switches the format. Never blocks beyond writing lines."""
    out = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        JsonLineFormatter() if choose_format(log_format, out) == "json" else KeyValueFormatter()
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


class RateLimitedNote:
    """At most one log line per ``interval_s`` for one kind of event, with a count.

    :meth:`note` counts an event; the first event after a quiet interval is logged at once with
    the number of events since the last line (including itself); the events in between are only
    counted and reported by that next line. Owned by one component (for example the app's
    ``/verify`` endpoint); not shared across processes. ``clock`` returns seconds (monotonic).
    """

    __slots__ = ("_logger", "_message", "_interval_s", "_clock", "_last", "_pending", "_level")

    def __init__(self, logger: logging.Logger, message: str, interval_s: float = 10.0, *,
                 level: int = logging.INFO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._message = message
        self._interval_s = interval_s
        self._clock = clock
        self._last = -float("inf")
        self._pending = 0
        self._level = level

    def note(self, fields: Mapping[str, Any] | None = None) -> bool:
        """Count one event; log a line if the interval has passed. Returns True if it logged.
        ``fields`` (bounded, secret-free) go into the line as extra fields of the last event."""
        self._pending += 1
        now = self._clock()
        if now - self._last < self._interval_s:
            return False
        count, self._pending = self._pending, 0
        since = now - self._last
        self._last = now
        extra: dict[str, Any] = {"event_count": count, **(fields or {})}
        if since != float("inf"):
            extra["interval_s"] = round(since, 3)
        self._logger.log(self._level, "%s (x%d)", self._message, count, extra=extra)
        return True


__all__ = [
    "LOG_FORMATS",
    "JsonLineFormatter",
    "KeyValueFormatter",
    "LogFormat",
    "RateLimitedNote",
    "choose_format",
    "record_fields",
    "setup_logging",
]
