"""The HTTP driver: rounds of arrivals, duplicates, disconnects and judge faults (through the
mock judge's ``/admin/fault``) against a live server, each answer checked against the contract."""

from __future__ import annotations

import math
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import click
import trio
import trio.testing

from genrm_trio.config import Config
from genrm_trio.torture.contract import (
    PROMPTS,
    VERIFY_FAILURE_STATUS,
    answer_text,
    reference_rewards,
    response_object,
    verify_body,
)
from genrm_trio.torture.fuzz import bearer_headers


@dataclass(slots=True)
class HttpSummary:
    """Result of :func:`run_http_torture`."""

    rounds: int = 0
    requests: int = 0
    disconnects: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    hung: int = 0
    wall_s: float = 0.0


@dataclass(slots=True)
class _HttpRequest:
    group: int
    attempt: int
    slot: int
    variant: int
    disconnect_after_s: float | None
    status: int | None = None
    body: Any = None
    error: str | None = None
    hung: bool = False


#: Faults of the mock judge the HTTP driver cycles through (by their wire names).
HTTP_FAULTS = ("none", "503", "429", "reset", "truncated", "garbage", "empty", "nonfinite",
               "incomplete", "hang")


async def run_http_torture(
    url: str,
    *,
    judge_url: str | None = None,
    num_rollouts: int | None = None,
    max_requests: int = 200,
    time_limit_s: float = 60.0,
    hang_after_s: float = 30.0,
    seed: int = 0,
    check_rewards: bool = True,
    strategy: str | None = None,
    settle_s: float = 0.0,
    token: str | None = None,
) -> HttpSummary:
    """Drive a live ``/verify`` server over HTTP in rounds of a few groups each.

    Each round sets one mock-judge fault (``POST {judge_url}/admin/fault``; skipped without a
    judge URL), sends every member of its groups concurrently, with duplicates, conflicting
    answers, newer attempts and real client disconnects (the request task is cancelled, so the
    connection closes mid-wait), and checks every answer against the contract. A request not
    answered within ``hang_after_s`` is cancelled and counted as hung. Bounded by
    ``max_requests`` and ``time_limit_s`` (wall clock). Rewards are compared with the heuristic
    reference only in fault-free rounds, and only when ``check_rewards``. With ``settle_s > 0``
    the driver then waits that long (set it past the server's collection + evaluation deadlines)
    and checks through ``GET /status`` that no cohort or waiter was left behind. ``token``: the
    server's bearer token (``auth_token_env``), sent with every request to it.

    Blocks until done; cancellation stops it (open requests are abandoned with their client).
    Raises ``httpx2.HTTPError`` only if the server cannot be reached at all at the start.
    """
    import httpx2  # the HTTP driver is the only part of the tool that needs a client

    rng = random.Random(seed)
    summary = HttpSummary()
    started = time.perf_counter()
    run_id = uuid.UUID(int=rng.getrandbits(128)).hex[:12]
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(None), limits=limits,
                                  trust_env=False, headers=bearer_headers(token)) as client:
        server_cfg: dict[str, Any] = {}
        try:
            status = await client.get("/status")
            if status.status_code == 200:
                server_cfg = status.json().get("config", {}) or {}
        except (httpx2.HTTPError, ValueError):
            server_cfg = {}
        n = num_rollouts or int(server_cfg.get("num_rollouts_per_prompt", 0) or 0)
        if n < 2:
            raise click.UsageError(
                "cannot tell the server's num_rollouts_per_prompt (>= 2 needed): pass "
                "--num-rollouts")
        chosen = strategy or server_cfg.get("comparison_strategy", "circular")
        ref_cfg = Config(
            num_rollouts_per_prompt=n,
            comparison_strategy="all_pairs" if chosen == "all_pairs" else "circular",
            num_judges_per_comparison=int(server_cfg.get("num_judges_per_comparison", 1)),
        )
        judge = httpx2.AsyncClient(base_url=judge_url, timeout=httpx2.Timeout(10.0),
                                   trust_env=False) if judge_url else None
        try:
            round_no = 0
            while (summary.requests < max_requests
                   and time.perf_counter() - started < time_limit_s):
                fault = HTTP_FAULTS[round_no % len(HTTP_FAULTS)] if judge else "none"
                if judge is not None:
                    count = None if rng.random() < 0.5 else 1
                    await judge.post("/admin/fault", json={"fault": fault, "count": count})
                await _http_round(client, rng, summary, ref_cfg, f"{run_id}-r{round_no}",
                                  fault, hang_after_s, check_rewards)
                round_no += 1
                summary.rounds = round_no
            if settle_s > 0:
                await trio.sleep(settle_s)
                answer = await client.get("/status")
                if answer.status_code == 200:
                    cohorts = answer.json().get("cohorts", {})
                    for name in ("active_cohorts", "waiters"):
                        if cohorts.get(name):
                            summary.violations.append(
                                f"left behind {settle_s:g} s after the last round: "
                                f"{name} = {cohorts[name]}")
        finally:
            if judge is not None:
                with trio.move_on_after(5, shield=True):
                    await judge.post("/admin/fault", json={"fault": "none", "count": None})
                    await judge.aclose()
    summary.wall_s = time.perf_counter() - started
    return summary


