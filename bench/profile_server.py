"""Profile our server with py-spy under the N=16, K=16, judge 50 ms load; print the hot spots.

    python bench/profile_server.py [--seconds 20] [--n 16] [--k 16] [--judge-ms 50]
        [--tracing RATIO] [--set KEY=VALUE ...]

Starts the mock judge and ``genrm-trio serve`` exactly as the bench does, drives the load with
the bench's load generator, records the server with ``py-spy record --format raw`` (collapsed
stacks, written to bench/results/profile-*.txt) and prints the functions with the most samples,
by self time and by inclusive time. ``--tracing RATIO`` turns traces on at that sample ratio,
exported to the tracing bench's OTLP sink (a thread of this process; needs the ``[otel]``
extra); ``--set`` passes any other config key to the server. Needs ``pip install py-spy`` and
ptrace permission.
"""

from __future__ import annotations

import argparse
import collections
import functools
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases.measure import warm_up_run
from genrm_trio.bench.cases.tracing import otlp_sink
from genrm_trio.bench.records import BenchContext, JudgeSettings, ServerSettings
from genrm_trio.bench.rig import _rig

RESULTS = Path(__file__).resolve().parent / "results"


def hot_spots(collapsed: Path, top: int) -> str:
    """Self and inclusive sample counts per frame from py-spy's collapsed-stack output."""
    self_counts: collections.Counter[str] = collections.Counter()
    incl_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        self_counts[frames[-1]] += count
        for frame in set(frames):
            incl_counts[frame] += count
    out = [f"{total} samples"]
    for title, counter in (("self", self_counts), ("inclusive", incl_counts)):
        out.append(f"\n-- top {top} by {title} time --")
        for frame, count in counter.most_common(top):
            out.append(f"{100 * count / max(total, 1):5.1f}%  {frame}")
    return "\n".join(out)


async def main(args: argparse.Namespace) -> None:
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        sys.exit("py-spy not found: pip install py-spy")
    ctx = BenchContext(RESULTS, None)
    judge = JudgeSettings(latency_ms=args.judge_ms)
    label = f"profile-n{args.n}-k{args.k}-judge{int(args.judge_ms)}ms"
    sets = [tuple(item.split("=", 1)) for item in args.set]
    if any(len(pair) != 2 for pair in sets):
        sys.exit("--set takes KEY=VALUE")
    with ExitStack() as stack:
        if args.tracing is not None:
            sink = stack.enter_context(otlp_sink())
            sets += [("tracing.enabled", "true"), ("tracing.otlp_endpoint", sink.url),
                     ("tracing.sample_ratio", repr(args.tracing))]
            label += f"-tracing{args.tracing:g}"
        await _profile(args, ctx, judge, label, tuple(sets), pyspy)


async def _profile(args: argparse.Namespace, ctx: BenchContext, judge: JudgeSettings,
                   label: str, sets: tuple[tuple[str, str], ...], pyspy: str) -> None:
    out = RESULTS / f"{label}.txt"
    server = ServerSettings(n=args.n, ours_extra=sets)
    async with _rig(ctx, "ours", judge, server, label) as rig:
        bodies = loadgen.BodyFactory(seed=7, run_tag=rig.run_tag)
        await warm_up_run(rig, bodies, args.n)
        cmd = [
            pyspy,
            "record",
            "--pid",
            str(rig.server.pid),
            "--duration",
            str(round(args.seconds)),
            "--rate",
            "250",
            "--format",
            "raw",
            "--output",
            str(out),
            "--nonblocking",
        ]
        async with trio.open_nursery() as nursery:
            log = RESULTS / f"{label}.py-spy.log"
            with log.open("wb") as err:
                nursery.start_soon(
                    functools.partial(
                        trio.run_process, cmd, stdout=subprocess.DEVNULL, stderr=err, check=False
                    )
                )
                plan = loadgen.LoadPlan(
                    n=args.n, k=args.k, max_cohorts=1_000_000, duration_s=args.seconds + 1.0
                )
                before = rig.stats()
                result = await loadgen.drive_load(rig.client, bodies, plan)
                after = rig.stats()
    cohorts = sum(1 for c in result.cohorts if c.ok)
    print(
        f"{result.verifies / result.wall_s:.0f} verifies/s, "
        f"{1000 * (after.cpu_s - before.cpu_s) / max(cohorts, 1):.1f} ms CPU per cohort "
        f"(under py-spy)"
    )
    print(hot_spots(out, args.top))
    print(f"\ncollapsed stacks: {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--judge-ms", type=float, default=50.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tracing", type=float, default=None, metavar="RATIO",
                        help="tracing on at this sample ratio, exported to a loopback sink")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a server config key (repeatable)")
    trio.run(main, parser.parse_args())
