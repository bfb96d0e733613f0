"""The ``economy`` benchmark preset: ``judge.routing`` least_loaded against cohort_affinity (with
prefix order and the per-endpoint prefix queue), side by side in one run, against mock judges
that model an engine's prefix cache (:mod:`genrm_trio.mock.prefix_cache`), and the replacement
attempts that verdict reuse makes cheap.

Each run starts E mock judge processes (``--prefix-cache SIZE``, ``prompt_token_s`` per
computed prompt token, ``output_token_s`` per output token, capacity C) and our server with all
E URLs, ``judge.max_concurrency_per_endpoint = C`` (so waiting calls wait on our side, where
routing sees them) and the arm's ``judge.routing``; then sends K cohorts of N members at once,
member-major (member 0 of every cohort, then member 1, ...: as a step's rollouts finish, every
cohort opens before the first is complete), a ~1,500-token conversation and ~200-token
answers, and waits for every answer. Then, with the
judge's cache as the step left it, every cohort is sent again as a replacement attempt with k
of its N answers regenerated, for each k in ``replaced`` (attempt 1 + index; each k its own new
answers), one k after the other; and last, for k > 0, fresh groups with the same answers as the
replacement, whose rewards the replacement's must equal (``verdict_reuse: group``).

Reported per arm: verifies/s and judge makespan (first send to last answer), group latency p50
and p99 (a cohort's last send to its last answer), judge calls, the judges' computed (uncached)
prompt tokens against the analytic minimum (each distinct full block of the step's prompts
computed once, plus each prompt's partial last block), the cached-token fraction (hit rate),
the summed judge busy time, and the per-endpoint load (busiest endpoint's busy time over the
mean). Per replacement k: judge calls against the comparisons that touch a changed answer, and
computed tokens against the minimum counting what the step already computed.
``rewards_equal``: every member's reward equals the least_loaded arm's.

::

    economy_cases(params)                one Case per (strategy, K)
      +-- run: for each routing arm      E mock judges + server, fresh processes
            +-- K x loadgen.run_cohort   all at once, then /admin/stats of every judge
            +-- per k: K replacements    all at once, /admin/stats again
            +-- K fresh groups per k>0   the reference rewards
"""

from __future__ import annotations

import copy
import math
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from genrm_trio import scoring
from genrm_trio.bench import loadgen
from genrm_trio.bench.loadgen import BodyFactory, CohortResult, H11Client, MemberResult
from genrm_trio.bench.processes import launch_process
from genrm_trio.bench.records import BenchContext, Case, RunRecord, apply_overrides
from genrm_trio.bench.rig import READY_MOCK, READY_OURS
from genrm_trio.mock.engine import ENGINE_KINDS
from genrm_trio.mock.prefix_cache import (
    BLOCK_TOKENS,
    PREFIX_CACHE_SIZES,
    block_keys,
    parse_capacity,
    prompt_tokens,
    render_prompt,
)
from genrm_trio.mock.settings import MAX_STEP_TOKENS

ROUTINGS = ("least_loaded", "cohort_affinity")
JUDGE_ENGINES = ("unknown", "vllm", "sglang", "llama_cpp")
STRATEGIES = ("circular", "all_pairs")
PROMPT_CHARS = 6000  # about 1,500 tokens at 4 characters a token
ANSWER_CHARS = (760, 840)  # about 200 tokens
#: The mock judges' ``cache_report`` values (genrm_trio.mock.settings).
CACHE_REPORTS = ("usage", "timings", "both", "none")


