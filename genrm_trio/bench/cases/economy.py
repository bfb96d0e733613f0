"""The ``economy`` benchmark preset: ``judge.routing`` least_loaded against cohort_affinity (with
prefix order and its warm-up call), side by side in one run, against mock judges that model an
engine's prefix cache (:mod:`genrm_trio.mock.prefix_cache`).

Each run starts E mock judge processes (``--prefix-cache SIZE``, ``prompt_token_s`` per
computed prompt token, ``output_token_s`` per output token, capacity C) and our server with all
E URLs, ``judge.max_concurrency_per_endpoint = C`` (so waiting calls wait on our side, where
routing sees them) and the arm's ``judge.routing``; then sends K cohorts of N members at once
(a ~1,500-token conversation, ~200-token answers) and waits for every answer.

Reported per arm: verifies/s and judge makespan (first send to last answer), the judges'
computed (uncached) prompt tokens against the analytic minimum (each distinct full block of the
step's prompts computed once, plus each prompt's partial last block), the cached-token fraction,
the summed judge busy time, and the per-endpoint load (busiest endpoint's busy time over the
mean). ``rewards_equal``: every member's reward equals the least_loaded arm's.

::

    economy_cases(params)                one Case per (strategy, K)
      +-- run: for each routing arm      E mock judges + server, fresh processes
            +-- K x loadgen.run_cohort   all at once, then /admin/stats of every judge
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from genrm_trio import scoring
from genrm_trio.bench import loadgen
from genrm_trio.bench.loadgen import BodyFactory, CohortResult, CohortSpec, H11Client
from genrm_trio.bench.processes import launch_process
from genrm_trio.bench.records import BenchContext, Case, RunRecord
from genrm_trio.bench.rig import READY_MOCK, READY_OURS
from genrm_trio.mock.prefix_cache import BLOCK_TOKENS, block_keys, prompt_tokens, render_prompt

ROUTINGS = ("least_loaded", "cohort_affinity")
PROMPT_CHARS = 6000  # about 1,500 tokens at 4 characters a token
ANSWER_CHARS = (760, 840)  # about 200 tokens


@dataclass(frozen=True)
class EconomyParams:
    """One economy sweep. Times per token are the mock engine's (seconds)."""

    n: int = 8
    endpoints: int = 2
    cohorts: tuple[int, ...] = (1, 4, 8)
    strategies: tuple[str, ...] = ("circular", "all_pairs")
    cache: str = "small"
    capacity: int = 4
    prompt_token_s: float = 2e-5
    output_token_s: float = 1e-3
    latency_ms: float = 5.0
    spill_factor: float = 1.5


def _bodies(tag: str) -> BodyFactory:
    return BodyFactory(seed=21, run_tag=tag, prompt_chars=PROMPT_CHARS, answer_chars=ANSWER_CHARS)


def analytic_minimum(bodies: BodyFactory, k: int, n: int, strategy: str) -> tuple[int, int]:
    """``(minimum computed prompt tokens, total prompt tokens)`` of the step's judge prompts
    as the mock judge renders them (``responses`` API, GenRM roles, no principle): every
    distinct full block computed once, every prompt's partial last block computed."""
    seen: set[bytes] = set()
    minimum = total = 0
    for cohort in range(k):
        members = [msgspec.json.decode(bodies.member(cohort, i)) for i in range(n)]
        history = scoring.conversation_history(members[0]["responses_create_params"]["input"])
        answers = [scoring.final_answer(m["response"]) for m in members]
        for i, j, _ in scoring.comparison_pairs(n, strategy, 1):
            prompt = render_prompt([*((m["role"], m["content"]) for m in history),
                                    ("response_1", answers[i]), ("response_2", answers[j])])
            keys = block_keys(prompt)
            tokens = prompt_tokens(prompt)
            total += tokens
            minimum += tokens - len(keys) * BLOCK_TOKENS
            for key in keys:
                if key not in seen:
                    seen.add(key)
                    minimum += BLOCK_TOKENS
    return minimum, total


class _Stats(msgspec.Struct):
    calls: int
    busy_s: float
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int


_stats = msgspec.json.Decoder(_Stats)


def _mock_command(params: EconomyParams) -> list[str]:
    return [sys.executable, "-m", "genrm_trio.mock.cli", "--port", "0",
            "--latency-ms", repr(params.latency_ms), "--capacity", str(params.capacity),
            "--prefix-cache", params.cache,
            "--set", f"prompt_token_s={params.prompt_token_s:.9f}",
            "--set", f"output_token_s={params.output_token_s:.9f}"]