async def _http_round(client: Any, rng: random.Random, summary: HttpSummary, cfg: Config,
                      round_id: str, fault: str, hang_after_s: float,
                      check_rewards: bool) -> None:
    import httpx2

    n = cfg.num_rollouts_per_prompt
    groups = rng.randint(1, 3)
    plan: list[_HttpRequest] = []
    for g in range(groups):
        attempt = 0
        for slot in range(n):
            plan.append(_HttpRequest(g, attempt, slot, 0, None))
        if rng.random() < 0.3:  # a duplicate, a conflicting answer
            plan.append(_HttpRequest(g, attempt, rng.randrange(n), 0, None))
            plan.append(_HttpRequest(g, attempt, rng.randrange(n), 1, None))
        if rng.random() < 0.2:  # the whole group again, as a newer attempt
            plan.extend(_HttpRequest(g, attempt + 1, slot, 0, None) for slot in range(n))
    for req in plan:
        if rng.random() < 0.15:
            req.disconnect_after_s = rng.uniform(0.0, 0.05)
    rng.shuffle(plan)
    group_ids = [f"torture-{round_id}-g{g}" for g in range(groups)]

    async def one(req: _HttpRequest) -> None:
        # Every HTTP group is an explicit-id group, unique to this run and round.
        body = verify_body(0, req.attempt, req.slot, req.variant, 0, [group_ids[req.group]])
        body["response"] = response_object(answer_text(req.group, req.attempt, req.slot,
                                                       req.variant) + f" [{round_id}]")
        limit = req.disconnect_after_s if req.disconnect_after_s is not None else hang_after_s
        with trio.move_on_after(limit) as scope:
            try:
                response = await client.post("/verify", json=body)
            except httpx2.HTTPError as exc:
                req.error = f"{type(exc).__name__}: {exc}"
                return
            req.status = response.status_code
            try:
                req.body = response.json()
            except ValueError:
                req.body = None
        if scope.cancelled_caught and req.disconnect_after_s is None:
            req.hung = True

    async with trio.open_nursery() as nursery:
        for req in plan:
            nursery.start_soon(one, req)
    summary.requests += len(plan)
    published: dict[tuple[int, int], dict[int, float]] = {}
    for req in plan:
        where = f"round {round_id} (fault {fault}) group {req.group} attempt {req.attempt} " \
                f"slot {req.slot} v{req.variant}"
        if req.disconnect_after_s is not None and req.status is None:
            summary.disconnects += 1
            continue
        if req.hung:
            summary.hung += 1
            summary.violations.append(f"{where}: no answer within {hang_after_s:g} s (hung)")
            continue
        if req.error is not None:
            summary.statuses["transport_error"] += 1
            summary.violations.append(f"{where}: transport error {req.error}")
            continue
        problem = check_http_answer(req.status or 0, req.body, req.slot, req.attempt)
        body = req.body if isinstance(req.body, dict) else {}
        kind = body.get("failure_kind") or "rewarded"
        summary.statuses[f"{req.status} {kind}"] += 1
        if problem:
            summary.violations.append(f"{where}: {problem}")
            continue
        if req.status == 200 and not body.get("mask_sample"):
            published.setdefault((req.group, req.attempt), {})[req.slot] = float(body["reward"])
    if not check_rewards or fault != "none":
        return
    history_input = PROMPTS[0]
    for (g, attempt), rewards in published.items():
        answers = [answer_text(g, attempt, s, 0) + f" [{round_id}]" for s in range(n)]
        alternatives = [answers]
        for s in range(n):  # the conflicting variant may have won its slot
            alt = list(answers)
            alt[s] = answer_text(g, attempt, s, 1) + f" [{round_id}]"
            alternatives.append(alt)
        refs = [reference_rewards(cfg, history_input, a) for a in alternatives]
        if not any(all(abs(ref[s] - r) <= 1e-9 for s, r in rewards.items()) for ref in refs):
            summary.violations.append(
                f"round {round_id} group {g} attempt {attempt}: rewards {rewards} match no "
                "reference computation")


def check_http_answer(status: int, body: Any, slot: int, attempt: int) -> str | None:
    """What is wrong with one ``/verify`` answer, or None. Pure."""
    if not isinstance(body, dict):
        return f"HTTP {status} without a JSON object body"
    if status == 200:
        reward = body.get("reward")
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return f"200 with reward {reward!r}"
        if body.get("_ng_rollout_index") != slot:
            return f"200 for slot {body.get('_ng_rollout_index')!r}, asked for slot {slot}"
        if body.get("_ng_group_attempt") != attempt:
            return f"200 for attempt {body.get('_ng_group_attempt')!r}, asked for {attempt}"
        if body.get("mask_sample"):
            if body.get("failure_kind") != "judge_failed" or reward != 0.0:
                return "masked 200 without failure_kind judge_failed and reward 0.0"
            reason = body.get("failure_reason")
            if not isinstance(reason, str) or not 0 < len(reason) <= 2000:
                return "masked 200 without a bounded failure_reason"
        elif body.get("failure_kind") is not None or body.get("mask_sample") is not False:
            return "unmasked 200 with failure markers"
        return None
    kind = body.get("failure_kind")
    if not isinstance(body.get("detail"), str):
        return f"HTTP {status} without a string detail"
    expected = VERIFY_FAILURE_STATUS.get(kind) if isinstance(kind, str) else None
    if expected is None or expected == 200:
        return f"HTTP {status} with failure_kind {kind!r}, not a contract kind"
    if expected != status:
        return f"failure_kind {kind!r} answered with HTTP {status} (contract: {expected})"
    if kind in ("bad_request", "bad_coordinates", "too_large"):
        return f"a well-formed member was refused with {kind!r}: {body['detail'][:200]}"
    return None
