"""What grew in a soak: the memory series and tracemalloc's top growers of its results.json.

    python3 bench/soak_memory.py [bench/results/results.json] [--every-s 60] [--top 10]

One row per ``--every-s`` of the run: RSS; malloc's heap, what is in use in it and what is held
free (glibc's mallinfo2); RSS outside malloc's heap and mapped blocks (pymalloc's arenas, code,
stacks; a lower bound once trimmed, since a trimmed heap page is counted in the heap but is not
resident); pymalloc's blocks; open descriptors (client connections, the judge's, files); and the
bounded structures of ``/status``. Then the
last-half RSS slope, the trims, and, when the soak ran with ``--soak tracemalloc_frames=N``,
the top growers by traceback since the window's start at the last report.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

_MB = 2**20
_STRUCTURES = ("records", "idle_watermarks", "active_cohorts", "watch_queue",
               "judge_connections", "judge_limiter_waiting", "metrics_series")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", default="bench/results/results.json", type=Path)
    parser.add_argument("--every-s", type=float, default=60.0)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    for case in json.loads(args.results.read_text()):
        if case["preset"] != "soak":
            continue
        for run in case["runs"].get("ours", []):
            _report(case, run, args.every_s, args.top)


def _report(case: dict[str, Any], run: dict[str, Any], every_s: float, top: int) -> None:
    samples: dict[str, list[float]] = run["samples"]
    metrics: dict[str, float] = run["metrics"]
    print(f"# soak {case['label']}: capacity {metrics.get('capacity_verifies_per_s', 0):.0f} "
          f"verifies/s, offered {metrics.get('offered_verifies_per_s', 0):.0f}, "
          f"{metrics.get('requests', 0):.0f} requests, "
          f"{metrics.get('unexpected', 0):.0f} unexpected")

    def col(name: str, i: int, scale: float = 1.0) -> str:
        values = samples.get(name)
        if not values or i >= len(values) or not math.isfinite(values[i]):
            return "-"
        return f"{values[i] / scale:.1f}" if scale != 1.0 else f"{values[i]:.0f}"

    head = ["min", "rss", "heap", "in_use", "free", "outside", "py_blocks", "fds",
            *_STRUCTURES]
    print("| " + " | ".join(head) + " |")
    print("|" + " ---: |" * len(head))
    next_t = -math.inf
    times = samples.get("t_s", [])
    for i, t in enumerate(times):
        if t < next_t and i != len(times) - 1:
            continue
        next_t = t + every_s
        heap = samples.get("memory.allocator.heap_bytes", [])
        mapped = samples.get("memory.allocator.mmapped_bytes", [])
        outside = ("-" if i >= len(heap) or i >= len(mapped) else
                   f"{samples['rss_mb'][i] - (heap[i] + mapped[i]) / _MB:.1f}")
        row = [f"{t / 60:.1f}", f"{samples['rss_mb'][i]:.1f}",
               col("memory.allocator.heap_bytes", i, _MB),
               col("memory.allocator.in_use_bytes", i, _MB),
               col("memory.allocator.free_bytes", i, _MB), outside,
               col("memory.python_blocks", i), col("fds", i),
               *(col(f"memory.structures.{name}", i) for name in _STRUCTURES)]
        print("| " + " | ".join(row) + " |")
    _per_connection(samples)
    print(f"\nRSS slope over the last half of the load: "
          f"{metrics.get('rss_last_half_slope_mb_per_min', math.nan):+.4f} MB/min "
          f"(from {metrics.get('rss_last_half_start_s', math.nan) / 60:.1f} to "
          f"{metrics.get('rss_last_half_end_s', math.nan) / 60:.1f} min); growth over the "
          f"window {metrics.get('rss_growth_mb', math.nan):+.1f} MB")
    end = run["notes"].get("memory_end", {})
    print(f"failed checks: {run['notes'].get('failed_checks')}")
    if end:
        print(f"at the end: rss {end.get('rss_bytes', 0) / _MB:.1f} MB, heap "
              f"{end.get('allocator.heap_bytes', 0) / _MB:.1f} MB "
              f"({end.get('allocator.free_bytes', 0) / _MB:.1f} free)")
    traces = [t for t in run["notes"].get("tracemalloc", []) if "since_baseline" in t]
    if traces:
        last = traces[-1]
        print(f"\ntracemalloc at {last['t_s'] / 60:.1f} min: traced "
              f"{last['traced_bytes'] / _MB:.1f} MB; top growers since the window's start:")
        for grower in last["since_baseline"][:top]:
            frames = " <- ".join(reversed(grower["traceback"][-3:]))
            print(f"  {grower['size_diff_bytes'] / 1024:+9.1f} KiB "
                  f"{grower['count_diff']:+7d} blocks  {frames}")
    print()


def _per_connection(samples: dict[str, list[float]]) -> None:
    """Least-squares RSS against open descriptors over the run: what one more open connection
    costs, when connections are what moves RSS."""
    xs, ys = samples.get("fds", []), samples.get("rss_mb", [])
    if len(xs) < 3 or len(xs) != len(ys):
        return
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    var_y = sum((y - my) ** 2 for y in ys)
    r = cov / math.sqrt(var * var_y) if var_y else math.nan
    print(f"\nRSS against open descriptors: {1024 * slope:+.1f} KiB per descriptor "
          f"(r = {r:.2f}, {min(xs):.0f} to {max(xs):.0f} descriptors)")


if __name__ == "__main__":
    main()