def _server_command(urls: Sequence[str], params: EconomyParams, strategy: str,
                    routing: str) -> list[str]:
    exe = shutil.which("genrm-trio")
    cmd = [exe] if exe else [sys.executable, "-m", "genrm_trio.cli"]
    cmd += ["serve", "--host", "127.0.0.1", "--port", "0"]
    for url in urls:
        cmd += ["--judge-url", url]
    for key, value in (("num_rollouts_per_prompt", str(params.n)),
                       ("comparison_strategy", strategy), ("log_level", "WARNING"),
                       ("judge.routing", routing),
                       ("judge.affinity_spill_factor", repr(params.spill_factor)),
                       ("judge.max_concurrency_per_endpoint", str(params.capacity))):
        cmd += ["--set", f"{key}={value}"]
    return cmd


async def _one_arm(ctx: BenchContext, params: EconomyParams, strategy: str, k: int,
                   routing: str, label: str) -> tuple[dict[str, float], list[CohortResult]]:
    logs = ctx.out_dir / "logs"
    ctx.runs += 1
    tag = f"econ{ctx.runs}-{int(time.time())}"
    async with AsyncExitStack() as stack:
        judges = [await stack.enter_async_context(launch_process(
            _mock_command(params), log_path=logs / f"{label}-judge{e}.log",
            ready_prefix=READY_MOCK)) for e in range(params.endpoints)]
        server = await stack.enter_async_context(launch_process(
            _server_command([j.base_url for j in judges], params, strategy, routing),
            log_path=logs / f"{label}-ours.log", ready_prefix=READY_OURS))
        client = H11Client(*server.host_port)
        judge_clients = [H11Client(*j.host_port) for j in judges]
        stack.push_async_callback(client.aclose)
        for c in judge_clients:
            stack.push_async_callback(c.aclose)
        bodies = _bodies(tag)
        results: list[CohortResult] = []

        async def cohort(number: int) -> None:
            results.append(await loadgen.run_cohort(client, bodies, CohortSpec(number, params.n)))

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for number in range(k):
                nursery.start_soon(cohort, number)
        makespan = time.perf_counter() - started
        stats = [_stats.decode((await c.get("/admin/stats")).body) for c in judge_clients]
    minimum, total = analytic_minimum(bodies, k, params.n, strategy)
    computed = sum(s.computed_tokens for s in stats)
    busy = [s.busy_s for s in stats]
    results.sort(key=lambda c: c.cohort)
    metrics = {
        "makespan_s": makespan,
        "verifies_per_s": k * params.n / makespan if makespan > 0 else 0.0,
        "judge_calls": float(sum(s.calls for s in stats)),
        "computed_tokens": float(computed),
        "minimum_tokens": float(minimum),
        "over_minimum": computed / minimum if minimum else 0.0,
        "cached_fraction": sum(s.cached_tokens for s in stats) / max(1, total),
        "judge_busy_s": sum(busy),
        "load_max_over_mean": max(busy) / (sum(busy) / len(busy)) if sum(busy) > 0 else 0.0,
        "failed_groups": float(sum(1 for c in results if not c.ok)),
    }
    return metrics, results


def _rewards(results: Sequence[CohortResult]) -> list[tuple[int, int, float | None]]:
    return [(c.cohort, m.index, m.reward) for c in results for m in c.members]


def economy_cases(params: EconomyParams | None = None) -> list[Case]:
    """The ``economy`` preset: one case per (strategy, cohorts in flight); each run measures
    every routing arm on the same bodies, one after the other, each in fresh processes."""
    params = params or EconomyParams()

    def make(strategy: str, k: int) -> Case:
        name = f"n{params.n}-k{k}-{strategy}-{params.endpoints}ep-{params.cache}"

        async def run(ctx: BenchContext, kind: str, tag: str) -> RunRecord:
            metrics: dict[str, float] = {}
            rewards: dict[str, Any] = {}
            for routing in ROUTINGS:
                arm, results = await _one_arm(ctx, params, strategy, k, routing,
                                              f"{tag}-{name}-{routing}")
                metrics.update({f"{routing}:{key}": v for key, v in arm.items()})
                rewards[routing] = [r[2] for r in _rewards(results)]
            base, other = (f"{ROUTINGS[0]}:", f"{ROUTINGS[1]}:")
            metrics["computed_ratio"] = (metrics[base + "computed_tokens"]
                                         / max(1.0, metrics[other + "computed_tokens"]))
            metrics["makespan_ratio"] = (metrics[base + "makespan_s"]
                                         / max(1e-9, metrics[other + "makespan_s"]))
            metrics["rewards_equal"] = float(rewards[ROUTINGS[0]] == rewards[ROUTINGS[1]])
            return RunRecord(metrics)

        case_params = {"strategy": strategy, "k": k, **{
            key: value for key, value in vars(params).items()
            if key not in ("cohorts", "strategies")}}
        return Case("economy", name, run, case_params, kinds=("ours",))

    return [make(s, k) for s in params.strategies for k in params.cohorts]
