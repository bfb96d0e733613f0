"""Where a waiting ``/verify`` member's memory goes (issue 21).

    python3 bench/waiter_memory.py [--waiters 10000] [--trace]

Starts ``genrm-trio serve`` (N = 32, the built-in judge, an hour of collection deadline) in a
wrapper that answers SIGUSR1 with a dump of its RSS (``/proc/self/status``) and, with
``--trace``, a tracemalloc snapshot (started before anything is imported, 16 frames deep). Then
it opens ``--waiters`` members on connections of their own, in cohorts of 16 (the release
preset's shape: half of each cohort, so all of them wait), the bench's bodies (about 2.5 KB),
and dumps again once every member waits and its cohort watches its connection. Prints the RSS
at idle and with every member waiting, the growth per waiter, and with ``--trace`` the traced
growth per waiter by component: each allocation goes to the innermost frame of its traceback
that a rule below names (our code, Hypercorn's, trio's). tracemalloc slows the server a lot
and adds its own memory, so its RSS is not the one to read: run without ``--trace`` for RSS.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import trio

from genrm_trio.bench.loadgen import BodyFactory

WRAPPER = r"""
import os, signal, sys, tracemalloc
depth = int(os.environ["WAITER_MEMORY_TRACE"])
if depth:
    tracemalloc.start(depth)
out = os.environ["WAITER_MEMORY_OUT"]
dumps = [0]

def dump(signum, frame):
    import gc, json
    gc.collect()
    path = f"{out}/{dumps[0]}"
    dumps[0] += 1
    rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
               if line.startswith("VmRSS"))
    if tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(path + ".snap")
    with open(path + ".json", "w") as f:
        json.dump({"rss": rss}, f)
    os.rename(path + ".json", path + ".done")

signal.signal(signal.SIGUSR1, dump)
from genrm_trio.cli import main
sys.argv = ["genrm-trio", *sys.argv[1:]]
main()
"""

@functools.cache
def _functions(filename: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, qualified name)`` of every function defined in a file."""
    try:
        tree = ast.parse(Path(filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    found.append((child.lineno, child.end_lineno or child.lineno,
                                  prefix + child.name))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _function(frame: tracemalloc.Frame) -> str:
    inside = [(first, name) for first, last, name in _functions(frame.filename)
              if first <= frame.lineno <= last]
    return max(inside)[1] if inside else "<module>"


def _file(filename: str) -> str:
    for marker in ("/genrm_trio/", "site-packages/"):
        if marker in filename:
            rest = filename.split(marker, 1)[1]
            return "genrm_trio/" + rest if marker == "/genrm_trio/" else rest
    return filename


_WAIT = ("CohortRegistry.verify_unless_gone", "CohortRegistry.verify")
_REQUEST_FILES = ("hypercorn/protocol/http_stream.py", "hypercorn/app_wrappers.py")
_REQUEST_FUNCTIONS = ("TaskGroup.spawn_app", "_handle", "AppQueue", "_LeanTaskGroup",
                      "H11Protocol._create_stream", "H11Protocol._handle_events")


def component(traceback: tracemalloc.Traceback) -> str:
    """The component an allocation belongs to: by the innermost frame of its traceback in our
    code, Hypercorn's, or trio's listener, and the function that frame is in."""
    for frame in reversed(list(traceback)):
        file = _file(frame.filename)
        if not file.startswith(("genrm_trio/", "hypercorn/", "trio/_highlevel_serve")):
            continue
        function = _function(frame)
        if file == "genrm_trio/wire.py" or function == "read_body_within":
            return "ours: the member's body and VerifyMember"
        if function == "_until_disconnect" or function in _WAIT:
            return "ours: the waiter (registry wait, wake scope, read of its connection)"
        if file == "genrm_trio/server/app.py":
            return "ours: the handler (application, endpoint, its send)"
        if file.startswith(("genrm_trio/server/cohort.py", "genrm_trio/identity.py",
                            "genrm_trio/scoring.py")):
            return "ours: the cohort's slot, and a share of its cohort"
        if function.endswith("TCPServer._read_data"):
            return "Hypercorn: the connection's read loop (and what it holds)"
        if file in _REQUEST_FILES or function.startswith(_REQUEST_FUNCTIONS):
            return "Hypercorn: the request (HTTPStream, scope, ASGI queue, app task)"
        if file.startswith("trio/"):
            return "trio: the accepted socket and the connection's task"
        return "Hypercorn: the connection (TCPServer, protocol, h11, task group, locks)"
    return "other"


async def status(port: int) -> Any:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /status HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1])["cohorts"]


