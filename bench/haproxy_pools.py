"""What HAProxy's shared memory cache (``-dMglobal``) saves in front of two replicas.

    python3 bench/haproxy_pools.py [--rounds 6] [--window 4]

Starts two ``genrm-trio serve`` replicas (N = 8, the canned judge, as in the ``scaleout``
preset) and two HAProxy processes in front of both, with the shipped config: one started as
``open_haproxy`` starts it (``-dMglobal``), one without it (Debian's default: freed buffers go
back to glibc). Each round drives one HAProxy, then the other (the order alternating), with wrk
(32 cohorts of 8 in flight per replica) for a measuring window of ``--window`` seconds, and
reads HAProxy's CPU per answered /verify and the throughput. Prints the medians over the
rounds, and exits 1 when the shared cache does not cost less HAProxy CPU per verify.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import trio

from genrm_trio.bench.bare import CANNED_JUDGE
from genrm_trio.bench.haproxy import GLOBAL_POOL_ARGS, open_haproxy
from genrm_trio.bench.loadgen import BodyFactory
from genrm_trio.bench.processes import launch_process
from genrm_trio.bench.records import ServerSettings
from genrm_trio.bench.rig import ours_command
from genrm_trio.bench.wrk import run_wrk

N = 8
K_PER_REPLICA = 32
READY = "genrm-trio serve listening on "
VARIANTS = {"shared cache (-dMglobal)": GLOBAL_POOL_ARGS, "no shared cache": ()}


async def main(rounds: int, window_s: int) -> int:
    cmd = ours_command("", ServerSettings(n=N)) + ["--set", f"judge.plugin={CANNED_JUDGE}"]
    with tempfile.TemporaryDirectory(prefix="genrm-pools-") as tmp_name:
        tmp = Path(tmp_name)
        async with contextlib.AsyncExitStack() as stack:
            replicas = [
                await stack.enter_async_context(
                    launch_process(cmd, log_path=tmp / f"r{i}.log", ready_prefix=READY))
                for i in (1, 2)
            ]
            addresses = [r.base_url.removeprefix("http://") for r in replicas]
            proxies = {
                name: await stack.enter_async_context(open_haproxy(
                    addresses, max_request_bytes=16 * 2**20, args=args,
                    log_path=tmp / f"haproxy-{i}.log"))
                for i, (name, args) in enumerate(VARIANTS.items())
            }
            seen: dict[str, dict[str, list[float]]] = {
                name: {"haproxy_ms": [], "per_s": []} for name in proxies}

            async def drive(name: str, connections: int, window: int, record: bool) -> None:
                proxy = proxies[name]
                pid = proxy.process.pid
                result = await run_wrk(
                    proxy.url, BodyFactory(seed=3, run_tag=f"pools-{time.time_ns()}"), N,
                    connections=connections, window_s=window, workdir=tmp, watch=[pid])
                if record:
                    good = max(result.window_good, 1)
                    seen[name]["haproxy_ms"].append(1000.0 * result.cpu_s[pid] / good)
                    seen[name]["per_s"].append(result.window_good / result.window_s)

            for name in proxies:  # warm-up: connections to both replicas, pools
                await drive(name, 8 * N, 1, record=False)
            names = list(proxies)
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    await drive(name, 2 * K_PER_REPLICA * N, window_s, record=True)
    print(f"| HAProxy ({rounds} rounds of {window_s} s) | HAProxy CPU ms per verify "
          "| verifies/s |")
    print("| --- | ---: | ---: |")
    for name, values in seen.items():
        print(f"| {name} | {median(values['haproxy_ms']):.3f} | {median(values['per_s']):.0f} |")
    shared, plain = (median(seen[name]["haproxy_ms"]) for name in VARIANTS)
    print(f"\nshared cache / no shared cache, HAProxy CPU per verify: {shared / plain:.2f}")
    return 0 if shared < plain else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=int, default=4)
    args = parser.parse_args()
    sys.exit(trio.run(main, args.rounds, args.window))
