"""The ``slow_readers`` bench preset: clients that ask for large answers and read none of them.

A cohort of N is completed first, one member carrying about ``answer_bytes`` (8 MB) of text.
Then ``readers`` clients (100) each open a connection with a small receive buffer
(``SO_RCVBUF`` of ``rcvbuf_bytes``), send that member again (a replay: its answer is the 8 MB
body plus the reward) and read nothing. The server runs with ``max_active_bytes`` of
``budget_bytes`` (256 MiB) and a short ``send_timeout_s`` (5 s, so the run ends in bounded
time): the answers not yet taken count in the budget (replays past it get 429), and a send that
makes no progress for ``send_timeout_s`` resets its connection, counted in ``/metrics``
``genrm_send_timeouts``. The readers hold on for ``hold_s``; meanwhile the server's RSS is
sampled every ``sample_s``, ``/status`` is read, and a prober process (the flood preset's) times
``GET /healthz`` on the probe port every ``probe_interval_s``. Then each reader reads what it
was sent (a 429 answer whole; a reset connection ends early) and closes.

::

    slow_readers_case(...).run          one rig: mock judge, genrm-trio serve (probe_port 0)
      +-- one cohort of N, rewarded     member 0 carries answer_bytes of text
      +-- prober process                GET /healthz on probe_port every probe_interval_s
      +-- sampler                       server RSS (/proc) and /status every sample_s
      +-- readers                       a task each: connect, send the 8 MB member, read
                                        nothing for hold_s; then read what came, close
      +-- GET /metrics; the rig stops the server by its pid

Reported: RSS before the readers, its peak and at the end, the budget, how far the peak went
past the budget (the goal: at most 100 MB), the most unsent answer bytes ``/status`` reported,
the most body bytes reserved, malloc's peak in-use bytes (``/status`` memory.allocator, heap
and mmapped), the resets counted in ``/metrics`` and how the readers' requests ended (429,
reset, an answer begun but never finished), probe p50/p99/max (the goal: p99 <= 100 ms). A
server that does not know ``send_timeout_s`` (an older checkout,
``GENRM_BENCH_SERVER_PYTHONPATH``) runs without it; the run says so (``send_timeout_s_set``
0). Ours only.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import subprocess
import sys
import time
from typing import Any

import h11
import msgspec
import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases.flood import _run_prober, _status
from genrm_trio.bench.cases.slow_disk import SERVER_PYTHONPATH
from genrm_trio.bench.loadgen import percentile
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import Rig, _rig

_READ_BYTES = 65536


def slow_readers_case(
    *,
    readers: int = 100,
    answer_bytes: int = 8_000_000,
    budget_bytes: int = 256 * 2**20,
    send_timeout_s: float = 5.0,
    hold_s: float = 15.0,
    n: int = 2,
    rcvbuf_bytes: int = 65536,
    sample_s: float = 0.25,
    probe_interval_s: float = 0.05,
    label: str = "100x8MB",
) -> Case:
    """The case (see the module docstring)."""
    params: dict[str, Any] = {
        "readers": readers, "answer_bytes": answer_bytes, "budget_bytes": budget_bytes,
        "send_timeout_s": send_timeout_s, "hold_s": hold_s, "n": n,
        "rcvbuf_bytes": rcvbuf_bytes, "sample_s": sample_s,
        "probe_interval_s": probe_interval_s,
        "server_pythonpath": os.environ.get(SERVER_PYTHONPATH),
    }

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        pythonpath = params["server_pythonpath"]
        env = {"PYTHONPATH": pythonpath} if pythonpath else {}
        knows_timeout = await trio.to_thread.run_sync(_knows_key, "send_timeout_s", pythonpath)
        extra = [("probe_port", "0"), ("max_active_bytes", str(budget_bytes))]
        if knows_timeout:
            extra.append(("send_timeout_s", repr(send_timeout_s)))
        settings = ServerSettings(n=n, collection_timeout_s=60.0, ours_extra=tuple(extra),
                                  ours_env=tuple(env.items()))
        async with _rig(ctx, kind, JudgeSettings(latency_ms=5.0), settings, tag) as rig:
            record = await _load(rig)
        record.metrics["send_timeout_s_set"] = float(knows_timeout)
        return record

    async def _load(rig: Rig) -> RunRecord:
        host, port = rig.server.host_port
        first = await _status(host, port)
        probe_port = int(first["config"]["probe_port"])
        group = f"{rig.run_tag}-big"
        big = _member(group, 0, "x" * answer_bytes)
        async with trio.open_nursery() as cohort:  # the cohort whose answer is replayed
            for slot in range(n):
                cohort.start_soon(rig.client.request, "POST", "/verify",
                                  big if slot == 0 else _member(group, slot, "short"))
        pid = rig.server.pid
        baseline = loadgen.read_proc_stats(pid).rss_bytes
        rss: list[float] = []
        unsent: list[float] = []
        bodies: list[float] = []  # reserved body bytes (MiB)
        heap: list[float] = []  # malloc's in-use bytes, heap and mmapped (MiB)
        free: list[float] = []  # malloc's free bytes inside its heap (MiB)
        probes: list[tuple[str, float, float, int]] = []
        ends: collections.Counter[str] = collections.Counter()

        async def sample(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            while True:
                rss.append(loadgen.read_proc_stats(pid).rss_bytes / 2**20)
                with trio.move_on_after(5.0):
                    status = await _status(host, port)
                    cohorts = status["cohorts"]
                    unsent.append(cohorts.get("unsent_answer_bytes", math.nan) / 2**20)
                    bodies.append(cohorts.get("body_bytes", math.nan) / 2**20)
                    allocator = (status.get("memory") or {}).get("allocator") or {}
                    heap.append((allocator.get("in_use_bytes", math.nan)
                                 + allocator.get("mmapped_bytes", math.nan)) / 2**20)
                    free.append(allocator.get("free_bytes", math.nan) / 2**20)
                await trio.sleep(sample_s)

        async def reader() -> None:
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
            stream: trio.SocketStream | None = None
            try:
                await sock.connect((host, port))
                stream = trio.SocketStream(sock)
                conn = h11.Connection(h11.CLIENT)
                await stream.send_all(
                    conn.send(h11.Request(method="POST", target="/verify", headers=[
                        ("Host", host), ("Content-Type", "application/json"),
                        ("Content-Length", str(len(big)))]))
                    + conn.send(h11.Data(data=big)) + conn.send(h11.EndOfMessage()))
                await trio.sleep(hold_s)  # ... reading nothing
                ends[await _how_it_ended(stream, conn)] += 1
            except (OSError, trio.BrokenResourceError):
                ends["reset_while_sending"] += 1
            finally:
                if stream is not None:
                    await stream.aclose()
                else:
                    sock.close()

        spec = {"targets": [["probe/healthz", host, probe_port, "/healthz"]],
                "interval_s": probe_interval_s, "timeout_s": 30.0}
        started = time.perf_counter()
        async with trio.open_nursery() as prober:
            stop_probing = await prober.start(_run_prober, spec, probes)
            async with trio.open_nursery() as sampling:
                await sampling.start(sample)
                async with trio.open_nursery() as readers_nursery:
                    for _ in range(readers):
                        readers_nursery.start_soon(reader)
                sampling.cancel_scope.cancel()
            load_s = time.perf_counter() - started
            await stop_probing()
        after = await _status(host, port)
        metrics_text = (await rig.client.get("/metrics")).body.decode("utf-8", "replace")
        took = [1000 * t for _, _, t, _ in probes]
        peak = max(rss, default=math.nan)
        budget_mb = budget_bytes / 2**20
        metrics: dict[str, float] = {
            "readers": float(readers),
            "answer_mb": len(big) / 1e6,
            "budget_mb": budget_mb,
            "baseline_rss_mb": baseline / 2**20,
            "peak_rss_mb": peak,
            "end_rss_mb": rss[-1] if rss else math.nan,
            "peak_over_budget_mb": peak - budget_mb,
            "unsent_peak_mb": max(unsent, default=math.nan),
            "bodies_peak_mb": max(bodies, default=math.nan),
            "malloc_in_use_peak_mb": max(heap, default=math.nan),
            "unsent_end_mb": after["cohorts"].get("unsent_answer_bytes", math.nan) / 2**20,
            "send_timeouts": _counter(metrics_text, "genrm_send_timeouts_total"),
            "ended_429": float(ends["429"]),
            "ended_reset": float(ends["reset"]),
            "ended_unfinished": float(ends["unfinished"]),
            "ended_200": float(ends["200"]),
            "probe_p50_ms": percentile(took, 0.5),
            "probe_p99_ms": percentile(took, 0.99),
            "probe_max_ms": max(took, default=math.nan),
            "probes": float(len(took)),
            "failed_probes": float(sum(1 for *_, code in probes if code != 200)),
            "load_s": load_s,
        }
        notes = {"ends": dict(ends), "cohorts_after": after.get("cohorts")}
        samples = {"rss_mb": rss, "unsent_mb": unsent, "body_mb": bodies,
                   "malloc_in_use_mb": heap, "malloc_free_mb": free, "probe_ms": took}
        return RunRecord(metrics, samples, notes)

    return Case("slow_readers", label, run, params, kinds=("ours",))


def _member(group: str, slot: int, text: str) -> bytes:
    return msgspec.json.encode({
        "responses_create_params": {"input": "Summarise the document."},
        "response": {"object": "response", "output": [{
            "type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": text}]}]},
        "_ng_group_id": group, "_ng_group_attempt": 0, "_ng_rollout_index": slot})


async def _how_it_ended(stream: trio.SocketStream, conn: h11.Connection) -> str:
    """Read what the server sent, for at most a few seconds: ``429`` (or another status) for a
    whole answer, ``reset`` for a connection that ended before its answer did, ``unfinished``
    for an answer still coming (a server that never gives up on a reader)."""
    status = 0
    with trio.move_on_after(5.0):
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(_READ_BYTES))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    return str(status)
                elif isinstance(event, h11.ConnectionClosed):
                    return "reset"
        except (OSError, trio.BrokenResourceError, h11.ProtocolError):
            return "reset"
    return "unfinished"


def _counter(text: str, name: str) -> float:
    """The value of the Prometheus sample ``name`` in ``text``; NaN when it is missing."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return math.nan


def _knows_key(key: str, pythonpath: str | None) -> bool:
    """Whether the server under test (run with ``pythonpath``) has config key ``key``."""
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    probe = ("import sys; from genrm_trio.config import Config; "
             f"sys.exit(0 if {key!r} in Config.__struct_fields__ else 1)")
    return subprocess.run([sys.executable, "-c", probe], env=env, check=False,
                          timeout=60).returncode == 0


def slow_readers_cases() -> list[Case]:
    """The preset: 100 readers of 8 MB answers, a 256 MiB budget, send_timeout_s 5 s."""
    return [slow_readers_case()]
