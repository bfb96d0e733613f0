"""The ``hostile_body`` bench preset: one client sends a body of tiny JSON values every second.

A ``/verify`` body of about ``body_bytes`` (15 MB, under the default ``max_request_bytes`` of
16 MiB) made of one shape of tiny values (issue 26): ``objects`` (``{"x": [{}, {}, ...]}``),
``zeros``, ``empty_strings``, ``deep`` (arrays nested 60 deep, side by side), ``small_keys``
(one object of short keys), ``exponents`` (``1e300``, which msgspec parses on its exact path, 9
us each). ``at_bound`` is the worst body the default ``max_json_values`` accepts instead: short
strings, the costliest value per count to decode, up to the bound, then one long string up to
``body_bytes``; it is sent as a whole cohort of N, so it is admitted, judged and answered, and
every decode of its life is measured. The hostile client sends one every ``interval_s``, open
loop, each on a fresh connection bounded by ``hostile_timeout_s`` (a body the server accepts
waits for a cohort that never fills; the client leaves then). Meanwhile a healthy cohort of N
is sent every ``cohort_interval_s`` (first send to last answer, each bounded by
``client_timeout_s``), and a prober process (the flood preset's) times ``GET /healthz`` on the
probe port every ``probe_interval_s``, each on a fresh connection, from its own event loop.

::

    hostile_body_case(...).run          one rig: mock judge, genrm-trio serve (probe_port 0)
      +-- prober process                GET /healthz on probe_port every probe_interval_s
      +-- hostile sender                a task per body, started every interval_s
      +-- healthy cohorts               a task per cohort of N, every cohort_interval_s
      +-- GET /status; the rig stops the server by its pid

Reported: probe p50/p99/max, healthy cohorts rewarded and how many within 1 s, their
p50/p99/max, the hostile bodies' answers by status and how long each took, server CPU. The
goal (issue 26): probe p99 <= 100 ms and max <= 250 ms, every healthy cohort within 1 s.
``GENRM_BENCH_SERVER_PYTHONPATH`` (e.g. a checkout of an older commit) runs the server under
test from elsewhere, for before/after figures. Ours only.
"""

from __future__ import annotations

import collections
import math
import os
import time
from typing import Any

import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases.flood import _run_prober, _status
from genrm_trio.bench.cases.slow_disk import SERVER_PYTHONPATH
from genrm_trio.bench.loadgen import BodyFactory, CohortResult, CohortSpec, LoadgenError, percentile
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import Rig, _rig
from genrm_trio.wire import DEFAULT_MAX_JSON_VALUES, json_value_count

#: The shapes of :func:`hostile_body`, in the preset's order.
SHAPES = ("objects", "zeros", "empty_strings", "deep", "small_keys", "exponents", "at_bound")
#: A healthy cohort answered within this is on time (the issue's goal).
ON_TIME_S = 1.0
_UNITS = {"objects": b"{}", "zeros": b"0", "empty_strings": b'""',
          "deep": b"[" * 60 + b"0" + b"]" * 60, "exponents": b"1e300"}


