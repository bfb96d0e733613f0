"""The collector's progress display: a live bar on a terminal, plain lines anywhere else.

The only ``tqdm`` user. Why tqdm rather than rich: the bar is the one thing needed (counts,
rate, ETA, a postfix for done / masked / failed / in flight), tqdm draws exactly that with no
dependencies of its own, and it renders to any text stream we hand it; rich would bring a
console layer, markdown and pygments for a single line.

:func:`show_progress` runs as a task in the collector's nursery and is cancelled when the run
ends; the bar is closed (its last state left on screen) in a ``finally``. Off a terminal it
prints :meth:`Progress.line`-style lines every ``interval_s``, which is what log collectors and
CI want. Log records emitted while the bar is drawn go through ``tqdm.write`` (the bar is
redrawn under them rather than torn).
"""

from __future__ import annotations

from typing import Any, Protocol, TextIO

import trio
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

REDRAW_S = 0.5


class ProgressCounts(Protocol):
    """What the display reads (the collector's ``Progress``)."""

    total_rollouts: int
    done: int
    masked: int
    failed: int
    in_flight: int
    retries: int

    @property
    def finished(self) -> int: ...

    def line(self, now: float) -> str: ...


class _Bar(tqdm):  # type: ignore[type-arg]
    # No monitor thread: the redraw task below is the only thing that touches the bar.
    monitor_interval = 0


def _postfix(progress: ProgressCounts) -> str:
    text = (f"done {progress.done} masked {progress.masked} failed {progress.failed} "
            f"in flight {progress.in_flight}")
    return text + (f" retries {progress.retries}" if progress.retries else "")


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(callable(isatty) and isatty())


async def show_progress(progress: ProgressCounts, stream: TextIO, interval_s: float) -> None:
    """Show ``progress`` on ``stream`` until cancelled. Never returns on its own."""
    if not _is_terminal(stream):
        while True:
            await trio.sleep(interval_s)
            stream.write(progress.line(trio.current_time()) + "\n")
            stream.flush()
    bar: Any = _Bar(total=progress.total_rollouts, file=stream, unit="rollout",
                    dynamic_ncols=True, mininterval=REDRAW_S, smoothing=0.1, desc="collect")
    try:
        with logging_redirect_tqdm(tqdm_class=_Bar):
            while True:
                bar.set_postfix_str(_postfix(progress), refresh=False)
                bar.update(progress.finished - bar.n)  # tqdm derives rate and ETA from these
                bar.refresh()
                await trio.sleep(REDRAW_S)
    finally:
        bar.set_postfix_str(_postfix(progress), refresh=False)
        bar.update(progress.finished - bar.n)
        bar.close()


__all__ = ["ProgressCounts", "show_progress"]
