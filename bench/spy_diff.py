"""Where two servers' CPU per cohort differs, from the py-spy samples of a side-by-side run.

    python bench/spy_diff.py DIR LABEL_A LABEL_B CPU_MS_A CPU_MS_B [--top 25]

``DIR``: the ``--side py_spy=DIR`` folder of ``genrm-trio bench --arm ... --baseline ...``
(raw collapsed stacks, ``<label>.r<round>.txt``); ``CPU_MS_*``: each arm's median server CPU ms
per cohort from that run's table. Each frame's inclusive share of an arm's samples (py-spy
records the threads that are running, so a share of samples is a share of CPU) times that
arm's CPU per cohort is its CPU ms per cohort; printed for both arms, largest growth first.
Frames are functions (file and name, line numbers dropped), so a function that moved lines
between commits still matches.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def inclusive_shares(files: list[Path], self_only: bool = False) -> dict[str, float]:
    """Each function's share of all samples in ``files`` (a sample counts once per function
    however deep it recurses; ``self_only``: only the innermost frame of each sample)."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for path in files:
        for line in path.read_text().splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            total += count
            frames = stack.split(";")
            for frame in {_LINE.sub(")", f) for f in (frames[-1:] if self_only else frames)}:
                counts[frame] += count
    return {frame: n / total for frame, n in counts.items()} if total else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("label_a")
    parser.add_argument("label_b")
    parser.add_argument("cpu_ms_a", type=float)
    parser.add_argument("cpu_ms_b", type=float)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default="genrm_trio", help="only frames containing this")
    parser.add_argument("--self", dest="self_only", action="store_true",
                        help="self time (the innermost frame) instead of inclusive")
    args = parser.parse_args()
    a = inclusive_shares(sorted(args.dir.glob(f"{args.label_a}.r*.txt")), args.self_only)
    b = inclusive_shares(sorted(args.dir.glob(f"{args.label_b}.r*.txt")), args.self_only)
    if not a or not b:
        raise SystemExit(f"no samples for {args.label_a} or {args.label_b} in {args.dir}")
    rows = []
    for frame in set(a) | set(b):
        if args.match not in frame:
            continue
        ms_a = a.get(frame, 0.0) * args.cpu_ms_a
        ms_b = b.get(frame, 0.0) * args.cpu_ms_b
        rows.append((ms_a - ms_b, ms_a, ms_b, frame))
    rows.sort(reverse=True)
    kind = "self" if args.self_only else "inclusive"
    print(f"CPU ms per cohort: {args.label_a} {args.cpu_ms_a:.2f}, {args.label_b} "
          f"{args.cpu_ms_b:.2f}; {kind}, by growth ({args.label_a} - {args.label_b})\n")
    print(f"| {args.label_a} ms | {args.label_b} ms | growth ms | function |")
    print("| --- | --- | --- | --- |")
    for growth, ms_a, ms_b, frame in rows[:args.top]:
        print(f"| {ms_a:.2f} | {ms_b:.2f} | {growth:+.2f} | `{frame}` |")


if __name__ == "__main__":
    main()
