"""The process's memory as ``/status`` shows it, and the opt-in diagnostic that finds what grows.

Three views, from the outside in:

- **RSS** (``/proc/self/statm``): what the kernel charges the process.
- **The allocator** (glibc's ``mallinfo2`` through ctypes; ``None`` on another libc):
  ``heap_bytes`` obtained from the OS by malloc's arenas, ``in_use_bytes`` of it handed out,
  ``free_bytes`` held free inside them (fragmentation), ``mmapped_bytes`` of large blocks mapped
  one by one, ``top_pad_bytes`` releasable at the top of the main heap. Python objects up to
  512 bytes live in pymalloc's own 1 MiB arenas, mapped apart from malloc:
  ``python_blocks`` (``sys.getallocatedblocks()``) counts what they hold.
- **tracemalloc** (only when the process started with ``PYTHONTRACEMALLOC=FRAMES``, the
  standard variable): :class:`TraceGrowth` compares snapshots by traceback and lists the top
  growers (``GET /debug/memory``). Off by default: tracing costs several times the CPU of an
  allocation, so nothing on the hot path ever touches it.

The only module that uses ctypes. Nothing here is module-level state: :class:`Allocator` and
:class:`TraceGrowth` belong to a :class:`ProcessMemory`, owned by ``serve`` (or by the app
when there is no ``serve``, as in tests).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import trio

_PAGE = os.sysconf("SC_PAGE_SIZE")

#: Frames of tracemalloc's own bookkeeping and of the import system: never what grows.
_IGNORED = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``); 0 where there is no procfs."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

MMAP_THRESHOLD_BYTES = 65536
"""The default ``malloc_mmap_threshold_bytes``: blocks this large or larger are mapped one by
one (:meth:`Allocator.set_mmap_threshold`, set by :meth:`ProcessMemory.open` unless the
environment sets glibc's own ``MALLOC_MMAP_THRESHOLD_``) and given back to the OS when freed.
glibc starts at 128 KiB but raises its threshold to the size of each mapped block freed (up to
32 MiB), so after the first large body or answer every later one came from the heap, whose
freed pages stay resident until a trim; and a large body arrives as 64 KiB reads, each copied
twice on its way through Hypercorn and h11, which left the heap fragmented. With 100 slow
readers of 8 MB answers (the bench's ``slow_readers`` preset): glibc's own threshold, RSS
peak 476-506 MB, 257-293 MB after the load with 13 MB in use; 1 MiB: 373-391 MB peak, 45-62
MB of it free inside the heap; 64 KiB: 328 MB, under 12 MB free, 67 MB after. An ordinary
request's body and answer (kilobytes) never reach it."""


class Allocator:
    """glibc's malloc, seen and trimmed through ctypes. :meth:`open` returns None where the C
    library is not glibc (>= 2.33 for ``mallinfo2``)."""

    mmap_threshold_bytes: int | None = None  # once set_mmap_threshold has set it

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._mallinfo2 = libc.mallinfo2
        self._mallinfo2.restype = _MallInfo2
        self._mallinfo2.argtypes = []
        self._malloc_trim = libc.malloc_trim
        self._malloc_trim.restype = ctypes.c_int
        self._malloc_trim.argtypes = [ctypes.c_size_t]
        self._mallopt = libc.mallopt
        self._mallopt.restype = ctypes.c_int
        self._mallopt.argtypes = [ctypes.c_int, ctypes.c_int]

    @classmethod
    def open(cls) -> Allocator | None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        try:
            libc = ctypes.CDLL(name)
            libc.mallinfo2  # noqa: B018 - probe: glibc >= 2.33 only
            libc.malloc_trim  # noqa: B018
            libc.mallopt  # noqa: B018
        except (OSError, AttributeError):
            return None
        return cls(libc)

    def stats(self) -> dict[str, int]:
        """malloc's view, in bytes (see the module docstring). Walks every arena's free lists
        under its lock: microseconds, not for the hot path."""
        info = self._mallinfo2()
        return {
            "heap_bytes": int(info.arena),
            "in_use_bytes": int(info.uordblks),
            "free_bytes": int(info.fordblks),
            "mmapped_bytes": int(info.hblkhd),
            "mmapped_blocks": int(info.hblks),
            "free_chunks": int(info.ordblks),
            "top_pad_bytes": int(info.keepcost),
        }

    def set_mmap_threshold(self, size: int) -> bool:
        """``mallopt(M_MMAP_THRESHOLD, size)``: every block of ``size`` bytes or more gets a
        mapping of its own, given back to the OS when it is freed, and glibc's sliding
        threshold is off. True if glibc took it."""
        taken = bool(self._mallopt(_M_MMAP_THRESHOLD, size))
        if taken:
            self.mmap_threshold_bytes = size
        return taken

    def trim(self) -> bool:
        """``malloc_trim(0)``: give free pages of every arena back to the OS. Blocks for as long
        as it walks them (milliseconds on a heap of a few hundred MB). True if any was."""
        return bool(self._malloc_trim(0))


TRIM_INTERVAL_S = 30.0
"""How often :meth:`ProcessMemory.trim_periodically` looks at malloc's free memory."""
TRIM_MIN_FREE_BYTES = 8 * 2**20
"""... and gives it back to the OS (``malloc_trim``) when more than this is held free. (Free
chunks stay free whether or not their pages are still resident, so this trims again every
interval once a peak has left that much free: a few ms each time, measured cheaper than any
guess at what is resident. Trimming only after RSS grew since the last trim was tried: a trim
at the top of a burst set the mark so high that the memory the burst then freed was never
given back.)"""


FROZEN_COUNT_TTL_S = 60.0
"""How long ``/status`` shows one count of the collector's frozen objects (they are frozen once,
at start)."""


class ProcessMemory:
    """The process's memory: what ``/status`` shows of it, the tracemalloc diagnostic, and the
    periodic ``malloc_trim`` that keeps malloc's freed memory from piling up in RSS (why:
    bench/README.md, "Memory for hours"). Owned by ``serve`` (which runs
    :meth:`trim_periodically` in its root nursery) or, without one, by the app."""

    def __init__(self, allocator: Allocator | None = None, *,
                 interval_s: float | None = TRIM_INTERVAL_S,
                 min_free_bytes: int = TRIM_MIN_FREE_BYTES,
                 rss: Callable[[], int] = rss_bytes) -> None:
        self.allocator = allocator
        self._rss = rss
        self.trace = TraceGrowth()
        self._interval_s = interval_s
        self._min_free_bytes = min_free_bytes
        self.trims = 0
        self.trimmed_bytes = 0  # RSS given back, as seen from outside (before - after)
        self.trim_seconds = 0.0
        self.trim_max_s = 0.0
        self._frozen: tuple[float, int] | None = None  # (when counted, gc.get_freeze_count())

    @classmethod
    def open(cls, trim_interval_s: float | None = None,
             mmap_threshold_bytes: int | None = MMAP_THRESHOLD_BYTES) -> ProcessMemory:
        """glibc's allocator if there is one, with its mmap threshold fixed at
        ``mmap_threshold_bytes`` (None, or ``MALLOC_MMAP_THRESHOLD_`` in the environment:
        glibc's own); trims every ``trim_interval_s`` (None: never, as for an app without
        ``serve``)."""
        allocator = Allocator.open()
        if (allocator is not None and mmap_threshold_bytes is not None
                and "MALLOC_MMAP_THRESHOLD_" not in os.environ):
            allocator.set_mmap_threshold(mmap_threshold_bytes)
        return cls(allocator, interval_s=trim_interval_s)

    async def trim_periodically(self) -> None:
        """Every ``interval_s``, :meth:`trim_if_worth_it`: malloc's free pages back to the OS
        when there is something to give back. Runs until cancelled (the root nursery at
        shutdown); does nothing without glibc or without an interval
        (``malloc_trim_interval_s: null``). Each
        trim blocks the event loop for its duration (a few ms for tens of MB free; shown in
        ``/status`` as ``trim.max_ms``)."""
        interval_s = self._interval_s
        if self.allocator is None or interval_s is None:
            await trio.sleep_forever()
            return
        while True:
            await trio.sleep(interval_s)
            self.trim_if_worth_it()

    def trim_if_worth_it(self) -> bool:
        """One look, and one ``malloc_trim`` if more than ``min_free_bytes`` is free
        (:data:`TRIM_MIN_FREE_BYTES`). True if it trimmed. Synchronous."""
        allocator = self.allocator
        if allocator is None or allocator.stats()["free_bytes"] < self._min_free_bytes:
            return False
        before = self._rss()
        started = time.perf_counter()
        allocator.trim()
        elapsed = time.perf_counter() - started
        after = self._rss()
        self.trims += 1
        self.trimmed_bytes += max(0, before - after)
        self.trim_seconds += elapsed
        self.trim_max_s = max(self.trim_max_s, elapsed)
        return True

    def _gc_status(self) -> dict[str, Any]:
        """The cycle collector: objects waiting in each generation, collections run, objects
        collected, and the frozen ones (``serve`` freezes what exists at start). Counting the
        frozen objects walks them all (5 ms for the 59,000 a server freezes, a stall of the
        event loop on every ``/status``), so the count is taken at most once every
        :data:`FROZEN_COUNT_TTL_S`."""
        now = time.monotonic()
        if self._frozen is None or now - self._frozen[0] >= FROZEN_COUNT_TTL_S:
            self._frozen = (now, gc.get_freeze_count())
        stats = gc.get_stats()
        return {"pending": list(gc.get_count()), "frozen": self._frozen[1],
                "collections": [s["collections"] for s in stats],
                "collected": [s["collected"] for s in stats],
                "uncollectable": sum(s["uncollectable"] for s in stats)}

    def status(self) -> dict[str, Any]:
        """The ``memory`` block of ``GET /status``: RSS, the allocator's view, pymalloc's block
        count, the trims so far and, when tracing, tracemalloc's totals. Cheap (no
        snapshot)."""
        allocator = self.allocator
        out: dict[str, Any] = {
            "rss_bytes": self._rss(),
            "python_blocks": sys.getallocatedblocks(),
            "gc": self._gc_status(),
            "allocator": {**allocator.stats(),
                          "mmap_threshold_bytes": allocator.mmap_threshold_bytes}
            if allocator is not None else None,
            "trim": {"interval_s": self._interval_s, "min_free_bytes": self._min_free_bytes,
                     "trims": self.trims, "trimmed_bytes": self.trimmed_bytes,
                     "total_ms": round(1000 * self.trim_seconds, 3),
                     "max_ms": round(1000 * self.trim_max_s, 3)}
            if allocator is not None else None,
            "tracemalloc": None,
        }
        if tracemalloc.is_tracing():
            current, peak = tracemalloc.get_traced_memory()
            out["tracemalloc"] = {"traced_bytes": current, "peak_bytes": peak,
                                  "frames": tracemalloc.get_traceback_limit()}
        return out


def _growers(new: tracemalloc.Snapshot, old: tracemalloc.Snapshot,
             top: int) -> list[dict[str, Any]]:
    stats = new.compare_to(old, "traceback")
    stats.sort(key=lambda s: s.size_diff, reverse=True)
    return [
        {"size_diff_bytes": s.size_diff, "size_bytes": s.size, "count_diff": s.count_diff,
         "count": s.count, "traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback][-12:]}
        for s in stats[:top]
    ]


class TraceGrowth:
    """tracemalloc snapshots compared over time, by traceback. Owned by the app; holds the
    baseline snapshot (taken by the first :meth:`report`, or by one with ``reset``) and the
    previous one. Only useful when tracing (``PYTHONTRACEMALLOC=FRAMES`` at start)."""

    def __init__(self) -> None:
        self._baseline: tracemalloc.Snapshot | None = None
        self._previous: tracemalloc.Snapshot | None = None
        self._lock = trio.Lock()

    @staticmethod
    def tracing() -> bool:
        return tracemalloc.is_tracing()

    async def report(self, *, top: int = 20, reset: bool = False) -> dict[str, Any]:
        """Take a snapshot (in a worker thread: seconds with many traced blocks) and list the
        ``top`` growers since the baseline and since the previous report. With ``reset`` (or
        the first time) the snapshot becomes the new baseline. One report at a time."""
        if not tracemalloc.is_tracing():
            return {"tracing": False}
        async with self._lock:
            snapshot = await trio.to_thread.run_sync(
                lambda: tracemalloc.take_snapshot().filter_traces(_IGNORED))
            current, peak = tracemalloc.get_traced_memory()
            out: dict[str, Any] = {"tracing": True, "traced_bytes": current,
                                   "peak_bytes": peak}
            if reset or self._baseline is None:
                self._baseline = snapshot
                out["since_baseline"] = []
            else:
                baseline = self._baseline
                out["since_baseline"] = await trio.to_thread.run_sync(
                    _growers, snapshot, baseline, top)
            previous, self._previous = self._previous, snapshot
            out["since_previous"] = (
                [] if previous is None or reset
                else await trio.to_thread.run_sync(_growers, snapshot, previous, top))
            return out


__all__ = ["Allocator", "ProcessMemory", "TraceGrowth", "rss_bytes"]
