"""What an open client connection costs the server, and what is left once it closes.

    python3 bench/idle_connections.py [--steps 500,1000,2000] [--set KEY=VALUE ...]

Starts ``genrm-trio serve --port 0`` (built-in judge, ``malloc_trim_interval_s: null`` unless
``--set`` says otherwise), opens keep-alive connections to it in steps, each after one
``GET /health`` (so the server holds it as an idle keep-alive connection, as it holds a
caller's pooled ones), and prints RSS, pymalloc's blocks and malloc's heap from ``GET
/status`` at each step; then closes them all and prints the same again after a pause, and
once more after a burst of requests (which runs the cycle collector). Ends the server by its
PID. Bounded: at most a few thousand connections on 127.0.0.1, about half a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="500,1000,2000")
    parser.add_argument("--requests", type=int, default=2000,
                        help="requests after the close (they run the cycle collector)")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--trace", action="store_true",
                        help="PYTHONTRACEMALLOC=10 and the top growers at the end")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    exe = shutil.which("genrm-trio")
    cmd = [exe] if exe else [sys.executable, "-m", "genrm_trio.cli"]
    cmd += ["serve", "--host", "127.0.0.1", "--port", "0", "--set", "log_level=WARNING",
            "--set", "num_rollouts_per_prompt=2", "--set", "malloc_trim_interval_s=null"]
    for item in args.sets:
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONTRACEMALLOC": "10"} if args.trace else None
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if "listening on" not in line:
            raise SystemExit(f"server did not start: {line!r}")
        url = line.rsplit(" ", 1)[1].strip()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        _run(url, host, int(port), steps, args.requests, args.trace)
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def _memory(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/status", timeout=10) as answer:
        memory: dict[str, Any] = json.load(answer)["memory"]
    return memory


def _show(label: str, memory: dict[str, Any], base: dict[str, Any] | None, count: int) -> None:
    mb = 2**20
    heap = (memory["allocator"] or {}).get("heap_bytes", 0)
    line = (f"{label:>28}: RSS {memory['rss_bytes'] / mb:6.1f} MB, pymalloc blocks "
            f"{memory['python_blocks']:8d}, malloc heap {heap / mb:5.1f} MB")
    if base is not None and count:
        per = (memory["rss_bytes"] - base["rss_bytes"]) / count / 1024
        blocks = (memory["python_blocks"] - base["python_blocks"]) / count
        line += f"  ({per:.1f} KiB and {blocks:.0f} blocks per connection)"
    print(line, flush=True)


def _run(url: str, host: str, port: int, steps: list[int], requests: int,
         trace: bool) -> None:
    if trace:
        with urllib.request.urlopen(f"{url}/debug/memory?reset=1", timeout=60) as answer:
            answer.read()
    base = _memory(url)
    _show("no client connection", base, None, 0)
    socks: list[socket.socket] = []
    try:
        for target in steps:
            while len(socks) < target:
                sock = socket.create_connection((host, port), timeout=10)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
                sock.recv(65536)
                socks.append(sock)
            time.sleep(1.0)
            _show(f"{target} idle keep-alive", _memory(url), base, target)
    finally:
        for sock in socks:
            sock.close()
    time.sleep(2.0)
    _show("all closed, 2 s later", _memory(url), base, 0)
    for _ in range(requests):  # allocations: the cycle collector runs
        with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
            answer.read()
    _show(f"after {requests:,} more requests", _memory(url), base, 0)
    if trace:
        with urllib.request.urlopen(f"{url}/debug/memory?top=8", timeout=60) as answer:
            report = json.load(answer)
        print("tracemalloc, top growers since no client connection:")
        for grower in report.get("since_baseline", []):
            frames = " <- ".join(reversed(grower["traceback"][-4:]))
            print(f"  {grower['size_diff_bytes'] / 1024:+9.1f} KiB "
                  f"{grower['count_diff']:+7d} blocks  {frames}")


if __name__ == "__main__":
    main()