@dataclass(frozen=True)
class EconomyParams:
    """One economy sweep. Times per token are the mock engine's (seconds). ``cache``: each
    mock judge's prefix-cache capacity as its ``--prefix-cache`` takes it (``off``, ``small``,
    ``large`` or a token count). ``engine``: the mock judges' time model, ``per_call`` or
    ``batched`` (:mod:`genrm_trio.mock.engine`; ``step_tokens`` its per-step budget).
    Raises ``ValueError`` naming the field for a value the run could not use."""

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
    replaced: tuple[int, ...] = (0, 1, 2)  # answers changed per replacement attempt
    engine: str = "per_call"  # the mock judges' time model (genrm_trio.mock.engine)
    step_tokens: int = 8192  # batched engine: prompt tokens per step (max_num_batched_tokens)
    judge_engine: str = "unknown"  # the server's judge.engine (which prefix waits it makes)
    # how the mock judges report cached tokens (genrm_trio.mock.settings): ``usage`` as
    # OpenAI/vLLM do, ``both`` as llama.cpp's server does (usage and its own ``timings``)
    cache_report: str = "usage"

    def __post_init__(self) -> None:
        try:
            parse_capacity(self.cache)
        except ValueError as exc:
            raise ValueError(f"cache: {exc}") from None
        if self.n < 2 or self.endpoints < 1 or self.capacity < 1:
            raise ValueError("need n >= 2, endpoints >= 1, capacity >= 1")
        if not self.cohorts or min(self.cohorts) < 1:
            raise ValueError("cohorts: one or more counts, each >= 1")
        if not self.strategies or not set(self.strategies) <= set(STRATEGIES):
            raise ValueError(f"strategies: one or more of {', '.join(STRATEGIES)}")
        if any(not 0 <= k <= self.n for k in self.replaced):
            raise ValueError(f"replaced: each in 0..n ({self.n})")
        for key in ("prompt_token_s", "output_token_s", "latency_ms"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise ValueError(f"{key}: a finite number >= 0")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine: one of {', '.join(ENGINE_KINDS)}")
        if self.judge_engine not in JUDGE_ENGINES:
            raise ValueError(f"judge_engine: one of {', '.join(JUDGE_ENGINES)} (judge.engine)")
        if self.cache_report not in CACHE_REPORTS:
            raise ValueError(f"cache_report: one of {', '.join(CACHE_REPORTS)}")
        if not 1 <= self.step_tokens <= MAX_STEP_TOKENS:
            raise ValueError(f"step_tokens: in 1..{MAX_STEP_TOKENS} (the mock's "
                             "engine_step_tokens)")
        if not 1.0 <= self.spill_factor <= 16.0:
            raise ValueError("spill_factor: in [1, 16] (judge.affinity_spill_factor)")

    @property
    def cache_tokens(self) -> int:
        """Each mock judge's prefix-cache capacity in tokens."""
        return parse_capacity(self.cache)

    def cache_label(self) -> str:
        """``small`` for a named setting, ``8192tok`` for a token count."""
        name = self.cache.strip()
        return name if name in PREFIX_CACHE_SIZES else f"{self.cache_tokens}tok"


_LIST_KEYS = frozenset({"cohorts", "strategies", "replaced"})


def parse_economy_overrides(items: Iterable[str],
                            base: EconomyParams | None = None) -> EconomyParams:
    """``--economy KEY=VALUE`` strings (``cache=8192``, ``cohorts=1,8``,
    ``strategies=all_pairs``) over ``base``. Raises ``ValueError`` naming the key for an unknown
    key or a bad value. Pure."""

    def convert(key: str, value: str) -> Any:
        if key in _LIST_KEYS:
            parts = tuple(v.strip() for v in value.split(",") if v.strip())
            return parts if key == "strategies" else tuple(int(v) for v in parts)
        if key in ("cache", "engine", "judge_engine", "cache_report"):
            return value.strip()
        if key in ("n", "endpoints", "capacity", "step_tokens"):
            return int(value)
        return float(value)

    return apply_overrides("--economy", items, base or EconomyParams(), convert)


def _bodies(tag: str) -> BodyFactory:
    return BodyFactory(seed=21, run_tag=tag, prompt_chars=PROMPT_CHARS, answer_chars=ANSWER_CHARS)


def _prompts(members: Sequence[dict[str, Any]], strategy: str) -> list[tuple[int, int, bytes]]:
    """``(i, j, prompt)`` of a cohort's comparisons as the mock judge renders them
    (``responses`` API, GenRM roles, no principle)."""
    history = scoring.conversation_history(members[0]["responses_create_params"]["input"])
    answers = [scoring.final_answer(m["response"]) for m in members]
    return [(i, j, render_prompt([*((m["role"], m["content"]) for m in history),
                                  ("response_1", answers[i]), ("response_2", answers[j])]))
            for i, j, _ in scoring.comparison_pairs(len(members), strategy, 1)]


def minimum_tokens(prompts: Sequence[bytes], seen: set[bytes]) -> tuple[int, int]:
    """``(minimum computed prompt tokens, total prompt tokens)`` of ``prompts``: every full
    block not in ``seen`` computed once (``seen`` is updated), every prompt's partial last
    block computed."""
    minimum = total = 0
    for prompt in prompts:
        keys = block_keys(prompt)
        tokens = prompt_tokens(prompt)
        total += tokens
        minimum += tokens - len(keys) * BLOCK_TOKENS
        for key in keys:
            if key not in seen:
                seen.add(key)
                minimum += BLOCK_TOKENS
    return minimum, total


def _members(bodies: BodyFactory, cohort: int, n: int) -> list[dict[str, Any]]:
    return [msgspec.json.decode(bodies.member(cohort, i)) for i in range(n)]


def analytic_minimum(bodies: BodyFactory, k: int, n: int, strategy: str,
                     seen: set[bytes] | None = None) -> tuple[int, int]:
    """``(minimum computed prompt tokens, total prompt tokens)`` of the step's judge prompts:
    every distinct full block computed once, every prompt's partial last block computed."""
    prompts = [p for c in range(k) for _, _, p in _prompts(_members(bodies, c, n), strategy)]
    return minimum_tokens(prompts, set() if seen is None else seen)


def replacement(members: Sequence[dict[str, Any]], attempt: int, changed: int) -> list[bytes]:
    """The bodies of a replacement attempt of a cohort (``members``, attempt 0): attempt
    ``attempt``, the first ``changed`` answers regenerated (a text of this attempt's own)."""
    out: list[bytes] = []
    for index, member in enumerate(members):
        body = copy.deepcopy(member)
        body["_ng_group_attempt"] = attempt
        if index < changed:
            content = body["response"]["output"][-1]["content"][0]
            content["text"] = f"(regenerated in attempt {attempt}) {content['text']}"
        out.append(_encode(body))
    return out


def fresh(bodies: Sequence[bytes], group: str) -> list[bytes]:
    """The same members as a new group (attempt 0): a fresh cohort judging them."""
    out: list[bytes] = []
    for raw in bodies:
        body = msgspec.json.decode(raw)
        body["_ng_group_id"] = group
        body["_ng_group_attempt"] = 0
        out.append(_encode(body))
    return out


_encode = msgspec.json.Encoder().encode


def touching(n: int, strategy: str, changed: int) -> int:
    """Comparisons of a cohort that touch one of its first ``changed`` answers."""
    return sum(1 for i, j, _ in scoring.comparison_pairs(n, strategy, 1)
               if i < changed or j < changed)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


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
            "--prefix-cache", str(params.cache_tokens),
            "--set", f"prompt_token_s={params.prompt_token_s:.9f}",
            "--set", f"output_token_s={params.output_token_s:.9f}",
            "--set", f"engine={params.engine}", "--set", f"engine_step_tokens={params.step_tokens}",
            "--set", f"cache_report={params.cache_report}"]


