"""The judge's ``Retry-After`` hint, as seconds to wait."""

from __future__ import annotations

import datetime
import email.utils
import math


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
