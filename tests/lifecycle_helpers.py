"""Shared helpers for lifecycle tests: members, a scripted judge, a registry with leak checks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import msgspec
import trio

from genrm_trio import scoring, wire
from genrm_trio.config import Config
from genrm_trio.errors import JudgeFailed
from genrm_trio.server.cohort import CohortRegistry, Failure, Outcome, Rewarded
from genrm_trio.server.judge import JudgeRequest

PROMPT = "Explain why the sky is blue in two sentences."


def response_obj(text: str) -> dict[str, Any]:
    return {
        "id": "resp",
        "output": [
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": text}]},
        ],
    }


def answer(slot: int) -> str:
    tail = "shorter wavelengths scatter more. " * (slot + 1)
    return f"Rayleigh scattering, version {slot}: {tail}"


def body(slot: int | None, *, group: str | None = "g", attempt: int | None = 0,
         text: str | None = None, prompt: str = PROMPT, task: int | None = None,
         principle: str | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "responses_create_params": {"input": prompt},
        "response": response_obj(text if text is not None else answer(slot or 0)),
    }
    if slot is not None:
        out["_ng_rollout_index"] = slot
    if group is not None:
        out["_ng_group_id"] = group
    if attempt is not None:
        out["_ng_group_attempt"] = attempt
    if task is not None:
        out["_ng_task_index"] = task
    if principle is not None:
        out["principle"] = principle
    out.update(extra)
    return out


def member(cfg: Config, slot: int | None, **kw: Any) -> wire.VerifyMember:
    return wire.decode_verify(msgspec.json.encode(body(slot, **kw)), cfg.num_rollouts_per_prompt)


def heuristic_verdict(request: JudgeRequest) -> scoring.Verdict:
    text = scoring.heuristic_judge_text(request.history, request.response_1, request.response_2,
                                        request.principle)
    return scoring.parse_judge_output(text, 3.0, 3.5)


class ScriptedJudge:
    """A judge whose behaviour the test sets: ``latency_s`` per call, then ``mode`` ok/fail/hang."""

    def __init__(self, latency_s: float = 0.0, mode: str = "ok") -> None:
        self.latency_s = latency_s
        self.mode = mode
        self.calls = 0
        self.finished = 0
        self.cancelled = 0

    async def judge_pair(self, request: JudgeRequest, group: object = None,
                         trace: object = None) -> scoring.Verdict:
        self.calls += 1
        try:
            if self.latency_s:
                await trio.sleep(self.latency_s)
            if self.mode == "fail":
                raise JudgeFailed("judge http://judge.test/v1/responses: HTTP 503 after 4 attempts")
            if self.mode == "hang":
                await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        self.finished += 1
        return heuristic_verdict(request)


def reference_rewards(cfg: Config, texts: list[str], prompt: str = PROMPT) -> list[float]:
    history = scoring.conversation_history(prompt)
    pairs = scoring.comparison_pairs(len(texts), cfg.comparison_strategy,
                                     cfg.num_judges_per_comparison)
    comparisons = []
    for i, j, k in pairs:
        v = heuristic_verdict(JudgeRequest(history=history, response_1=texts[i],
                                           response_2=texts[j], principle=None))
        comparisons.append(scoring.Comparison(response_i=i, response_j=j, judge_idx=k,
                                              score_1=v.score_1, score_2=v.score_2,
                                              ranking=v.ranking))
    rewards, _ = scoring.aggregate(comparisons, [response_obj(t) for t in texts], cfg)
    return rewards


async def run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    """The journal writer's seam (Journal.writing's ``run_sync``) for the autojump clock: the
    blocking call runs on the Trio thread after a checkpoint. In a worker thread, the clock
    would jump past every deadline while SQLite works."""
    await trio.lowlevel.checkpoint()
    return fn(*args)


@asynccontextmanager
async def open_registry(cfg: Config, judge: Any, journal: Any = None,
                        run_sync: Callable[..., Any] | None = run_inline,
                        ) -> AsyncIterator[CohortRegistry]:
    """A registry in its own nursery (with ``journal``: inside the journal's writer, as
    `serve` runs it, each blocking call run by ``run_sync``). On exit, asserts nothing leaked:
    no active cohort, no waiter, no cohort task left (only retained records may remain)."""
    async with AsyncExitStack() as stack:
        if journal is not None:
            await stack.enter_async_context(journal.writing(run_sync=run_sync))
        registry = await stack.enter_async_context(CohortRegistry.open(cfg, judge, journal))
        yield registry
        await trio.testing.wait_all_tasks_blocked()
        snap = registry.snapshot()
        assert snap["active_cohorts"] == 0, snap
        assert snap["waiters"] == 0, snap
        assert snap["active_bytes"] == 0, snap
        assert not registry._nursery.child_tasks, registry._nursery.child_tasks
        assert snap["retained_records"] <= cfg.max_terminal_cohorts


class Outcomes:
    """Runs verify calls as tasks and records (time, outcome) per label."""

    def __init__(self, registry: CohortRegistry, nursery: trio.Nursery) -> None:
        self.registry = registry
        self.nursery = nursery
        self.results: dict[str, tuple[float, Outcome]] = {}
        self.scopes: dict[str, trio.CancelScope] = {}

    def send(self, label: str, m: wire.VerifyMember) -> None:
        scope = trio.CancelScope()
        self.scopes[label] = scope

        async def run() -> None:
            with scope:
                outcome = await self.registry.verify(m)
                self.results[label] = (trio.current_time(), outcome)

        self.nursery.start_soon(run)

    def disconnect(self, label: str) -> None:
        self.scopes[label].cancel()

    def reward(self, label: str) -> float:
        outcome = self.results[label][1]
        assert isinstance(outcome, Rewarded), outcome
        return outcome.reward

    def failure(self, label: str) -> Failure:
        outcome = self.results[label][1]
        assert isinstance(outcome, Failure), outcome
        return outcome