def _server_command(urls: Sequence[str], params: EconomyParams, strategy: str,
                    routing: str) -> list[str]:
    exe = shutil.which("genrm-trio")
    cmd = [exe] if exe else [sys.executable, "-m", "genrm_trio.cli"]
    cmd += ["serve", "--host", "127.0.0.1", "--port", "0"]
    for url in urls:
        cmd += ["--judge-url", url]
    for key, value in (("num_rollouts_per_prompt", str(params.n)),
                       ("comparison_strategy", strategy), ("log_level", "WARNING"),
                       ("judge.routing", routing), ("verdict_reuse", "group"),
                       ("judge.engine", params.judge_engine),
                       ("judge.affinity_spill_factor", repr(params.spill_factor)),
                       ("judge.max_concurrency_per_endpoint", str(params.capacity))):
        cmd += ["--set", f"{key}={value}"]
    return cmd


async def _send_group(client: H11Client, bodies: Sequence[bytes]) -> list[float | None]:
    """Send one group's members at once; their rewards in slot order (None: no reward)."""
    rewards: list[float | None] = [None] * len(bodies)

    async def one(index: int) -> None:
        rewards[index] = (await loadgen.send_member(client, bodies[index], index)).reward

    async with trio.open_nursery() as nursery:
        for index in range(len(bodies)):
            nursery.start_soon(one, index)
    return rewards


async def _groups(client: H11Client, groups: Sequence[Sequence[bytes]]
                  ) -> list[list[float | None]]:
    out: list[list[float | None]] = [[] for _ in groups]

    async def one(g: int) -> None:
        out[g] = await _send_group(client, groups[g])

    async with trio.open_nursery() as nursery:
        for g in range(len(groups)):
            nursery.start_soon(one, g)
    return out


async def _judge_stats(clients: Sequence[H11Client]) -> list[_Stats]:
    return [_stats.decode((await c.get("/admin/stats")).body) for c in clients]