async def dump(proc: subprocess.Popen[str], out: Path, number: int) -> Any:
    proc.send_signal(signal.SIGUSR1)
    while not (out / f"{number}.done").exists():  # noqa: ASYNC110 - another process's file
        await trio.sleep(0.2)
    return json.loads((out / f"{number}.done").read_text())


async def measure(waiters: int, trace: bool, out: Path) -> dict[str, Any]:
    env = {**os.environ, "WAITER_MEMORY_TRACE": "16" if trace else "0",
           "WAITER_MEMORY_OUT": str(out)}
    cmd = [sys.executable, "-c", WRAPPER, "serve", "--host", "127.0.0.1", "--port", "0",
           "--set", "num_rollouts_per_prompt=32", "--set", "cohort_collection_timeout_s=3600",
           "--set", "log_level=WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,  # noqa: ASYNC220 - once, at start
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().strip().rsplit(":", 1)[1])
        await trio.sleep(1.0)
        idle = await dump(proc, out, 0)
        bodies = BodyFactory(seed=17, run_tag=f"wm{time.time_ns()}")
        limiter = trio.CapacityLimiter(64)
        # A traced server is slow: pace the sends, so none waits past Hypercorn's keep-alive
        # timeout in the accept queue.
        batch = 250 if trace else waiters

        async def member(cohort: int, index: int) -> None:
            body = bodies.member(cohort, index)
            request = (b"POST /verify HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n" % len(body)) + body
            async with limiter:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(request)
            async with stream:
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            for number in range(waiters):
                nursery.start_soon(member, number // 16, number % 16)
                if (number + 1) % batch == 0:
                    while (await status(port))["waiters"] < number + 1:  # noqa: ASYNC110
                        await trio.sleep(0.5)
            while (await status(port))["waiters"] < waiters:  # noqa: ASYNC110 - the server's
                await trio.sleep(0.5)
            await trio.sleep(2.0)  # every cohort watches its connections
            full = await dump(proc, out, 1)
            nursery.cancel_scope.cancel()
    finally:
        proc.kill()
        proc.wait()
    return {"idle_rss_mb": idle["rss"] / 2**20, "waiting_rss_mb": full["rss"] / 2**20,
            "rss_per_waiter_bytes": (full["rss"] - idle["rss"]) / waiters}


def components(out: Path, waiters: int) -> list[tuple[str, float, float]]:
    idle = tracemalloc.Snapshot.load(str(out / "0.snap"))
    full = tracemalloc.Snapshot.load(str(out / "1.snap"))
    size: collections.Counter[str] = collections.Counter()
    blocks: collections.Counter[str] = collections.Counter()
    for stat in full.compare_to(idle, "traceback"):
        label = component(stat.traceback)
        size[label] += stat.size_diff
        blocks[label] += stat.count_diff
    return sorted(((label, size[label] / waiters, blocks[label] / waiters) for label in size),
                  key=lambda row: row[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=10_000)
    parser.add_argument("--trace", action="store_true", help="tracemalloc, by component")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = trio.run(measure, args.waiters, args.trace, Path(tmp))
        print(f"idle RSS {result['idle_rss_mb']:.1f} MB, with {args.waiters} waiting "
              f"{result['waiting_rss_mb']:.1f} MB: "
              f"{result['rss_per_waiter_bytes'] / 1024:.1f} KB per waiter")
        if args.trace:
            rows = components(Path(tmp), args.waiters)
            print("| component | bytes per waiter | allocations per waiter |")
            print("| --- | ---: | ---: |")
            for label, size, blocks in rows:
                print(f"| {label} | {size:,.0f} | {blocks:.1f} |")
            print(f"| total traced | {sum(r[1] for r in rows):,.0f} | "
                  f"{sum(r[2] for r in rows):.1f} |")


if __name__ == "__main__":
    main()
