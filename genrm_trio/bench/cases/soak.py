"""The ``soak`` bench preset: a long run at about half the server's capacity with judge faults,
client disconnects and hostile bodies, watching the server's memory and file descriptors.

::

    soak_case(...).run                          one rig: mock judge process, genrm-trio serve
      +-- capacity: closed-loop load              verifies/s with K cohorts in flight
      +-- mock judge fault plan                   a random mix of faults on fault_rate of calls
      +-- nursery for duration_s
            +-- sampler                           RSS (/proc/PID/status), open fds (/proc/PID/fd)
            +-- cohort arrivals (open loop)       normal | disconnect_retry | abandoned
            +-- hostile arrivals (open loop)      malformed, oversized, wrongly typed bodies ...
      +-- drain, idle, /status, verdict

Each request is classified by what it was and what came back. Expected: ``normal`` and
``disconnect_retry`` members get 200 (a reward, or the masked ``judge_failed`` answer when the
judge's faults exhaust a comparison's retries); the members that waited in an ``abandoned``
cohort (one member never sent) get 503 ``cohort_incomplete``; ``hostile`` requests get
400/405/413/415/422 with a JSON ``detail``. Anything else (a 5xx outside that, a transport error
on a request that did not hang up on purpose, a 4xx to a well-formed member) is unexpected.

The run fails (``failed_checks`` in its notes: ``genrm-trio bench`` exits 1) on any unexpected
answer, on RSS growth over the measured window beyond ``max(rss_tolerance_fraction x RSS at the
window's start, rss_tolerance_mb)``, on a leak (:func:`leak_checks`: descriptors by class,
judge sockets the pool does not hold, cohorts, on the idle server after the load's clients
closed and the keep-alive timeout passed against the idle server before the load; the
descriptors counted during the load are figures only), on a cohort or waiter left behind once
the load has stopped, or on an ERROR line in the server's log. The growth checks gate only
with ``gate_growth`` (the preset; a smoke run does not wait out the keep-alive for the leak
census either): how much a run of a few seconds grows depends on how many
requests the machine sends in them, so a smoke run reports growth without gating on it and
checks only what holds at any speed (no unexpected answer, nothing left over, no error
line). The window starts after ``warm_fraction`` of the run: records and the judge connection
pool fill up to their caps first, which is growth by design. A run of an hour or more
(``slope_gate_min_s``) gates RSS instead on the least-squares slope over the last half of its
load, under ``rss_slope_limit_mb_per_min`` (0.1 MB a minute): after any warm-up, it must stay
flat. Every sample also keeps ``/status``'s memory block (malloc's view, the bounded
structures' counts), and ``tracemalloc_frames`` records tracemalloc's top growers: the
method of bench/README.md, "Memory for hours".
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import msgspec
import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.descriptors import fd_census
from genrm_trio.bench.loadgen import BodyFactory, LoadPlan, percentile
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import Rig, _rig
from genrm_trio.config import Config
from genrm_trio.server.serve import _hypercorn_config

__all__ = [
    "CONNECTION_SLACK", "IdleSnapshot", "SoakSample", "hostile_requests", "last_half",
    "leak_checks", "memory_figures", "parse_soak_overrides",
    "rss_fit", "soak_case", "soak_checks",
]

_encode = msgspec.json.Encoder().encode
_HOSTILE_OK = frozenset({400, 405, 413, 415, 422})
_MAX_REQUEST_BYTES = 1024 * 1024
_EXAMPLES = 20


@dataclass(frozen=True)
class SoakSample:
    """One sample of the server process: seconds since the soak started, RSS bytes, open fds,
    its CPU seconds so far and the machine's 1-minute load average (for reading a stall)."""

    t_s: float
    rss_bytes: int
    fds: int
    cpu_s: float = 0.0
    load_avg: float = 0.0
    judge_connections: int = 0
    """Connections the server holds to the judge (``/status``): its pool keeps up to its
    idle cap open after a burst, which is bounded, so the descriptor check leaves them out."""
    memory: Mapping[str, float] = field(default_factory=dict)
    """``/status``'s memory block, flattened: the allocator's view (``allocator.*``), the
    sizes of the structures that grow with requests (``structures.*``), pymalloc's blocks and
    tracemalloc's total when tracing."""


def _window(samples: Sequence[SoakSample], warm_fraction: float) -> list[SoakSample]:
    if not samples:
        return []
    start = samples[0].t_s + warm_fraction * (samples[-1].t_s - samples[0].t_s)
    return [s for s in samples if s.t_s >= start]


