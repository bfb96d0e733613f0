"""The judge's ``Retry-After`` hint, as seconds to wait (RFC 9110, section 10.2.3).

The field is either ``delay-seconds`` (``1*DIGIT``: ASCII digits and nothing else, so ``1e3``,
``+5``, ``1_0``, ``-1`` and ``1.5`` are not hints) or an ``HTTP-date`` in one of its three forms
(section 5.6.7): IMF-fixdate ``Sun, 06 Nov 1994 08:49:37 GMT``, the obsolete RFC 850 form
``Sunday, 06-Nov-94 08:49:37 GMT`` and asctime ``Sun Nov  6 08:49:37 1994``. Anything else,
including a date that does not exist or lies outside what a datetime holds, is no hint (None):
a malformed header must never fail a call that would otherwise be retried.
"""

from __future__ import annotations

import datetime
import re

#: Longest hint we represent: far beyond any deadline, so it always counts as "too long".
MAX_HINT_S = 1e12

_DIGITS = re.compile(r"[0-9]+")
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_LONG_DAY = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"
_MONTH = r"(?P<month>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_TIME = r"(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2}):(?P<second>[0-9]{2})"
_IMF_FIXDATE = re.compile(
    rf"{_DAY}, (?P<day>[0-9]{{2}}) {_MONTH} (?P<year>[0-9]{{4}}) {_TIME} GMT"
)
_RFC850 = re.compile(
    rf"{_LONG_DAY}, (?P<day>[0-9]{{2}})-{_MONTH}-(?P<year>[0-9]{{2}}) {_TIME} GMT"
)
_ASCTIME = re.compile(
    rf"{_DAY} {_MONTH} (?P<day>[ 0-9][0-9]) {_TIME} (?P<year>[0-9]{{4}})"
)


def parse_http_date(text: str, now_epoch_s: float) -> float | None:
    """The instant (epoch seconds) of an RFC 9110 HTTP-date, or None if ``text`` is not one."""
    for pattern in (_IMF_FIXDATE, _RFC850, _ASCTIME):
        match = pattern.fullmatch(text)
        if match is not None:
            break
    else:
        return None
    year = int(match["year"])
    if pattern is _RFC850:
        # Two-digit year: the most recent year with those digits that is not more than 50
        # years in the future (RFC 9110, 5.6.7).
        this_year = datetime.datetime.fromtimestamp(now_epoch_s, datetime.UTC).year
        year += this_year - this_year % 100
        if year > this_year + 50:
            year -= 100
    try:
        when = datetime.datetime(
            year, _MONTHS.index(match["month"].lower()) + 1, int(match["day"].strip()),
            int(match["hour"]), int(match["minute"]), int(match["second"]),
            tzinfo=datetime.UTC,
        )
        return when.timestamp()
    except (ValueError, OverflowError):  # 31 Feb, hour 25, a year datetime cannot hold
        return None


def parse_retry_after(value: str | None, now_epoch_s: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` field value, else None.

    Surrounding whitespace is allowed (it is not part of a field value). A date in the past
    means 0. Hints are capped at :data:`MAX_HINT_S`. Never raises, never blocks.
    """
    if value is None:
        return None
    text = value.strip(" \t")
    if _DIGITS.fullmatch(text):
        if len(text) > 13:  # more digits than MAX_HINT_S has; int() of thousands is slow
            return MAX_HINT_S
        return min(float(int(text)), MAX_HINT_S)
    when = parse_http_date(text, now_epoch_s)
    if when is None:
        return None
    return min(max(0.0, when - now_epoch_s), MAX_HINT_S)
