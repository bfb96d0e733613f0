"""What a slime group reward costs as one cohort (``/verify`` x N) and as one ``/compare`` call.

    flock /tmp/bench.lock python3 bench/slime_cohort_vs_compare.py [--groups 64] [--n 8]
        [--repeats 3] [--latency-ms 20]

Starts ``genrm-trio mock-judge`` (``--latency-ms`` per call) and ``genrm-trio serve``
(``num_rollouts_per_prompt: N``, circular pairs, the defaults otherwise) on 127.0.0.1 port 0,
then per repeat scores ``--groups`` groups of N at once both ways through
``genrm_trio.integrations.slime.group_rm`` (one call per group, all at once, as slime's rollout
loop makes them), alternating which goes first: ``genrm_route: cohort`` (N members of one
explicit cohort) and ``genrm_route: compare`` (one ``POST /compare`` per group). Prints, per
way, the wall time, the server's CPU seconds (utime + stime of its process, from ``/proc``),
this process's (the caller's) and the judge calls (the mock judge's ``/admin/stats``). Ends
both processes by their PIDs. Bounded: ``groups x N x repeats`` members, a minute or so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from typing import Any

import anyio

from genrm_trio.integrations.slime import group_rm


def start(cmd: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    return proc, line.split("listening on ", 1)[1].split()[0]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def caller_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def judge_calls(judge: str) -> int:
    with urllib.request.urlopen(judge + "/admin/stats", timeout=30) as answer:
        stats: dict[str, Any] = json.loads(answer.read())
    return int(stats.get("calls", stats.get("requests", 0)))


def groups(count: int, n: int) -> list[tuple[str, list[str]]]:
    return [(f"question {g} about the sky", [f"answer {k} to {g} " + "more " * k
                                             for k in range(n)]) for g in range(count)]


class Sample:
    """The fields of slime's ``Sample`` that group_rm reads and sets."""

    def __init__(self, group_index: int, prompt: str, response: str) -> None:
        self.group_index = group_index
        self.prompt = prompt
        self.response = response
        self.remove_sample = False
        self.metadata: dict[str, Any] = {}


async def score(url: str, route: str, batch: list[tuple[str, list[str]]]) -> None:
    """Every group at once through ``group_rm``, as slime's rollout loop calls it."""
    args = argparse.Namespace(genrm_url=url, genrm_route=route,
                              n_samples_per_prompt=len(batch[0][1]))

    async def one(g: int, prompt: str, answers: list[str]) -> None:
        rewards = await group_rm(args, [Sample(g, prompt, a) for a in answers])
        assert len(rewards) == len(answers) and len(set(rewards)) > 1, rewards

    async with anyio.create_task_group() as tasks:
        for g, (prompt, answers) in enumerate(batch):
            tasks.start_soon(one, g, prompt, answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=int, default=20)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "genrm_trio.cli"]
    judge_proc, judge = start([*cli, "mock-judge", "--port", "0", "--latency-ms",
                               str(args.latency_ms)])
    server_proc, url = start([*cli, "serve", "--port", "0", "--judge-url", judge, "--set",
                              f"num_rollouts_per_prompt={args.n}", "--set", "log_level=WARNING"])
    totals: dict[str, list[tuple[float, float, int, float]]] = {"cohort": [], "compare": []}
    try:
        for way in ("cohort", "compare"):  # warm up both paths
            anyio.run(score, url, way, groups(4, args.n))
        for repeat in range(args.repeats):
            ways = ["cohort", "compare"] if repeat % 2 == 0 else ["compare", "cohort"]
            for way in ways:
                batch = groups(args.groups, args.n)
                calls, cpu, wall = judge_calls(judge), cpu_s(server_proc.pid), time.monotonic()
                mine = caller_cpu_s()
                anyio.run(score, url, way, batch)
                totals[way].append((time.monotonic() - wall, cpu_s(server_proc.pid) - cpu,
                                    judge_calls(judge) - calls, caller_cpu_s() - mine))
    finally:
        for proc in (server_proc, judge_proc):
            proc.kill()
            proc.wait()
    print(f"{args.groups} groups of {args.n} at once, judge {args.latency_ms} ms per call, "
          f"{args.repeats} repeats")
    print("| way | wall s | server CPU s | caller CPU s | judge calls |")
    print("| --- | --- | --- | --- | --- |")
    for way, runs in totals.items():
        walls, cpus, callers = (sorted(r[i] for r in runs) for i in (0, 1, 3))
        mid = len(runs) // 2
        print(f"| {way} | {walls[mid]:.3f} | {cpus[mid]:.3f} | {callers[mid]:.3f} | "
              f"{runs[0][2]} |")
    print("(medians over the repeats)")


if __name__ == "__main__":
    main()
