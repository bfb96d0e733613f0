"""The ``flood`` bench preset: a memory flood of one-member cohorts, and probe latency during it.

A client bug that mints a fresh ``_ng_group_id`` per request opens a new cohort with every
request, and none ever completes (``num_rollouts_per_prompt`` is 2, one member is sent). Here
``uploaders`` tasks send such members of about 1 MB (a Responses object with one long
``output_text``) as fast as they can for ``duration_s``, each with up to ``sends_in_flight``
bodies being written at once, never waiting for an answer: an admitted member's answer would
come at the collection deadline, long after the run. Meanwhile liveness and readiness are
probed every ``probe_interval_s`` on the main port and on the probe port (``probe_port: 0``),
each probe on a fresh connection and timed to the answer's last byte, as kubelet does.

::

    flood_case(...).run                     one rig: mock judge (idle), genrm-trio serve
      +-- a prober process                  GET /healthz and /readyz on both ports every
      |                                     probe_interval_s, a task per probe, each bounded
      |                                     by probe_timeout_s; stopped by closing its stdin
      +-- sampler                           server RSS (/proc), the main port's accept queue
      |                                     (``ss``: connections not accepted yet)
      +-- for duration_s (or until the server's RSS passes rss_stop_bytes)
            +-- uploaders                   connect, send one member, hand the connection on
            +-- an answer reader per upload  429 counted and closed; an admitted member's
                                             connection stays open (its waiter waits), at
                                             most max_open of them (then the oldest closes)
      +-- probing stops (probes in flight finish); GET /status; every connection closed;
          the rig stops the server by its pid

Probes come from a process of their own so that their times are the server's, not the load
generator's event loop's. Reported: probe latency p50/p99/max per port and path, verifies/s
(members the server decided on, admitted or refused with 429, per second, until the ``/status``
taken after the load, which waits behind the queue too), the 429s, RSS over time and its peak
beside the server's ``max_active_bytes``, the accept queue's depth, server and load generator
CPU. ``memory_limit_bytes`` is set
(default 2 GiB) so that ``max_active_bytes: auto`` resolves to a quarter of it and the run
stays short on a large machine; that ``auto`` reads the real limit is unit-tested
(tests/test_memory.py). Ours only: NeMo Gym has neither the budget nor a probe port.
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import msgspec
import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.loadgen import percentile
from genrm_trio.bench.processes import stop_process
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import Rig, _rig

__all__ = ["flood_body", "flood_case", "prober_main"]

_WORDS = ("the model should explain each step clearly and check the result against the "
          "constraints given in the question before answering with a short summary").split()
_PROBE_PATHS = ("/healthz", "/readyz")
_STATUS_READ = 65536


def flood_body(size_bytes: int, extra_char: str = "") -> tuple[bytes, bytes]:
    """A one-member ``/verify`` body of about ``size_bytes`` as ``(head, tail)``: the group id
    goes between them (``head + id + tail``), so a request costs no encoding.
    ``extra_char`` ends the answer (an emoji makes the decoded text 4 bytes a character)."""
    text_chars = max(0, size_bytes - 700)
    unit = " ".join(_WORDS) + " "
    text = (unit * (text_chars // len(unit) + 1))[:text_chars - len(extra_char)] + extra_char
    body = {
        "responses_create_params": {"input": [{"role": "user", "content": "Summarise."}]},
        "response": {
            "id": "resp_flood", "object": "response", "created_at": 0, "model": "policy",
            "status": "completed", "parallel_tool_calls": False, "tool_choice": "auto",
            "tools": [],
            "output": [{"type": "message", "id": "msg_flood", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text,
                                     "annotations": []}]}],
        },
        "_ng_rollout_index": 0,
        "_ng_group_attempt": 0,
        "_ng_group_id": "\x00",
    }
    raw = msgspec.json.encode(body)
    head, tail = raw.split(b"\\u0000")
    return head, tail


class _Tally:
    def __init__(self) -> None:
        self.statuses: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.sent_bytes = 0


async def _probe(host: str, port: int, path: str, limit_s: float) -> tuple[float, int]:
    """One probe on a fresh connection: seconds to the answer's last byte, and its status
    (-1: the connection failed; 0: no answer within ``limit_s``, counted as ``limit_s``)."""
    started = time.perf_counter()
    status = 0
    with trio.move_on_after(limit_s):
        try:
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                conn = h11.Connection(h11.CLIENT)
                await stream.send_all(conn.send(h11.Request(
                    method="GET", target=path,
                    headers=[("host", f"{host}:{port}"), ("connection", "close")])) or b"")
                await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        break
        except (OSError, trio.BrokenResourceError, h11.ProtocolError):
            status = -1
    return time.perf_counter() - started, status


# -- the prober process ------------------------------------------------------------------------
# Probes are sent from a process of their own, as kubelet's are: timed inside the load
# generator, they would also measure its event loop, busy with a thousand uploads.


async def prober_main(spec: dict[str, Any]) -> None:
    """``python -m genrm_trio.bench.cases.flood SPEC``: every ``interval_s``, one probe of each
    target (``[name, host, port, path]``), each bounded by ``timeout_s``, until stdin closes;
    then the probes in flight finish. One JSON line per probe on stdout: ``[name, at_s,
    took_s, status]``, ``at_s`` from the start."""
    started = time.perf_counter()
    interval_s, timeout_s = float(spec["interval_s"]), float(spec["timeout_s"])

    async def one(name: str, host: str, port: int, path: str) -> None:
        at = time.perf_counter() - started
        took, status = await _probe(host, port, path, timeout_s)
        sys.stdout.write(json.dumps([name, round(at, 4), took, status]) + "\n")
        sys.stdout.flush()

    async with trio.open_nursery() as probes:
        async with trio.open_nursery() as ticking:

            async def tick(name: str, host: str, port: int, path: str) -> None:
                while True:
                    probes.start_soon(one, name, host, port, path)
                    await trio.sleep(interval_s)

            async def until_stdin_closes() -> None:
                async with trio.lowlevel.FdStream(os.dup(0)) as stdin:
                    while await stdin.receive_some():
                        pass
                ticking.cancel_scope.cancel()

            ticking.start_soon(until_stdin_closes)
            for name, host, port, path in spec["targets"]:
                ticking.start_soon(tick, name, host, int(port), path)


async def _run_prober(spec: dict[str, Any], results: list[tuple[str, float, float, int]], *,
                      task_status: trio.TaskStatus[Callable[[], Awaitable[None]]]
                      = trio.TASK_STATUS_IGNORED) -> None:
    """Run :func:`prober_main` as a child process, appending its lines to ``results``; reports
    the function that stops it (closes its stdin), and returns once it has exited. The
    process is stopped by its pid (SIGTERM, then SIGKILL) if this task is cancelled."""
    cmd = [sys.executable, "-m", "genrm_trio.bench.cases.flood", json.dumps(spec)]
    proc = await trio.lowlevel.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        task_status.started(proc.stdin.aclose)
        buffer = b""
        async for chunk in proc.stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                name, at, took, status = json.loads(line)
                results.append((name, at, took, status))
        await proc.wait()
    finally:
        await stop_process(proc, 5.0)


async def _accept_queue(port: int) -> float:
    """Connections waiting in the kernel's accept queue of ``port`` (``ss``'s Recv-Q of the
    listening socket); NaN when ``ss`` is missing or says nothing."""
    try:
        done = await trio.run_process(["ss", "-ltnH", f"sport = :{port}"],
                                      capture_stdout=True, check=False)
    except OSError:
        return math.nan
    for line in done.stdout.decode(errors="replace").splitlines():
        fields = line.split()
        if len(fields) > 1 and fields[1].isdigit():
            return float(fields[1])
    return math.nan


async def _status(host: str, port: int) -> dict[str, Any]:
    client = loadgen.H11Client(host, port)
    try:
        decoded: dict[str, Any] = msgspec.json.decode((await client.get("/status")).body)
        return decoded
    finally:
        await client.aclose()


def flood_case(
    label: str = "auto-2GiB",
    *,
    duration_s: float = 30.0,
    uploaders: int = 8,
    sends_in_flight: int = 1,
    body_bytes: int = 1_000_000,
    extra_char: str = "",
    memory_limit_bytes: int | None = 2 * 2**30,
    max_active_bytes: str = "auto",
    probe_interval_s: float = 0.15,
    probe_timeout_s: float = 30.0,
    sample_s: float = 0.25,
    max_open: int = 4000,
    rss_stop_bytes: int = 6 * 2**30,
) -> Case:
    """The flood case (see the module docstring). ``max_active_bytes`` is passed as given
    (``auto``, a number, ``null``); ``memory_limit_bytes`` None leaves it ``auto`` (the
    machine's memory: long runs on a large machine). The run also stops once the server's RSS
    passes ``rss_stop_bytes``, so an unlimited server cannot take the machine down."""
    extra = [("probe_port", "0"), ("max_active_bytes", max_active_bytes),
             ("cohort_collection_timeout_s", "3600")]
    if memory_limit_bytes is not None:
        extra.append(("memory_limit_bytes", str(memory_limit_bytes)))
    settings = ServerSettings(n=2, collection_timeout_s=3600.0, ours_extra=tuple(extra))
    params: dict[str, Any] = {
        "duration_s": duration_s, "uploaders": uploaders, "sends_in_flight": sends_in_flight,
        "body_bytes": body_bytes, "extra_char": extra_char,
        "memory_limit_bytes": memory_limit_bytes, "max_active_bytes": max_active_bytes,
        "probe_interval_s": probe_interval_s, "max_open": max_open,
    }

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        async with _rig(ctx, kind, JudgeSettings(latency_ms=0.0), settings, tag) as rig:
            return await _flood(rig)

    async def _flood(rig: Rig) -> RunRecord:
        host, port = rig.server.host_port
        pid = rig.server.pid
        first = await _status(host, port)
        probe_port = int(first["config"]["probe_port"])
        budget = first["config"]["max_active_bytes"]
        baseline_rss = loadgen.read_proc_stats(pid).rss_bytes
        head, tail = flood_body(body_bytes, extra_char)
        tally = _Tally()
        open_conns: collections.deque[trio.SocketStream] = collections.deque()
        probe_results: list[tuple[str, float, float, int]] = []
        t_s: list[float] = []
        rss_mb: list[float] = []
        cpu_s: list[float] = []
        queue: list[float] = []
        started = time.perf_counter()
        cpu_before = loadgen.read_proc_stats(pid).cpu_s
        own_before = time.process_time()
        stop = trio.Event()
        serial = 0

        async def read_answer(stream: trio.SocketStream) -> None:
            data = b""
            try:
                while b"\r\n" not in data:
                    chunk = await stream.receive_some(_STATUS_READ)
                    if not chunk:
                        tally.statuses["closed"] += 1
                        return
                    data += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                tally.statuses["closed"] += 1
                return
            code = data.split(b" ", 2)[1].decode(errors="replace")
            tally.statuses[code] += 1
            if stream in open_conns:
                open_conns.remove(stream)
            await stream.aclose()

        async def upload(answers: trio.Nursery, slots: trio.Semaphore) -> None:
            nonlocal serial
            serial += 1
            end = f"{rig.run_tag}-flood-{serial}".encode() + tail
            size = len(head) + len(end)
            request = (b"POST /verify HTTP/1.1\r\nHost: flood\r\n"
                       b"Content-Type: application/json\r\nContent-Length: "
                       + str(size).encode() + b"\r\n\r\n")
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError:
                tally.statuses["connect_failed"] += 1
                slots.release()
                return
            try:
                # Three writes, so the shared megabyte is never copied per request.
                for part in (request, head, end):
                    await stream.send_all(part)
            except (trio.BrokenResourceError, OSError):
                tally.statuses["send_failed"] += 1
                await stream.aclose()
                return
            except BaseException:
                await stream.aclose()
                raise
            finally:
                slots.release()
            tally.sent += 1
            tally.sent_bytes += size
            open_conns.append(stream)
            while len(open_conns) > max_open:
                await open_conns.popleft().aclose()
            answers.start_soon(read_answer, stream)

        async def uploader(answers: trio.Nursery, uploads: trio.Nursery) -> None:
            slots = trio.Semaphore(sends_in_flight)
            while True:
                await slots.acquire()
                uploads.start_soon(upload, answers, slots)

        async def sampler() -> None:
            while True:
                stats = loadgen.read_proc_stats(pid)
                rss = stats.rss_bytes
                t_s.append(time.perf_counter() - started)
                rss_mb.append(rss / 2**20)
                cpu_s.append(stats.cpu_s)
                queue.append(await _accept_queue(port))
                if rss > rss_stop_bytes:
                    stop.set()
                await trio.sleep(sample_s)

        targets = [[f"{side}{path}", host, probe_to, path]
                   for side, probe_to in (("main", port), ("probe", probe_port))
                   for path in _PROBE_PATHS]
        spec = {"targets": targets, "interval_s": probe_interval_s,
                "timeout_s": probe_timeout_s}
        async with trio.open_nursery() as prober:
            stop_probing = await prober.start(_run_prober, spec, probe_results)
            async with trio.open_nursery() as watch:
                watch.start_soon(sampler)
                async with trio.open_nursery() as answers:
                    async with trio.open_nursery() as uploads:
                        for _ in range(uploaders):
                            uploads.start_soon(uploader, answers, uploads)
                        with trio.move_on_after(duration_s):
                            await stop.wait()
                        uploads.cancel_scope.cancel()
                    load_s = time.perf_counter() - started
                    await stop_probing()  # probes in flight finish (main port: its queue)
                    # Before the connections close. It waits behind the accept queue, so it
                    # also counts the members sent but not decided on when the load stopped.
                    status = await _status(host, port)
                    decided_s = time.perf_counter() - started
                    rss_at_end = loadgen.read_proc_stats(pid)
                    answers.cancel_scope.cancel()
                watch.cancel_scope.cancel()
        own_s = time.process_time() - own_before
        while open_conns:
            await open_conns.popleft().aclose()
        cohorts = status["cohorts"]
        admitted = int(cohorts["active_cohorts"])
        refused = tally.statuses.get("429", 0)
        peak = max(rss_mb) if rss_mb else math.nan
        metrics: dict[str, float] = {
            "verifies_per_s": (admitted + refused) / decided_s,
            "admitted": float(admitted),
            "refused_429": float(refused),
            "sent_mb_per_s": tally.sent_bytes / 1e6 / load_s,
            "sent_gb": tally.sent_bytes / 1e9,
            "load_s": load_s,
            "decided_s": decided_s,
            "budget_mb": budget / 2**20 if isinstance(budget, int) else math.nan,
            "active_bytes_mb": int(cohorts["active_bytes"]) / 2**20,
            "baseline_rss_mb": baseline_rss / 2**20,
            "peak_rss_mb": peak,
            "final_rss_mb": rss_at_end.rss_bytes / 2**20,
            "accept_queue_max": max((q for q in queue if not math.isnan(q)), default=math.nan),
            "accept_queue_p50": percentile([q for q in queue if not math.isnan(q)], 0.5),
            "server_cpu_pct": 100.0 * (rss_at_end.cpu_s - cpu_before) / decided_s,
            "loadgen_cpu_pct": 100.0 * own_s / load_s,
        }
        probes: dict[str, list[float]] = {f"{side}{path}": [] for side in ("main", "probe")
                                          for path in _PROBE_PATHS}
        probe_at: dict[str, list[float]] = {name: [] for name in probes}
        probe_failures: collections.Counter[str] = collections.Counter()
        for name, at, took, probe_status in probe_results:
            probes[name].append(took)
            probe_at[name].append(at)
            if probe_status != 200:
                probe_failures[f"{name} {probe_status}"] += 1
        for name, values in probes.items():
            key = name.replace("/", "_")
            metrics[f"{key}_p50_ms"] = 1000 * percentile(values, 0.5)
            metrics[f"{key}_p99_ms"] = 1000 * percentile(values, 0.99)
            metrics[f"{key}_max_ms"] = 1000 * max(values, default=math.nan)
            metrics[f"{key}_probes"] = float(len(values))
        notes = {
            "statuses": dict(tally.statuses),
            "probe_failures": dict(probe_failures),
            "max_active_bytes_source": first["config"].get("max_active_bytes_source"),
            "memory_limit_source": first["config"].get("memory_limit_source"),
            "stopped_by_rss": stop.is_set(),
        }
        samples = {"t_s": t_s, "rss_mb": rss_mb, "server_cpu_s": cpu_s, "accept_queue": queue,
                   **{f"{name}_s": values for name, values in probes.items()},
                   **{f"{name}_at_s": values for name, values in probe_at.items()}}
        return RunRecord(metrics, samples, notes)

    def resize(seconds: float) -> Case:
        return flood_case(
            label, duration_s=seconds, uploaders=uploaders, sends_in_flight=sends_in_flight,
            body_bytes=body_bytes, extra_char=extra_char, memory_limit_bytes=memory_limit_bytes,
            max_active_bytes=max_active_bytes, probe_interval_s=probe_interval_s,
            probe_timeout_s=probe_timeout_s, sample_s=sample_s, max_open=max_open,
            rss_stop_bytes=rss_stop_bytes)

    return Case("flood", label, run, params, kinds=("ours",), resize=resize)


if __name__ == "__main__":
    trio.run(prober_main, json.loads(sys.argv[1]))