def _slope_per_min(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute; NaN for fewer than two."""
    if len(points) < 2:
        return math.nan
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return math.nan
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def last_half(samples: Sequence[SoakSample], until_s: float | None = None) -> list[SoakSample]:
    """The samples of the second half of the run, by time: from the midpoint between the first
    sample and ``until_s`` (the end of the load; default the last sample) to ``until_s``.
    Pure."""
    if not samples:
        return []
    end = samples[-1].t_s if until_s is None else until_s
    start = samples[0].t_s + 0.5 * (end - samples[0].t_s)
    return [s for s in samples if start <= s.t_s <= end]


def rss_fit(samples: Sequence[SoakSample]) -> tuple[float, float]:
    """Least-squares line through (minutes, RSS MB) of ``samples``: (slope in MB per minute,
    RSS in MB at the first sample's time); NaNs for fewer than two distinct times. Pure."""
    points = [(s.t_s, s.rss_bytes / 2**20) for s in samples]
    slope = _slope_per_min(points)
    if math.isnan(slope):
        return math.nan, math.nan
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    return slope, mean_v - slope * (mean_t - points[0][0]) / 60.0


def soak_checks(
    samples: Sequence[SoakSample],
    *,
    unexpected: int,
    leftover: dict[str, int],
    warm_fraction: float,
    rss_tolerance_mb: float,
    rss_tolerance_fraction: float,
    gate_growth: bool = True,
    rss_slope_limit_mb_per_min: float | None = None,
    load_end_s: float | None = None,
) -> tuple[dict[str, float], list[str]]:
    """The soak's resource figures during the load and its failed checks (empty: passed); RSS
    growth is a failed check only with ``gate_growth``. Descriptors during the load are
    figures only (a busy process holds as many as its clients keep open): their gate is
    :func:`leak_checks`, on the idle process.

    ``rss_last_half_slope_mb_per_min`` is the least-squares slope of RSS over the last half of
    the load (samples up to ``load_end_s``, default all). With ``rss_slope_limit_mb_per_min``
    (long runs: see :func:`soak_case`) that slope is the RSS gate instead of the growth over
    the window: a long run may fill caches and pools for a while and must then stay flat.
    Pure."""
    window = _window(samples, warm_fraction)
    half = last_half(samples, load_end_s)
    failed: list[str] = []
    figures: dict[str, float] = {}
    if unexpected:
        failed.append(f"{unexpected} unexpected answers (see notes.unexpected_examples)")
    for name, count in leftover.items():
        if count:
            failed.append(f"{count} {name} left once the load stopped")
    if len(window) < 2:
        failed.append("fewer than two samples in the measured window")
        return figures, failed
    mid = window[len(window) // 2]
    first, last = window[0], window[-1]
    mb = 2**20
    figures.update({
        "rss_start_mb": first.rss_bytes / mb,
        "rss_mid_mb": mid.rss_bytes / mb,
        "rss_end_mb": last.rss_bytes / mb,
        "rss_max_mb": max(s.rss_bytes for s in window) / mb,
        "rss_slope_mb_per_min": _slope_per_min([(s.t_s, s.rss_bytes / mb) for s in window]),
        "fds_start": float(first.fds),
        "fds_mid": float(mid.fds),
        "fds_end": float(last.fds),
        "fds_max": float(max(s.fds for s in window)),
        "fds_slope_per_min": _slope_per_min([(s.t_s, float(s.fds)) for s in window]),
        "window_s": last.t_s - first.t_s,
    })
    rss_allowed = max(rss_tolerance_fraction * first.rss_bytes / mb, rss_tolerance_mb)
    rss_growth = (last.rss_bytes - first.rss_bytes) / mb
    figures["rss_growth_mb"] = rss_growth
    figures["rss_allowed_growth_mb"] = rss_allowed
    slope, intercept = rss_fit(half)
    figures["rss_last_half_slope_mb_per_min"] = slope
    figures["rss_last_half_fit_start_mb"] = intercept
    figures["rss_last_half_start_s"] = half[0].t_s if half else math.nan
    figures["rss_last_half_end_s"] = half[-1].t_s if half else math.nan
    if rss_slope_limit_mb_per_min is not None:
        figures["rss_slope_limit_mb_per_min"] = rss_slope_limit_mb_per_min
        if gate_growth and not slope < rss_slope_limit_mb_per_min:
            failed.append(f"RSS grew {slope:.3f} MB a minute over the last half of the load "
                          f"(allowed under {rss_slope_limit_mb_per_min:g})")
    elif gate_growth and rss_growth > rss_allowed:
        failed.append(f"RSS grew {rss_growth:.1f} MB over the window (allowed {rss_allowed:.1f})")
    tenth = max(1, len(window) // 10)

    def own(sample: SoakSample) -> float:
        return float(sample.fds - sample.judge_connections)

    fds_growth = (percentile([own(s) for s in window[-tenth:]], 0.5)
                  - percentile([own(s) for s in window[:tenth]], 0.5))
    figures["fds_growth"] = fds_growth
    figures["judge_connections_end"] = float(last.judge_connections)
    figures["judge_connections_max"] = float(max(s.judge_connections for s in window))
    return figures, failed


CONNECTION_SLACK = 2
"""How many more descriptors of one class the idle server may hold after the load than before
it: the soak's own ``/status`` connection is open at neither census, but a client that
connects meanwhile (a probe, a scrape) or a connection a moment from its close may be; a leak
is one descriptor a request or a connection (hundreds in a soak), not two."""

_COHORT_KEYS = ("active_cohorts", "collecting", "evaluating", "waiters", "active_bytes")


@dataclass(frozen=True)
class IdleSnapshot:
    """The server at rest: its descriptors by class (:func:`~genrm_trio.bench.descriptors.
    fd_census`), ``/status``'s cohort counts and the judge connections its pool holds."""

    fds: Mapping[str, int]
    cohorts: Mapping[str, int]
    judge_connections: int = 0


def leak_checks(
    before: IdleSnapshot, after: IdleSnapshot, *, slack: int = CONNECTION_SLACK,
) -> tuple[dict[str, float], list[str], list[str]]:
    """Compare the idle server after the load (its clients closed, the keep-alive timeout
    passed) with the idle server before it: (figures, failed checks, one report line per
    class compared). Fails on a descriptor class (a TCP role and state, pipes, files...) that
    grew by more than ``slack``; on judge sockets beyond the connections the judge pool says
    it holds plus ``slack`` (the pool keeps up to its idle cap by design: what it does not
    know of is a leak); on any cohort, waiter or active byte more than before. Pure."""
    failed: list[str] = []
    report: list[str] = []
    classes = sorted(set(before.fds) | set(after.fds))
    for name in classes:
        if name.startswith("tcp judge "):
            continue
        was, now = before.fds.get(name, 0), after.fds.get(name, 0)
        report.append(f"fds {name}: before {was}, after {now} (allowed {was + slack})")
        if now - was > slack:
            failed.append(f"{now - was} more '{name}' descriptors once idle after the load "
                          f"than before it ({was} -> {now}, allowed +{slack})")
    judge = sum(v for k, v in after.fds.items() if k.startswith("tcp judge "))
    report.append(f"fds tcp judge (all states): after {judge}, the pool holds "
                  f"{after.judge_connections} (allowed {after.judge_connections + slack})")
    if judge - after.judge_connections > slack:
        failed.append(f"{judge} judge sockets open once idle, the judge pool holds "
                      f"{after.judge_connections} (allowed +{slack})")
    for key in _COHORT_KEYS:
        was, now = before.cohorts.get(key, 0), after.cohorts.get(key, 0)
        report.append(f"cohorts {key}: before {was}, after {now} (allowed {was})")
        if now > was:
            failed.append(f"cohorts: {key} {was} before the load, {now} once idle after it")
    total_before, total_after = sum(before.fds.values()), sum(after.fds.values())
    figures = {
        "idle_fds_before": float(total_before),
        "idle_fds_after": float(total_after),
        "idle_fds_after_minus_judge": float(total_after - judge),
        "idle_judge_sockets_after": float(judge),
        "idle_accepted_close_wait_after": float(after.fds.get("tcp accepted CLOSE_WAIT", 0)),
    }
    return figures, failed, report


def hostile_requests(n: int, max_compare_responses: int) -> list[tuple[str, bytes]]:
    """Hostile raw HTTP requests, each a ``(name, bytes)`` pair; ``n`` is the cohort size the
    server expects (for an out-of-range slot). Every one must be refused with a 4xx naming the
    problem and change nothing. Pure."""
    member = {
        "responses_create_params": {"input": "hostile prompt"},
        "response": {"output": [{"type": "message", "content": [
            {"type": "output_text", "text": "hostile answer"}]}]},
        "_ng_group_id": "hostile", "_ng_group_attempt": 0, "_ng_rollout_index": 0,
    }

    def with_(**changes: Any) -> bytes:
        return _encode({**member, **changes})

    def request(method: str, path: str, body: bytes, *, content_type: str = "application/json",
                length: int | None = None) -> bytes:
        size = len(body) if length is None else length
        return (f"{method} {path} HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {size}\r\n\r\n").encode() + body

    deep = b"[" * 5000 + b"]" * 5000
    return [
        ("malformed_json", request("POST", "/verify", b'{"responses_create_params": {')),
        ("not_an_object", request("POST", "/verify", b"[1, 2, 3]")),
        ("wrong_types", request("POST", "/verify", _encode(
            {"responses_create_params": "x", "response": 5}))),
        ("slot_out_of_range", request("POST", "/verify", with_(_ng_rollout_index=n))),
        ("negative_attempt", request("POST", "/verify", with_(_ng_group_attempt=-1))),
        ("attempt_beyond_int64", request("POST", "/verify", with_(_ng_group_attempt=2**70))),
        ("deep_nesting", request("POST", "/verify",
                                 b'{"responses_create_params": {"input": ' + deep + b"}}")),
        ("long_group_id", request("POST", "/verify", with_(_ng_group_id="g" * 100_000))),
        ("invalid_utf8", request("POST", "/verify", b'{"a": "\xff\xfe"}')),
        ("wrong_content_type", request("POST", "/verify", with_(), content_type="text/plain")),
        ("oversized", request("POST", "/verify", b"{}", length=2 * _MAX_REQUEST_BYTES)),
        ("get_verify", request("GET", "/verify", b"")),
        ("compare_too_many", request("POST", "/compare", _encode(
            {"conversation_history": [], "response_objs": [{}] * (max_compare_responses + 1)}))),
        ("compare_wrong_types", request("POST", "/compare", _encode(
            {"conversation_history": 7, "response_objs": "x"}))),
        ("aggregate_wrong_types", request("POST", "/aggregate_metrics", _encode(
            {"verify_responses": [{"_ng_task_index": [1], "reward": "high"}]}))),
        ("aggregate_huge_int", request("POST", "/aggregate_metrics", b'{"verify_responses": '
                                       b'[{"_ng_task_index": 0, "reward": 1' + b"0" * 400
                                       + b"}]}")),
        ("seed_session_not_object", request("POST", "/seed_session", b'"just a string"')),
    ]


async def _raw_exchange(host: str, port: int, raw: bytes) -> tuple[int, bytes]:
    """Send raw request bytes on a fresh connection and read one answer (status, body).
    Raises :class:`loadgen.LoadgenError` when no answer comes."""
    conn = h11.Connection(h11.CLIENT)
    try:
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            # The server may answer (413) before the body is read; a send that fails then
            # does not matter when the answer is already on its way.
            try:
                await stream.send_all(raw)
            except (trio.BrokenResourceError, OSError):
                pass
            # The parser still expects to send this request: let it see its own bytes.
            conn.send(h11.Request(method="GET", target="/", headers=[("Host", "soak")]))
            conn.send(h11.EndOfMessage())
            status, chunks = 0, []
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return status, b"".join(chunks)
                elif isinstance(event, h11.ConnectionClosed):
                    raise loadgen.LoadgenError("closed before an answer")
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError,
            h11.ProtocolError) as exc:
        raise loadgen.LoadgenError(f"{type(exc).__name__}: {exc}") from exc


class _Tally:
    """Answers by class and outcome, plus examples of the unexpected ones."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.unexpected = 0
        self.examples: list[str] = []
        self.latencies: list[tuple[float, float]] = []  # (started at, seconds) of normal cohorts

    def add(self, klass: str, outcome: str, expected: bool, detail: str = "") -> None:
        self.counts[f"{klass} {outcome}"] += 1
        if not expected:
            self.unexpected += 1
            if len(self.examples) < _EXAMPLES:
                self.examples.append(f"{klass} {outcome}: {detail[:200]}")


def _member_outcome(result: loadgen.MemberResult) -> str:
    if result.status == loadgen.TRANSPORT_ERROR:
        return "transport_error"
    kind = result.failure_kind or ("reward" if result.reward is not None else "none")
    return f"{result.status} {kind}"


def soak_case(
    *,
    duration_s: float = 600.0,
    n: int = 8,
    judge_ms: float = 20.0,
    capacity_s: float = 10.0,
    capacity_k: int = 64,
    capacity_verifies_per_s: float | None = None,
    load_fraction: float = 0.5,
    fault_rate: float = 0.05,
    disconnect_fraction: float = 0.05,
    abandon_fraction: float = 0.05,
    hostile_fraction: float = 0.05,
    sample_s: float = 2.0,
    warm_fraction: float = 0.2,
    rss_tolerance_mb: float = 16.0,
    rss_tolerance_fraction: float = 0.10,
    connection_slack: int = CONNECTION_SLACK,
    keep_alive_wait_s: float | None = None,
    max_compare_responses: int = 128,
    collection_timeout_s: float = 30.0,
    gate_growth: bool = True,
    slope_gate_min_s: float = 3600.0,
    rss_slope_limit_mb_per_min: float = 0.1,
    tracemalloc_frames: int = 0,
    trace_s: float = 60.0,
    server_env: tuple[tuple[str, str], ...] = (),
    server_sets: tuple[tuple[str, str], ...] = (),
) -> Case:
    """The soak: ``duration_s`` of open-loop load at ``load_fraction`` of the capacity measured
    first (closed loop, ``capacity_k`` cohorts in flight for ``capacity_s``; or
    ``capacity_verifies_per_s`` given), cohorts of ``n``
    against a mock judge of ``judge_ms`` faulting on ``fault_rate`` of its calls. Of the cohorts,
    ``disconnect_fraction`` have one member hang up early and retry, ``abandon_fraction`` never
    send their last member; hostile requests arrive at ``hostile_fraction`` of the member rate.
    ``collection_timeout_s`` is long enough that a normal cohort (members sent within 20 ms)
    never meets it, even when a machine shared with other work stalls the load for seconds;
    the abandoned cohorts wait it out. ``gate_growth=False`` (smoke runs) reports RSS and
    descriptor growth without failing on it. A run of at least ``slope_gate_min_s`` gates RSS
    on the slope of its last half (under ``rss_slope_limit_mb_per_min``) instead of its growth
    over the window. The leak census waits ``keep_alive_wait_s`` after the load's clients
    closed (default: the server's keep-alive timeout plus 5 s when gating, else none) and
    allows ``connection_slack`` more descriptors of a class than before the load. See the
    module docstring for what passes. Ours only.

    Diagnostics (bench/README.md, "Memory for hours"): ``tracemalloc_frames`` > 0 starts the
    server with ``PYTHONTRACEMALLOC`` and records tracemalloc's top growers (by traceback,
    ``GET /debug/memory``, since the window's start) every ``trace_s``; ``server_env`` sets more
    variables for the server (``MALLOC_ARENA_MAX=2`` for an A/B of the allocator),
    ``server_sets`` more of its config keys (``malloc_trim_interval_s=null``)."""
    kwargs: dict[str, Any] = {
        "duration_s": duration_s, "n": n, "judge_ms": judge_ms, "capacity_s": capacity_s,
        "capacity_k": capacity_k, "capacity_verifies_per_s": capacity_verifies_per_s,
        "load_fraction": load_fraction, "fault_rate": fault_rate,
        "disconnect_fraction": disconnect_fraction, "abandon_fraction": abandon_fraction,
        "hostile_fraction": hostile_fraction, "sample_s": sample_s,
        "warm_fraction": warm_fraction, "rss_tolerance_mb": rss_tolerance_mb,
        "rss_tolerance_fraction": rss_tolerance_fraction,
        "connection_slack": connection_slack, "keep_alive_wait_s": keep_alive_wait_s,
        "max_compare_responses": max_compare_responses,
        "collection_timeout_s": collection_timeout_s, "gate_growth": gate_growth,
        "slope_gate_min_s": slope_gate_min_s,
        "rss_slope_limit_mb_per_min": rss_slope_limit_mb_per_min,
        "tracemalloc_frames": tracemalloc_frames, "trace_s": trace_s, "server_env": server_env,
        "server_sets": server_sets,
    }
    slope_limit = rss_slope_limit_mb_per_min if duration_s >= slope_gate_min_s else None
    idle_wait_s = (keep_alive_wait_s if keep_alive_wait_s is not None
                   else _server_keep_alive_s() + _KEEP_ALIVE_MARGIN_S if gate_growth else 0.0)
    env = dict(server_env)
    if tracemalloc_frames > 0:
        env["PYTHONTRACEMALLOC"] = str(tracemalloc_frames)
    params: dict[str, Any] = {
        "gate": True, "duration_s": duration_s, "n": n, "judge_ms": judge_ms,
        "load_fraction": load_fraction, "fault_rate": fault_rate,
        "disconnect_fraction": disconnect_fraction, "abandon_fraction": abandon_fraction,
        "hostile_fraction": hostile_fraction, "sample_s": sample_s,
        "warm_fraction": warm_fraction, "rss_tolerance_mb": rss_tolerance_mb,
        "rss_tolerance_fraction": rss_tolerance_fraction,
        "connection_slack": connection_slack, "keep_alive_wait_s": keep_alive_wait_s,
        "collection_timeout_s": collection_timeout_s, "gate_growth": gate_growth,
        "rss_slope_limit_mb_per_min": slope_limit, "tracemalloc_frames": tracemalloc_frames,
        "idle_wait_s": idle_wait_s,
        "server_env": env, "server_sets": dict(server_sets),
    }
    settings = ServerSettings(
        n=n, collection_timeout_s=collection_timeout_s, result_ttl_s=60.0,
        max_terminal_cohorts=2000,
        ours_extra=(("max_request_bytes", str(_MAX_REQUEST_BYTES)),
                    ("cohort_evaluation_timeout_s", "60"), ("judge_request_timeout_s", "10"),
                    ("max_compare_responses", str(max_compare_responses)), *server_sets),
        ours_env=tuple(sorted(env.items())),
    )
    hostile = hostile_requests(n, max_compare_responses)

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        if kind != "ours":
            return RunRecord({}, notes={"skipped": "the soak watches our server only"})
        async with _rig(ctx, kind, JudgeSettings(latency_ms=judge_ms), settings, tag) as rig:
            return await _soak(rig)

    async def _soak(rig: Rig) -> RunRecord:
        bodies = BodyFactory(seed=23, run_tag=rig.run_tag)
        host, port = rig.server.host_port
        pid = rig.server.pid
        peers = {rig.judge.host_port[1]: "judge"}
        before = await _idle_snapshot(rig, pid, peers)
        capacity = capacity_verifies_per_s
        if capacity is None:
            plan = LoadPlan(n=n, k=capacity_k, max_cohorts=1_000_000, duration_s=capacity_s,
                            first_cohort=10_000_000)
            measured = await loadgen.drive_load(rig.client, bodies, plan)
            capacity = measured.verifies / measured.wall_s if measured.wall_s else 0.0
        if not capacity > 0:
            raise RuntimeError("capacity measure rewarded nothing")
        member_rate = load_fraction * capacity
        cohort_interval_s = n / member_rate
        hostile_interval_s = 1.0 / max(hostile_fraction * member_rate, 0.1)
        await rig.judge_client.request(
            "POST", "/admin/fault", _encode({"fault": "none", "count": None, "rate": fault_rate}))
        tally = _Tally()
        samples: list[SoakSample] = []
        traces: list[dict[str, Any]] = []
        started = time.perf_counter()
        stop_at = started + duration_s
        rng = random.Random(29)
        in_flight = 0
        shed = 0
        max_in_flight = max(64, int(8 * member_rate * 1.0 / n))  # cohorts: ~8 s of arrivals

        status_misses = 0

        async def sample() -> None:
            nonlocal status_misses
            try:
                status = msgspec.json.decode((await rig.client.get("/status")).body)
            except loadgen.LoadgenError:
                # A machine shared with other work can overflow the listen backlog for a
                # moment: a missed /status is counted, the /proc figures are still sampled.
                status_misses += 1
                status = {}
            judge_connections = sum(int(e.get("clients") or 0)
                                    for e in status.get("judge", {}).get("endpoints", []))
            stats = loadgen.read_proc_stats(pid)
            with open("/proc/loadavg", encoding="ascii") as f:  # noqa: ASYNC230 - procfs
                load_avg = float(f.read().split()[0])
            samples.append(SoakSample(time.perf_counter() - started, stats.rss_bytes,
                                      loadgen.count_fds(pid), stats.cpu_s, load_avg,
                                      judge_connections, memory_figures(status)))

        async def sampler() -> None:
            while True:
                await sample()
                await trio.sleep(sample_s)

        async def tracer() -> None:
            """tracemalloc's top growers since the window's start, every ``trace_s``."""
            await trio.sleep(warm_fraction * duration_s)
            with contextlib.suppress(loadgen.LoadgenError):  # else the next one sets it
                await rig.client.get("/debug/memory?reset=1")
            while True:
                await trio.sleep(trace_s)
                try:
                    answer = msgspec.json.decode(
                        (await rig.client.get("/debug/memory?top=15")).body)
                except loadgen.LoadgenError as exc:
                    answer = {"error": str(exc)[:200]}
                traces.append({"t_s": round(time.perf_counter() - started, 1), **answer})

        async def member(klass: str, cohort: int, slot: int, delay_s: float) -> None:
            await trio.sleep(delay_s)
            result = await loadgen.send_member(rig.client, bodies.member(cohort, slot), slot)
            outcome = _member_outcome(result)
            if klass == "abandoned":
                expected = outcome == "503 cohort_incomplete"
            else:
                expected = result.status == 200 and (
                    result.reward is not None or result.failure_kind == "judge_failed")
            tally.add(klass, outcome, expected, f"cohort {cohort} slot {slot}")

        async def hang_up(cohort: int, slot: int, delay_s: float) -> None:
            """Send the member, hang up after ``delay_s``, then send it again (re-attaches, or
            replays if the cohort finished meanwhile)."""
            with trio.move_on_after(delay_s) as scope:
                await loadgen.send_member(rig.client, bodies.member(cohort, slot), slot)
            tally.counts["disconnect_retry hung_up" if scope.cancelled_caught
                         else "disconnect_retry answered_before_hang_up"] += 1
            await member("disconnect_retry", cohort, slot, 0.0)

        async def cohort_task(number: int, klass: str) -> None:
            nonlocal in_flight
            began = time.perf_counter()
            try:
                async with trio.open_nursery() as nursery:
                    slots = range(n - 1) if klass == "abandoned" else range(n)
                    for slot in slots:
                        delay = rng.uniform(0.0, 0.02)
                        if klass == "disconnect_retry" and slot == 0:
                            nursery.start_soon(hang_up, number, slot, rng.uniform(0.001, 0.05))
                        else:
                            nursery.start_soon(member, klass, number, slot, delay)
                if klass == "normal":
                    tally.latencies.append((began - started, time.perf_counter() - began))
            finally:
                in_flight -= 1

        async def hostile_task(name: str, raw: bytes) -> None:
            try:
                status, body = await _raw_exchange(host, port, raw)
            except loadgen.LoadgenError as exc:
                tally.add("hostile", f"{name} transport_error", False, str(exc))
                return
            try:
                detail = msgspec.json.decode(body).get("detail")
            except (msgspec.DecodeError, AttributeError):
                detail = None
            ok = status in _HOSTILE_OK and isinstance(detail, str) and bool(detail)
            tally.add("hostile", f"{name} {status}", ok, body.decode(errors="replace"))

        async def arrivals(traffic: trio.Nursery) -> None:
            nonlocal in_flight, shed
            number = 0
            next_at = time.perf_counter()
            while next_at < stop_at:
                await trio.sleep(max(0.0, next_at - time.perf_counter()))
                next_at += cohort_interval_s
                if in_flight >= max_in_flight:
                    shed += 1
                    continue
                roll = rng.random()
                klass = ("disconnect_retry" if roll < disconnect_fraction
                         else "abandoned" if roll < disconnect_fraction + abandon_fraction
                         else "normal")
                in_flight += 1
                traffic.start_soon(cohort_task, number, klass)
                number += 1

        async def hostile_arrivals(traffic: trio.Nursery) -> None:
            index = 0
            next_at = time.perf_counter()
            while next_at < stop_at:
                await trio.sleep(max(0.0, next_at - time.perf_counter()))
                next_at += hostile_interval_s
                name, raw = hostile[index % len(hostile)]
                index += 1
                traffic.start_soon(hostile_task, name, raw)

        async with trio.open_nursery() as watch:
            watch.start_soon(sampler)
            if tracemalloc_frames > 0:
                watch.start_soon(tracer)
            with trio.move_on_after(duration_s + collection_timeout_s + 120.0) as bounded:
                async with trio.open_nursery() as traffic:
                    traffic.start_soon(arrivals, traffic)
                    traffic.start_soon(hostile_arrivals, traffic)
            await sample()
            watch.cancel_scope.cancel()
        load_s = time.perf_counter() - started
        census_load_end = fd_census(pid, peers)
        await rig.client.aclose()
        closed_at = time.perf_counter()
        leftover = await _idle_status(rig, collection_timeout_s + 30.0)
        if bounded.cancelled_caught:
            leftover["requests unanswered at the drain bound"] = 1
        fds_idle = loadgen.count_fds(pid)
        census_closed = fd_census(pid, peers)
        closed_s = time.perf_counter() - closed_at
        # The leak gate's census: the load's clients closed, the server's keep-alive timeout
        # passed, so every connection the server still holds is one it should not.
        await rig.client.aclose()  # the connection _idle_status used
        quiet_at = time.perf_counter()
        timeline: list[dict[str, float]] = []
        while (waited := time.perf_counter() - quiet_at) < idle_wait_s:
            census = fd_census(pid, peers)
            timeline.append({"t_s": round(time.perf_counter() - closed_at, 1),
                             "fds": float(sum(census.values())),
                             **{k: float(v) for k, v in census.items()
                                if k.startswith("tcp accepted")}})
            await trio.sleep(min(5.0, idle_wait_s - waited))
        after = await _idle_snapshot(rig, pid, peers)
        leak_figures, leak_failed, leak_report = leak_checks(before, after,
                                                             slack=connection_slack)
        await rig.judge_client.request(
            "POST", "/admin/fault", _encode({"fault": "none", "count": None, "rate": 0.0}))
        judge_stats = msgspec.json.decode((await rig.judge_client.get("/admin/stats")).body)
        errors = await trio.to_thread.run_sync(_logged_errors, rig.server_log)
        leftover["error lines in the server log"] = len(errors)
        figures, failed = soak_checks(
            samples, unexpected=tally.unexpected, leftover=leftover,
            warm_fraction=warm_fraction, rss_tolerance_mb=rss_tolerance_mb,
            rss_tolerance_fraction=rss_tolerance_fraction,
            gate_growth=gate_growth, rss_slope_limit_mb_per_min=slope_limit,
            load_end_s=duration_s)
        if gate_growth:
            failed += leak_failed
        third = duration_s / 3
        early = [s for t, s in tally.latencies if t < third]
        late = [s for t, s in tally.latencies if t >= 2 * third]
        requests = sum(v for k, v in tally.counts.items() if not k.endswith(("hung_up",
                       "answered_before_hang_up")))
        metrics = {
            "capacity_verifies_per_s": capacity,
            "offered_verifies_per_s": member_rate,
            "answered_per_s": requests / load_s if load_s else math.nan,
            "requests": float(requests),
            "unexpected": float(tally.unexpected),
            "shed_cohorts": float(shed),
            "status_misses": float(status_misses),
            "latency_p50_ms_first_third": 1000 * percentile(early, 0.5),
            "latency_p99_ms_first_third": 1000 * percentile(early, 0.99),
            "latency_p50_ms_last_third": 1000 * percentile(late, 0.5),
            "latency_p99_ms_last_third": 1000 * percentile(late, 0.99),
            "fds_idle_after": float(fds_idle),
            "fds_idle_after_s": closed_s,
            "accepted_close_wait_after_close": float(
                census_closed.get("tcp accepted CLOSE_WAIT", 0)),
            **leak_figures,
            "judge_calls": float(judge_stats.get("calls", 0)),
            "judge_faults_injected": float(sum(judge_stats.get("faults_injected", {}).values())),
            **figures,
        }
        notes: dict[str, Any] = {
            "answers": dict(sorted(tally.counts.items())),
            "unexpected_examples": tally.examples,
            "faults_injected": judge_stats.get("faults_injected", {}),
            "failed_checks": failed,
            "leak_gate": {"compared": leak_report, "failed": leak_failed,
                          "gated": gate_growth, "idle_wait_s": idle_wait_s},
            "fd_classes": {"idle_before": dict(sorted(before.fds.items())),
                           "load_end": dict(sorted(census_load_end.items())),
                           "clients_closed": dict(sorted(census_closed.items())),
                           "idle_after": dict(sorted(after.fds.items()))},
            "idle_timeline": timeline,
            "leftover": leftover,
            "logged_errors": errors[:_EXAMPLES],
            "memory_end": dict(samples[-1].memory) if samples else {},
            "tracemalloc": traces,
        }
        memory_keys = sorted({k for s in samples for k in s.memory})
        return RunRecord(metrics, {
            "t_s": [s.t_s for s in samples],
            "rss_mb": [s.rss_bytes / 2**20 for s in samples],
            "fds": [float(s.fds) for s in samples],
            "server_cpu_s": [s.cpu_s for s in samples],
            "load_avg": [s.load_avg for s in samples],
            "judge_connections": [float(s.judge_connections) for s in samples],
            **{f"memory.{k}": [s.memory.get(k, math.nan) for s in samples]
               for k in memory_keys},
        }, notes)

    def resize(seconds: float) -> Case:
        return soak_case(**{**kwargs, "duration_s": seconds})

    return Case("soak", f"{duration_s:g}s-n{n}-load{load_fraction:g}", run, params,
                kinds=("ours",),
                resize=resize)


def memory_figures(status: Mapping[str, Any]) -> dict[str, float]:
    """``/status``'s memory block flattened to numbers (``allocator.heap_bytes``,
    ``structures.records``, ...); what is missing or not a number is left out. Pure."""
    memory = status.get("memory") or {}
    out: dict[str, float] = {}
    for key in ("rss_bytes", "python_blocks"):
        if isinstance(memory.get(key), int | float):
            out[key] = float(memory[key])
    gc_status = memory.get("gc") or {}
    for index, pending in enumerate(gc_status.get("pending") or []):
        out[f"gc.pending{index}"] = float(pending)
    for index, runs in enumerate(gc_status.get("collections") or []):
        out[f"gc.collections{index}"] = float(runs)
    for block in ("allocator", "trim"):
        for key, value in (memory.get(block) or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{block}.{key}"] = float(value)
    for key, value in (memory.get("tracemalloc") or {}).items():
        if isinstance(value, int | float) and key != "frames":
            out[f"tracemalloc.{key}"] = float(value)
    for key, value in (memory.get("structures") or {}).items():
        count = value.get("count") if isinstance(value, dict) else None
        if isinstance(count, int | float):
            out[f"structures.{key}"] = float(count)
    return out


_OVERRIDE_TYPES: Mapping[str, type] = {
    "load_fraction": float, "n": int, "judge_ms": float, "fault_rate": float,
    "disconnect_fraction": float, "abandon_fraction": float, "hostile_fraction": float,
    "sample_s": float, "warm_fraction": float, "capacity_verifies_per_s": float,
    "tracemalloc_frames": int, "trace_s": float, "rss_slope_limit_mb_per_min": float,
    "slope_gate_min_s": float, "connection_slack": int, "keep_alive_wait_s": float,
}


def parse_soak_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``--soak KEY=VALUE`` strings as :func:`soak_case` keyword arguments; ``env=NAME=VALUE``
    (repeatable) sets a variable for the server, ``set=KEY=VALUE`` one of its config keys
    (``set=malloc_trim_interval_s=null``). Raises ``ValueError`` naming the key. Pure."""
    out: dict[str, Any] = {}
    env: list[tuple[str, str]] = []
    sets: list[tuple[str, str]] = []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if key in ("env", "set") and "=" in value:
            name, _, val = value.partition("=")
            (env if key == "env" else sets).append((name.strip(), val))
            continue
        if not sep or key not in _OVERRIDE_TYPES:
            raise ValueError(f"--soak {item!r}: unknown key (one of env, set, "
                             f"{', '.join(_OVERRIDE_TYPES)})")
        try:
            out[key] = _OVERRIDE_TYPES[key](value)
        except ValueError:
            raise ValueError(f"--soak {key}: bad value {value!r}") from None
    if env:
        out["server_env"] = tuple(env)
    if sets:
        out["server_sets"] = tuple(sets)
    return out


def _logged_errors(path: Path | None) -> list[str]:
    """ERROR lines (and tracebacks) the server logged: an exception that escaped a request or
    a cohort is a bug even when the client got its answer. Blocks (file read)."""
    if path is None:
        return []
    text = path.read_text(errors="replace")
    return [line[:300] for line in text.splitlines()
            if '"level":"ERROR"' in line or " ERROR " in line or line.startswith("Traceback")]


_KEEP_ALIVE_MARGIN_S = 5.0
"""Waited past the server's keep-alive timeout before the leak census: Hypercorn's idle timer
runs from a connection's last answer, and a shared machine may run it a little late."""


def _server_keep_alive_s() -> float:
    """The keep-alive timeout ``genrm-trio serve`` gives Hypercorn (serve.py: no config key)."""
    return float(_hypercorn_config(Config()).keep_alive_timeout)


async def _idle_snapshot(rig: Rig, pid: int, peers: Mapping[int, str]) -> IdleSnapshot:
    """The idle server: its descriptors counted first (the soak's client closed: its own
    ``/status`` connection is in neither census), then ``/status``'s cohorts and judge
    connections."""
    await rig.client.aclose()
    fds = fd_census(pid, peers)
    status = msgspec.json.decode((await rig.client.get("/status")).body)
    judge = sum(int(e.get("clients") or 0) for e in status.get("judge", {}).get("endpoints", []))
    cohorts = {k: int(v) for k, v in (status.get("cohorts") or {}).items()
               if isinstance(v, int) and k in _COHORT_KEYS}
    await rig.client.aclose()
    return IdleSnapshot(dict(fds), cohorts, judge)


async def _idle_status(rig: Rig, limit_s: float) -> dict[str, int]:
    """Wait (bounded) until the server holds no active cohort and no waiter; what is left."""
    cohorts: dict[str, int] = {}
    with trio.move_on_after(limit_s):
        while True:
            answer = await rig.client.get("/status")
            cohorts = msgspec.json.decode(answer.body)["cohorts"]
            if cohorts.get("active_cohorts") == 0 and cohorts.get("waiters") == 0:
                break
            await trio.sleep(0.2)
    return {"active cohorts": int(cohorts.get("active_cohorts", -1)),
            "waiters": int(cohorts.get("waiters", -1))}
