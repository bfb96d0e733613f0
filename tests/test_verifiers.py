"""verifiers 0.4.0's own NeMo Gym task against ``genrm-trio serve`` (issue 30; opt-in).

Marker ``verifiers``.

Run: ``python3 -m pytest -m verifiers tests/test_verifiers.py`` (needs ``pip install
verifiers==0.4.0``). What runs is verifiers' own code: ``NeMoGymTaskset.load()`` turns a JSONL
dataset into ``NeMoGymTask`` objects (one row per prompt), and each rollout calls the task's
``setup`` (``POST /seed_session``) and ``score`` (its ``@reward nemo_gym``: ``POST /verify`` with
the row plus ``response``, through ``NeMoGymState.post``, a new ``httpx.AsyncClient`` per request
with the task's ``request_timeout``, no retry). What does not run here is the part that needs a
policy model and a harness: the agent's run that fills the trace. Each rollout's trace is built
in the test with the message nodes a finished single-turn run leaves (the prompt, one sampled
assistant message), which is all ``trace_to_nemo_response`` reads. prime-rl's dispatcher
cancelling an episode is an asyncio cancellation of that rollout's task before it scores.

The rollouts of a group run together as verifiers runs them (``asyncio.gather``, one
``asyncio.run`` in a worker thread of the trio test), interleaved across groups; the server is a
``genrm-trio serve`` subprocess on 127.0.0.1 port 0 with its built-in (mock) judge and
``legacy_slots: arrival``.

Pool bound: verifiers bounds a run by ``--max-concurrent`` (default 128; ``EnvServer``'s
``asyncio.Semaphore`` for a served worker, held across the whole episode, scoring included) and
opens no shared connection pool for ``/verify``, so at the bound 128 rollouts wait on the server
at once: ``test_verifiers_128_rollouts_at_its_max_concurrent_bound_finish``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.process_helpers import get_json, http_call, run_asyncio, serve_process

INSTALL = "pip install verifiers==0.4.0"
pytestmark = pytest.mark.verifiers

#: verifiers' default ``NeMoGymTaskConfig.request_timeout`` (s); the tests keep it.
REQUEST_TIMEOUT_S = 60.0


def _verifiers() -> Any:
    vf = pytest.importorskip("verifiers", reason=INSTALL)
    if not str(getattr(vf, "__version__", "")).startswith("0.4."):
        pytest.skip(f"needs verifiers 0.4 (found {vf.__version__}): {INSTALL}")
    from verifiers.v1.tasksets import nemo_gym

    return nemo_gym


def _answer(p: int, i: int) -> str:
    return f"Answer {i} to prompt {p}: " + "because of physics. " * (i + 1)


def _tasks(tmp: Path, url: str, prompts: int,
           request_timeout: float = REQUEST_TIMEOUT_S) -> list[Any]:
    """verifiers' own tasks for ``prompts`` rows of a JSONL dataset, as its taskset loads them."""
    nemo_gym = _verifiers()
    dataset = tmp / "rows.jsonl"
    rows = [{"responses_create_params": {"input": [
        {"role": "user", "content": f"Prompt {p}: why is the sky blue?"}]}}
        for p in range(prompts)]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = nemo_gym.NeMoGymConfig(dataset=dataset, task=nemo_gym.NeMoGymTaskConfig(
        resources_url=url, request_timeout=request_timeout))
    tasks = list(nemo_gym.NeMoGymTaskset(config).load())
    assert [t.data.row for t in tasks] == rows
    return tasks


def _trace(task: Any, text: str) -> Any:
    """A rollout's trace as a finished single-turn run leaves it: the task's prompt messages
    and one sampled assistant message."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.tasksets.nemo_gym.toolset import NeMoGymState
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage

    nodes = [MessageNode(message=m, parent=i - 1 if i else None)
             for i, m in enumerate(task.data.prompt)]
    nodes.append(MessageNode(message=AssistantMessage(content=text), parent=len(nodes) - 1,
                             sampled=True))
    return Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                hash=task.hash),
                 agent=AgentInfo(config=AgentConfig()), state=NeMoGymState(), nodes=nodes)


async def _rollout(task: Any, trace: Any, generate: Callable[[], Awaitable[None]]) -> Any:
    """One rollout as verifiers runs it: the task's setup, the agent's run (``generate``), the
    task's scoring."""
    await task.setup(trace, None)  # NeMoGymTask.setup never reads its runtime
    await generate()
    await task.score(trace)
    return trace


async def _no_wait() -> None:
    await asyncio.sleep(0)


def _reward(trace: Any) -> float | None:
    reward = trace.rewards.get("nemo_gym")
    return None if reward is None else float(reward.score)


