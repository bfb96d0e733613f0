"""``judge_client``: the judge client's CPU per call, from many ``POST /compare`` against a
slow judge."""

from __future__ import annotations

import math
import time

import msgspec
import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases.measure import to_ms
from genrm_trio.bench.loadgen import BodyFactory
from genrm_trio.bench.records import BenchContext, Case, JudgeSettings, RunRecord, ServerSettings
from genrm_trio.bench.rig import _rig


def judge_client_case(
    *, calls: int = 1024, n: int = 16, judge_ms: float = 1000.0, rounds: int = 2
) -> Case:
    """``calls`` judge calls in flight (``calls / n`` concurrent ``POST /compare`` of n answers,
    circular pairs: n calls each) against a slow judge: server CPU per judge call."""
    requests = calls // n

    async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
        judge = JudgeSettings(latency_ms=judge_ms)
        async with _rig(ctx, kind, judge, ServerSettings(n=n), tag) as rig:
            bodies = BodyFactory(seed=3, run_tag=rig.run_tag)
            encoder = msgspec.json.Encoder()
            statuses: list[int] = []

            def compare_body(i: int) -> bytes:
                members = [msgspec.json.decode(bodies.member(i, j)) for j in range(n)]
                return encoder.encode(
                    {
                        "conversation_history": members[0]["responses_create_params"]["input"],
                        "response_objs": [m["response"] for m in members],
                    }
                )

            payloads = [compare_body(i) for i in range(requests)]
            await rig.client.request("POST", "/compare", payloads[0])  # warm-up
            calls_before = await rig.judge_calls()
            before = rig.stats()
            start = time.perf_counter()
            for _ in range(rounds):
                async with trio.open_nursery() as nursery:
                    for body in payloads:

                        async def one(b: bytes = body) -> None:
                            try:
                                answer = await rig.client.request("POST", "/compare", b)
                                statuses.append(answer.status)
                            except loadgen.LoadgenError:
                                statuses.append(loadgen.TRANSPORT_ERROR)

                        nursery.start_soon(one)
            wall = time.perf_counter() - start
            after = rig.stats()
            made = await rig.judge_calls() - calls_before
            cpu_ms = to_ms(after.cpu_s - before.cpu_s)
            metrics = {
                "cpu_ms_per_judge_call": cpu_ms / made if made else math.nan,
                "judge_calls": float(made),
                "wall_s_per_round": wall / rounds,
                "failed_requests": float(sum(1 for s in statuses if s != 200)),
                "peak_rss_mb": after.peak_rss_bytes / 2**20,
            }
            return RunRecord(metrics)

    params = {"calls_in_flight": calls, "n": n, "judge_ms": judge_ms, "rounds": rounds}
    return Case("judge_client", f"{calls}-in-flight-judge{int(judge_ms)}ms", run, params)