def hostile_body(shape: str, body_bytes: int, group: str, slot: int = 0,
                 max_values: int = DEFAULT_MAX_JSON_VALUES) -> bytes:
    """A ``/verify`` member of group ``group`` (``_ng_rollout_index`` ``slot``) of about
    ``body_bytes`` whose key ``x`` holds ``shape`` (see the module docstring). Pure."""
    head = (b'{"responses_create_params":{"input":"Summarise."},"response":{"object":"response",'
            b'"output":[{"type":"message","role":"assistant","content":[{"type":"output_text",'
            b'"text":"a short answer"}]}]},"_ng_group_id":"' + group.encode()
            + b'","_ng_group_attempt":0,"_ng_rollout_index":' + str(slot).encode() + b',"x":')
    room = max(0, body_bytes - len(head) - 2)
    if shape == "small_keys":
        count = room // 12  # each key: "k000000":0,
        value = b"{" + b",".join(b'"k%06d":0' % i for i in range(count)) + b"}"
    elif shape == "at_bound":
        # Short strings to the bound (one counted value each), then one long string.
        base = json_value_count(head + b'[],"pad":""}')
        strings = b",".join([b'"abcdef"'] * (max_values - base + 1))
        pad = max(0, room - len(strings) - 12)
        value = b"[" + strings + b'],"pad":"' + b"a" * pad + b'"'
    else:
        unit = _UNITS[shape]
        value = b"[" + b",".join([unit] * (room // (len(unit) + 1))) + b"]"
    return head + value + b"}"


def hostile_body_case(
    shape: str,
    *,
    body_bytes: int = 15_000_000,
    interval_s: float = 1.0,
    duration_s: float = 10.0,
    n: int = 2,
    judge_ms: float = 20.0,
    cohort_interval_s: float = 0.5,
    client_timeout_s: float = 30.0,
    hostile_timeout_s: float = 10.0,
    probe_interval_s: float = 0.05,
) -> Case:
    """One body shape (see the module docstring)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    params: dict[str, Any] = {
        "shape": shape, "body_bytes": body_bytes, "interval_s": interval_s,
        "duration_s": duration_s, "n": n, "judge_ms": judge_ms,
        "cohort_interval_s": cohort_interval_s, "client_timeout_s": client_timeout_s,
        "hostile_timeout_s": hostile_timeout_s, "probe_interval_s": probe_interval_s,
        "server_pythonpath": os.environ.get(SERVER_PYTHONPATH),
    }

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        env = ({"PYTHONPATH": params["server_pythonpath"]} if params["server_pythonpath"]
               else {})
        settings = ServerSettings(n=n, collection_timeout_s=60.0,
                                  ours_extra=(("probe_port", "0"),),
                                  ours_env=tuple(env.items()))
        async with _rig(ctx, kind, JudgeSettings(latency_ms=judge_ms), settings, tag) as rig:
            return await _load(rig)

    async def _load(rig: Rig) -> RunRecord:
        host, port = rig.server.host_port
        first = await _status(host, port)
        probe_port = int(first["config"]["probe_port"])
        bodies = BodyFactory(seed=13, run_tag=rig.run_tag)
        sends = int(duration_s / interval_s)
        hostile = [[hostile_body(shape, body_bytes, f"{rig.run_tag}-hostile-{i}", slot)
                    for slot in range(n if shape == "at_bound" else 1)] for i in range(sends)]
        size = len(hostile[0][0])
        cohorts = int(duration_s / cohort_interval_s)
        results: list[CohortResult | None] = [None] * cohorts
        answers: collections.Counter[str] = collections.Counter()
        hostile_ms: list[float] = []
        probes: list[tuple[str, float, float, int]] = []
        hostile_client = loadgen.H11Client(host, port, max_idle=0)
        pid = rig.server.pid
        cpu_before = loadgen.read_proc_stats(pid).cpu_s

        async def healthy(index: int) -> None:
            with trio.move_on_after(client_timeout_s):
                results[index] = await loadgen.run_cohort(rig.client, bodies,
                                                          CohortSpec(index, n))

        async def one_hostile(raw: bytes) -> None:
            started = time.perf_counter()
            with trio.move_on_after(hostile_timeout_s):
                try:
                    answer = await hostile_client.request("POST", "/verify", raw)
                except LoadgenError:
                    answers["transport"] += 1
                else:
                    answers[str(answer.status)] += 1
                hostile_ms.append(1000 * (time.perf_counter() - started))
                return
            answers["timeout"] += 1

        async def hostile_sender() -> None:
            async with trio.open_nursery() as sending:
                for index, members in enumerate(hostile):
                    await _until(started + index * interval_s)
                    for raw in members:
                        sending.start_soon(one_hostile, raw)

        async def healthy_sender() -> None:
            async with trio.open_nursery() as sending:
                for index in range(cohorts):
                    # Offset by half a period from the hostile bodies, and open loop.
                    await _until(started + (index + 0.5) * cohort_interval_s)
                    sending.start_soon(healthy, index)

        spec = {"targets": [["probe/healthz", host, probe_port, "/healthz"]],
                "interval_s": probe_interval_s, "timeout_s": 30.0}
        started = time.perf_counter()
        try:
            async with trio.open_nursery() as prober:
                stop_probing = await prober.start(_run_prober, spec, probes)
                async with trio.open_nursery() as load:
                    load.start_soon(hostile_sender)
                    load.start_soon(healthy_sender)
                load_s = time.perf_counter() - started
                await stop_probing()
        finally:
            await hostile_client.aclose()
        status = await _status(host, port)
        cpu_s = loadgen.read_proc_stats(pid).cpu_s - cpu_before
        done = [r for r in results if r is not None]
        rewarded = [r for r in done if r.ok]
        latencies = [1000 * r.latency_s for r in rewarded]
        took = [1000 * t for _, _, t, _ in probes]
        metrics: dict[str, float] = {
            "body_mb": size / 1e6,
            "body_values": float(json_value_count(hostile[0][0])),
            "hostile_sent": float(sum(len(m) for m in hostile)),
            "hostile_413": float(answers["413"]),
            "hostile_200": float(answers["200"]),
            "hostile_timeouts": float(answers["timeout"]),
            "hostile_p50_ms": percentile(hostile_ms, 0.5),
            "hostile_max_ms": max(hostile_ms, default=math.nan),
            "cohorts": float(cohorts),
            "rewarded": float(len(rewarded)),
            "rewarded_within_1s": float(sum(1 for ms in latencies if ms <= 1000 * ON_TIME_S)),
            "cohort_p50_ms": percentile(latencies, 0.5),
            "cohort_p99_ms": percentile(latencies, 0.99),
            "cohort_max_ms": max(latencies, default=math.nan),
            "probe_p50_ms": percentile(took, 0.5),
            "probe_p99_ms": percentile(took, 0.99),
            "probe_max_ms": max(took, default=math.nan),
            "probes": float(len(took)),
            "failed_probes": float(sum(1 for *_, code in probes if code != 200)),
            "load_s": load_s,
            "server_cpu_pct": 100.0 * cpu_s / load_s,
        }
        notes = {"hostile_answers": dict(answers), "cohorts_after": status.get("cohorts")}
        samples = {"cohort_ms": latencies, "probe_ms": took, "hostile_ms": hostile_ms,
                   "probe_at_s": [at for _, at, _, _ in probes]}
        return RunRecord(metrics, samples, notes)

    def resize(seconds: float) -> Case:
        return hostile_body_case(
            shape, body_bytes=body_bytes, interval_s=interval_s, duration_s=seconds, n=n,
            judge_ms=judge_ms, cohort_interval_s=cohort_interval_s,
            client_timeout_s=client_timeout_s, hostile_timeout_s=hostile_timeout_s,
            probe_interval_s=probe_interval_s)

    return Case("hostile_body", shape, run, params, kinds=("ours",), resize=resize)


async def _until(at: float) -> None:
    """Sleep until ``time.perf_counter()`` reads ``at`` (open loop: not after the last send)."""
    await trio.sleep(max(0.0, at - time.perf_counter()))


def hostile_body_cases() -> list[Case]:
    """The preset: every shape of :data:`SHAPES`."""
    return [hostile_body_case(shape) for shape in SHAPES]