async def _counters(host: str, port: int) -> dict[str, float]:
    status, _, raw = await http_call(host, port, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in raw.decode().splitlines():
        if line.startswith("genrm_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_verifiers_two_prompts_by_four_rollouts_get_eight_rewards(tmp_path: Path) -> None:
    _verifiers()
    settings = ["num_rollouts_per_prompt=4", "legacy_slots=arrival",
                "cohort_collection_timeout_s=45", "cohort_evaluation_timeout_s=10"]
    async with serve_process(settings, tmp_path / "serve.log") as server:
        tasks = _tasks(tmp_path, server.url, 2)
        # Prompt 1's last two rollouts answer the same text (a low-temperature group): two
        # members. (Their bodies still differ: verifiers names each response by its trace id.)
        texts = {(p, i): _answer(p, min(i, 2) if p == 1 else i) for p in range(2) for i in range(4)}
        traces = [(p, i, _trace(tasks[p], texts[p, i])) for i in range(4) for p in range(2)]

        async def run() -> list[Any]:  # interleaved: no group is sent first
            return list(await asyncio.gather(*(_rollout(tasks[p], t, _no_wait)
                                               for p, _, t in traces)))

        await run_asyncio(run(), REQUEST_TIMEOUT_S)
        counters = await _counters(server.host, server.port)
        snapshot = (await get_json(server.host, server.port, "/status"))["cohorts"]

    rewards = [_reward(t) for _, _, t in traces]
    assert all(isinstance(r, float) for r in rewards), [t.errors for _, _, t in traces]
    for _, _, t in traces:
        info = t.info["nemo_gym"]
        assert info["mask_sample"] is False and info["genrm_cohort_scored"] == 4, info
    # Each group's four rollouts took the four slots of one cohort: no duplicate member.
    for p in range(2):
        slots = sorted(t.info["nemo_gym"]["_ng_rollout_index"] for q, _, t in traces if q == p)
        assert slots == [0, 1, 2, 3], (p, slots)
    assert counters["genrm_cohorts_opened_total"] == 2, counters
    assert counters["genrm_cohorts_completed_total"] == 2, counters
    assert counters.get("genrm_cohorts_partial_total", 0) == 0, counters
    assert snapshot["active_cohorts"] == 0 and snapshot["waiters"] == 0, snapshot


async def test_verifiers_group_with_a_cancelled_rollout_under_judge_present(
        tmp_path: Path) -> None:
    """prime-rl cancels a group's youngest episode: its rollout never scores. With
    ``judge_present`` and a collection deadline (3 s) below ``request_timeout`` (60 s), the
    three present rollouts get rewards from a partial cohort; the cancelled one gets nothing."""
    _verifiers()
    settings = ["num_rollouts_per_prompt=4", "legacy_slots=arrival",
                "incomplete_cohort_policy=judge_present", "min_cohort_members=2",
                "cohort_collection_timeout_s=3", "cohort_evaluation_timeout_s=10"]
    async with serve_process(settings, tmp_path / "serve.log") as server:
        (task,) = _tasks(tmp_path, server.url, 1)
        traces = [_trace(task, _answer(0, i)) for i in range(4)]

        async def run() -> tuple[list[Any], bool]:
            never = asyncio.Event()

            async def long_generation() -> None:
                await never.wait()

            youngest = asyncio.ensure_future(_rollout(task, traces[3], long_generation))
            present = asyncio.gather(*(_rollout(task, t, _no_wait) for t in traces[:3]))
            await asyncio.sleep(0.5)  # the youngest episode is set up and generating
            youngest.cancel()  # ... when the dispatcher cancels it
            try:
                await youngest
            except asyncio.CancelledError:
                cancelled = True
            else:
                cancelled = False
            return list(await present), cancelled

        # long before verifiers' own timeout
        _, cancelled = await run_asyncio(run(), REQUEST_TIMEOUT_S - 10)
        counters = await _counters(server.host, server.port)

    assert cancelled
    assert all(isinstance(_reward(t), float) for t in traces[:3]), [t.errors for t in traces]
    for t in traces[:3]:
        info = t.info["nemo_gym"]
        assert info["mask_sample"] is False, info
        assert info["genrm_cohort_expected"] == 4 and info["genrm_cohort_scored"] == 3, info
    assert sorted(t.info["nemo_gym"]["_ng_rollout_index"] for t in traces[:3]) == [0, 1, 2]
    assert traces[3].rewards == {} and "nemo_gym" not in traces[3].info  # never scored
    assert counters["genrm_cohorts_opened_total"] == 1, counters
    assert counters["genrm_cohorts_partial_total"] == 1, counters


async def test_verifiers_128_rollouts_at_its_max_concurrent_bound_finish(tmp_path: Path) -> None:
    """verifiers' bound (``--max-concurrent``, 128 episodes by default, scoring inside the
    permit; every ``/verify`` on its own connection): 128 rollouts of 32 prompts wait at once,
    interleaved (every prompt's first rollout first). A server that held fewer waiting
    requests than that (a pool of handlers) would hold the first rollouts of every group and
    none could complete: the ``fail_after`` (below the collection deadline and verifiers'
    ``request_timeout``, both raised here so that a busy machine, where each of verifiers'
    256 new ``httpx.AsyncClient`` costs tens of ms, cannot fail the test) says so."""
    _verifiers()
    prompts, per = 32, 4
    settings = [f"num_rollouts_per_prompt={per}", "legacy_slots=arrival",
                "cohort_collection_timeout_s=240", "cohort_evaluation_timeout_s=10"]
    async with serve_process(settings, tmp_path / "serve.log") as server:
        tasks = _tasks(tmp_path, server.url, prompts, request_timeout=300)
        traces = [(p, _trace(tasks[p], _answer(p, i))) for i in range(per) for p in range(prompts)]

        async def run() -> list[Any]:
            return list(await asyncio.gather(*(_rollout(tasks[p], t, _no_wait)
                                               for p, t in traces)))

        await run_asyncio(run(), 180)
        counters = await _counters(server.host, server.port)

    assert all(isinstance(_reward(t), float) for _, t in traces)
    for p in range(prompts):
        slots = sorted(t.info["nemo_gym"]["_ng_rollout_index"] for q, t in traces if q == p)
        assert slots == list(range(per)), (p, slots)
    assert counters["genrm_cohorts_opened_total"] == prompts, counters
    assert counters["genrm_cohorts_completed_total"] == prompts, counters
