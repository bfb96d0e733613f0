"""``release``: thousands of waiting members released by their deadline, by SIGTERM, or by their
clients going away; the time each waiter's answer (or dropped connection) took."""

from __future__ import annotations

import functools
import math
import signal
import socket
import time
from typing import Any

import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases.measure import send_many, to_ms, wait_idle
from genrm_trio.bench.loadgen import BodyFactory, H11Client, MemberResult, percentile
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import Rig, _rig


def release_case(
    trigger: str, *, waiters: int = 10_000, cohorts: int = 625, deadline_s: float = 30.0
) -> Case:
    """``waiters`` members waiting in ``cohorts`` incomplete cohorts (the server expects twice
    as many members per cohort), then one trigger releases them all:

    - ``deadline``: each cohort's collection deadline (from its first member's arrival);
    - ``sigterm``: SIGTERM to the server;
    - ``disconnect``: every client connection closes at once.

    Release time per waiter (``release_*``). ``deadline`` and ``sigterm``: when its answer
    (or the dropped connection) reached the load generator's socket, stamped by epoll in a
    thread while the waiters hold off reading, minus the trigger (for ``deadline``, its cohort's
    own deadline: first member's arrival, pinned by a ``/health`` round trip, plus the timeout).
    ``disconnect``: every waiter socket is shut down at once from a thread, which then samples
    the server's open-descriptor count (i-th close = i-th released waiter).
    """
    per = waiters // cohorts
    timeout_s = deadline_s if trigger == "deadline" else 3600.0

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        judge = JudgeSettings(latency_ms=50.0)
        server = ServerSettings(n=2 * per, collection_timeout_s=timeout_s)
        async with _rig(ctx, kind, judge, server, tag) as rig:
            pid = rig.server.pid
            bodies = BodyFactory(seed=17, run_tag=rig.run_tag)
            host, port = rig.server.host_port
            # Waiters get their own connections (never pooled), so closing them is visible.
            waiting_client = H11Client(host, port, max_idle=0)
            waiting = Rig(rig.kind, rig.judge, rig.server, waiting_client, rig.judge_client, tag)
            opened: dict[int, float] = {}
            results: list[tuple[int, MemberResult]] = []
            cohort_of: dict[int, int] = {}
            watch = loadgen.ReadableWatch()
            hold = trio.Event()
            closes: list[float] = []
            notes: dict[str, Any] = {}
            fds_idle = loadgen.count_fds(pid)
            t0 = 0.0
            seen: dict[int, float] = {}

            def on_sent(cohort: int, fd: int) -> None:
                cohort_of[fd] = cohort
                watch.add(fd)

            async with trio.open_nursery() as nursery:
                # Phase 1: open every cohort with one member, pinning its arrival time between
                # the end of its send and the next /health answer (one round trip).
                for c in range(cohorts):
                    sent = trio.Event()

                    async def first(c: int = c, sent: trio.Event = sent) -> None:
                        result = await loadgen.send_member(
                            waiting_client,
                            bodies.member(c, 0),
                            0,
                            sent=sent,
                            on_sent=functools.partial(on_sent, c),
                            hold=hold,
                        )
                        results.append((c, result))

                    nursery.start_soon(first)
                    await sent.wait()
                    t_sent = time.perf_counter()
                    await rig.ping()
                    opened[c] = (t_sent + time.perf_counter()) / 2
                # Phase 2: the other members, as fast as the server accepts them.
                rest = [(c, i) for c in range(cohorts) for i in range(1, per)]
                all_sent = trio.Event()
                nursery.start_soon(
                    functools.partial(
                        send_many,
                        waiting,
                        bodies,
                        rest,
                        results,
                        all_sent=all_sent,
                        on_sent=on_sent,
                        hold=hold,
                    )
                )
                await all_sent.wait()
                await rig.ping()
                await wait_idle(rig)
                notes["send_s"] = time.perf_counter() - min(opened.values())
                rss_mb = rig.stats().rss_bytes / 2**20
                if trigger == "disconnect":
                    fds_full = loadgen.count_fds(pid)
                    expected = min(fds_full - fds_idle, waiters)
                    t0, closes = await trio.to_thread.run_sync(
                        _disconnect_and_time, pid, list(cohort_of), fds_full, expected
                    )
                    nursery.cancel_scope.cancel()
                else:
                    # The waiters do not read until the watch is over: the stamps come from
                    # epoll in a thread, free of the load generator's own work.
                    limit_s = deadline_s + 60.0 if trigger == "deadline" else 60.0
                    if trigger == "sigterm":
                        t0 = time.perf_counter()
                        rig.server.process.send_signal(signal.SIGTERM)
                    seen = await trio.to_thread.run_sync(watch.watch, limit_s)
                    hold.set()
                    _limit(nursery, 30.0)
            if trigger == "deadline":
                release_ms = [
                    to_ms(t - (opened[cohort_of[fd]] + deadline_s)) for fd, t in seen.items()
                ]
                notes["deadline_spread_ms"] = to_ms(max(opened.values()) - min(opened.values()))
            elif trigger == "sigterm":
                release_ms = [to_ms(t - t0) for t in seen.values()]
            else:
                release_ms = [to_ms(t - t0) for t in closes]
                notes["close_and_release_ms"] = to_ms(time.perf_counter() - t0)
            await waiting_client.aclose()
            statuses: dict[str, int] = {}
            for _, m in results:
                key = str(m.status) if m.status != loadgen.TRANSPORT_ERROR else "dropped"
                statuses[key] = statuses.get(key, 0) + 1
            notes["answers"] = statuses
            metrics = {
                "release_p50_ms": percentile(release_ms, 0.5),
                "release_p99_ms": percentile(release_ms, 0.99),
                "release_max_ms": max(release_ms) if release_ms else math.nan,
                "released": float(len(release_ms)),
                "rss_waiting_mb": rss_mb,
                "send_s": notes["send_s"],
            }
            return RunRecord(metrics, {"release_ms": release_ms}, notes)

    params = {
        "trigger": trigger,
        "waiters": waiters,
        "cohorts": cohorts,
        "members_expected_per_cohort": 2 * per,
        "deadline_s": timeout_s,
    }
    return Case("release", trigger, run, params)


def _limit(nursery: trio.Nursery, limit_s: float) -> None:
    """Let the nursery's waiters finish on their own, but cancel what is left after ``limit_s``."""
    nursery.cancel_scope.deadline = trio.current_time() + limit_s


def _disconnect_and_time(
    pid: int, fds: list[int], fds_full: int, expected: int, limit_s: float = 120.0
) -> tuple[float, list[float]]:
    """Blocks (run it in a thread while the trio side idles). Shuts down every waiter socket at
    once (``shutdown``, so the server sees the client go away now; the owning tasks close them
    later), then samples the server's descriptor count until ``expected`` have closed or
    ``limit_s`` passed. Returns the trigger time and, per closed descriptor, the first sample
    (``time.perf_counter``) that showed it closed. A process that is gone has closed all."""
    t0 = time.perf_counter()
    for fd in fds:
        sock = socket.socket(fileno=fd)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer: nothing to trigger
        finally:
            sock.detach()
    out: list[float] = []
    deadline = time.perf_counter() + limit_s
    while len(out) < expected and time.perf_counter() < deadline:
        try:
            closed = fds_full - loadgen.count_fds(pid)
        except OSError:
            closed = expected
        now = time.perf_counter()
        while len(out) < min(closed, expected):
            out.append(now)
        time.sleep(0.0005)
    return t0, out