async def _one_arm(ctx: BenchContext, params: EconomyParams, strategy: str, k: int,
                   routing: str, label: str) -> tuple[dict[str, float], list[CohortResult]]:
    logs = ctx.out_dir / "logs"
    ctx.runs += 1
    tag = f"econ{ctx.runs}-{int(time.time())}"
    metrics: dict[str, float] = {}
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
        answers: dict[tuple[int, int], MemberResult] = {}

        async def member(number: int, index: int) -> None:
            answers[number, index] = await loadgen.send_member(
                client, bodies.member(number, index), index)

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            # Member-major, as a step's rollouts finish: every cohort is open before the
            # first one is complete (cohort-major, the first is judged before the last opens).
            for index in range(params.n):
                for number in range(k):
                    nursery.start_soon(member, number, index)
        makespan = time.perf_counter() - started
        results = [CohortResult(c, tuple(answers[c, i] for i in range(params.n)))
                   for c in range(k)]
        stats = await _judge_stats(judge_clients)
        # Endpoints where cohort_affinity makes its prefix waits now (judge.engine: unknown
        # learns it during the step from the judges' cached tokens)
        status = msgspec.json.decode((await client.get("/status")).body)
        metrics["prefix_waits_endpoints"] = float(sum(
            bool(e.get("prefix_waits")) for e in status["judge"]["endpoints"]))
        seen: set[bytes] = set()
        minimum, total = analytic_minimum(bodies, k, params.n, strategy, seen)
        computed = sum(s.computed_tokens for s in stats)
        busy = [s.busy_s for s in stats]
        calls = [s.calls for s in stats]
        latencies = [c.latency_s for c in results]
        metrics.update({
            "makespan_s": makespan,
            "verifies_per_s": k * params.n / makespan if makespan > 0 else 0.0,
            "group_p50_s": percentile(latencies, 0.5),
            "group_p99_s": percentile(latencies, 0.99),
            "judge_calls": float(sum(calls)),
            "computed_tokens": float(computed),
            "minimum_tokens": float(minimum),
            "over_minimum": computed / minimum if minimum else 0.0,
            "cached_fraction": sum(s.cached_tokens for s in stats) / max(1, total),
            "judge_busy_s": sum(busy),
            "load_max_over_mean": max(busy) / (sum(busy) / len(busy)) if sum(busy) > 0 else 0.0,
            "calls_max_over_mean": (max(calls) / (sum(calls) / len(calls))
                                    if sum(calls) else 0.0),
            "failed_groups": float(sum(1 for c in results if not c.ok)),
        })
        originals = [_members(bodies, c, params.n) for c in range(k)]
        mismatched = 0
        for attempt, changed in enumerate(params.replaced, start=1):
            before = stats
            groups = [replacement(m, attempt, changed) for m in originals]
            rewards = await _groups(client, groups)
            stats = await _judge_stats(judge_clients)
            prompts = [p for g in groups for i, j, p in _prompts(
                [msgspec.json.decode(b) for b in g], strategy) if i < changed or j < changed]
            least, _ = minimum_tokens(prompts, seen)
            key = f"replace{changed}"
            metrics[f"{key}:judge_calls"] = float(
                sum(a.calls for a in stats) - sum(b.calls for b in before))
            metrics[f"{key}:touching_calls"] = float(k * touching(params.n, strategy, changed))
            metrics[f"{key}:computed_tokens"] = float(
                sum(a.computed_tokens for a in stats) - sum(b.computed_tokens for b in before))
            metrics[f"{key}:minimum_tokens"] = float(least)
            if changed == 0:
                expected = [[m.reward for m in c.members] for c in results]
            else:
                expected = await _groups(client, [
                    fresh(g, f"{tag}-fresh{attempt}-{c}") for c, g in enumerate(groups)])
                stats = await _judge_stats(judge_clients)  # the next k starts from here
            mismatched += sum(1 for got, want in zip(rewards, expected, strict=True)
                              if got != want or None in got)
        metrics["replacements_equal_fresh"] = float(mismatched == 0)
    return metrics, results


def _rewards(results: Sequence[CohortResult]) -> list[tuple[int, int, float | None]]:
    return [(c.cohort, m.index, m.reward) for c in results for m in c.members]


def economy_cases(params: EconomyParams | None = None) -> list[Case]:
    """The ``economy`` preset: one case per (strategy, cohorts in flight); each run measures
    every routing arm on the same bodies, one after the other, each in fresh processes."""
    params = params or EconomyParams()

    def make(strategy: str, k: int) -> Case:
        name = f"n{params.n}-k{k}-{strategy}-{params.endpoints}ep-{params.cache_label()}"
        if params.engine != "per_call":
            name += f"-{params.engine}"
        if params.judge_engine != "unknown":
            name += f"-{params.judge_engine}"
        if params.cache_report != "usage":
            name += f"-report_{params.cache_report}"

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

        case_params = {"strategy": strategy, "k": k, "cache_tokens": params.cache_tokens, **{
            key: value for key, value in vars(params).items()
            if key not in ("cohorts", "strategies")}}
        return Case("economy", name, run, case_params, kinds=("ours",))

    return [make(s, k) for s in params.strategies for k in params.cohorts]
