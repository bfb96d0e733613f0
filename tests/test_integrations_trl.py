"""The TRL hook (``genrm_trio/integrations/trl.py``) without TRL: the batch layout and group keys,
and the hook called the way TRL 1.16 calls an async reward function, on an asyncio loop in a
daemon thread while the calling thread waits on the future (``start_event_loop_in_daemon`` and
``asyncio.run_coroutine_threadsafe(...).result()`` in ``trl/trainer/grpo_trainer.py``), against
the real server in process on 127.0.0.1 port 0. ``tests/test_trl.py`` (opt-in) runs TRL itself.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
import trio

from genrm_trio.config import load_config
from genrm_trio.integrations.trl import GenRMReward, completion_response, prompt_input
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.serve import run_server

N = 4


@asynccontextmanager
async def server(n: int = N, judge: MockJudgeState | None = None) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        extra = []
        if judge is not None:
            judge_url = await nursery.start(
                lambda task_status: run_mock_judge(MockJudgeSettings(), state=judge,
                                                   task_status=task_status))
            extra = [f'judge.base_urls=["{judge_url}"]', "genrm_parse_retries=0"]
        cfg = load_config(None, ["port=0", f"num_rollouts_per_prompt={n}",
                                 "cohort_collection_timeout_s=30",
                                 "cohort_evaluation_timeout_s=30", *extra], {})
        url: str = await nursery.start(run_server, cfg)
        yield url
        nursery.cancel_scope.cancel()


@contextmanager
def trl_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An asyncio loop running forever in a daemon thread, as TRL starts one for async reward
    functions; stopped and closed on exit. The loop is made in its thread: trio-asyncio's
    event loop policy (installed with genrm-trio) refuses a new asyncio loop on a trio thread."""
    made: list[asyncio.AbstractEventLoop] = []
    ready = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        made.append(loop)
        ready.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait()
    try:
        yield made[0]
    finally:
        made[0].call_soon_threadsafe(made[0].stop)
        thread.join(10)


async def on_trl_loop(loop: asyncio.AbstractEventLoop,
                      call: Callable[[], Awaitable[list[float | None]]]) -> list[float | None]:
    """``call()`` on ``loop``, waited for from a worker thread, as TRL's training thread waits
    (the trio loop serving the server stays free)."""
    async def coro() -> list[float | None]:
        return await call()

    def wait() -> list[float | None]:
        return asyncio.run_coroutine_threadsafe(coro(), loop).result(timeout=120)

    return await trio.to_thread.run_sync(wait)


def batch(prompts: list[Any], n: int = N) -> tuple[list[Any], list[str]]:
    """A global batch as TRL's RepeatSampler lays it out: each prompt's n copies side by side,
    with a completion per row (distinct lengths, so the heuristic judge ranks them)."""
    rows = [p for p in prompts for _ in range(n)]
    completions = [f"completion {i} " + "word " * (i % 7) for i in range(len(rows))]
    return rows, completions


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"task {i}"}]


def cohort_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "cohort"]


@pytest.fixture
def cohort_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="genrm_trio.server"):
        yield caplog


def reward_for(index: int = 0, processes: int = 1, **kw: Any) -> GenRMReward:
    kw.setdefault("num_generations", N)
    return GenRMReward(kw.pop("url", "http://unused"), process_index=index,
                       num_processes=processes, run_id=kw.pop("run_id", "run"), **kw)


# ----------------------------------------------------------------------------- the mapping


def test_prompts_and_completions_become_responses_shapes() -> None:
    assert prompt_input("plain prompt") == "plain prompt"
    assert prompt_input([{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                           {"type": "image"}]}]) == [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "a"}]}]
    with pytest.raises(TypeError):
        prompt_input(7)
    plain = completion_response("the answer")
    assert [p["text"] for item in plain["output"] for p in item["content"]] == ["the answer"]
    chat = completion_response([{"role": "assistant", "content": "call"},
                                {"role": "tool", "content": "result"},
                                {"role": "assistant", "content": "final"}])
    assert [p["text"] for item in chat["output"] for p in item["content"]] == ["call", "final"]
    assert completion_response("x") == completion_response("x")  # a re-send digests alike


def test_every_process_names_the_same_cohort_for_a_straddling_group() -> None:
    """N = 4 and 6 rows per process: group 1 is slots 0-1 on process 0, 2-3 on process 1."""
    rows, completions = batch([conversation(i) for i in range(3)])
    members = []
    for p in range(2):
        part = slice(p * 6, (p + 1) * 6)
        members += reward_for(p, 2).members(rows[part], completions[part], {}, mode="train",
                                             call=0, global_step=5, n=N)
    assert [(m.group_id.split(":")[5], m.slot) for m in members] == [
        (f"g{g}", s) for g in range(3) for s in range(N)]
    keys = [m.group_id for m in members]
    assert len(set(keys)) == 3 and keys[4] == keys[7]  # process 0's and 1's halves
    assert keys[0].startswith("trl:run:train:s5:c0:g0:")
    assert members[0].responses_create_params == {"input": prompt_input(conversation(0))}
    assert members[0].response == completion_response(completions[0])


def test_the_same_prompt_twice_in_a_batch_is_two_cohorts() -> None:
    rows, completions = batch(["same", "same"])
    keys = [m.group_id for m in reward_for().members(rows, completions, {}, mode="train",
                                                     call=3, global_step=1, n=N)]
    assert len(set(keys)) == 2 and keys[0].rsplit(":", 2)[0] == keys[4].rsplit(":", 2)[0]
    assert keys[0].split(":")[-1] == keys[4].split(":")[-1]  # same prompt tag, other index


def test_an_id_column_tags_the_key_and_a_principle_column_is_sent() -> None:
    rows, completions = batch(["p0", "p1"])
    columns = {"task_id": [f"id-{i // N}" for i in range(8)],
               "principle": ["be exact"] * 8}
    members = reward_for(id_column="task_id").members(rows, completions, columns, mode="eval",
                                                      call=0, global_step=0, n=N)
    assert members[0].group_id == "trl:run:eval:s0:c0:g0:id-0"
    assert members[4].group_id.endswith(":g1:id-1")
    assert members[0].extra == {"principle": "be exact"}
    with pytest.raises(ValueError, match="id_column 'nope'"):
        reward_for(id_column="nope").members(rows, completions, columns, mode="train",
                                             call=0, global_step=0, n=N)


def test_a_batch_that_does_not_fit_n_is_refused() -> None:
    rows, completions = batch(["a", "b"])
    hook = reward_for()
    with pytest.raises(ValueError, match="different prompts"):
        hook.members(rows, completions, {}, mode="train", call=0, global_step=0, n=8)
    with pytest.raises(ValueError, match="whole number of groups"):
        hook.members(rows[:6], completions[:6], {}, mode="train", call=0, global_step=0, n=N)
    with pytest.raises(ValueError, match="completions"):
        hook.members(rows, completions[:3], {}, mode="train", call=0, global_step=0, n=N)


def test_bad_hook_settings_are_refused() -> None:
    for kwargs, match in (({"num_generations": 1}, "num_generations"),
                          ({"max_connections": 2}, "max_connections"),
                          ({"run_id": ""}, "run_id"),
                          ({"token_env": "GENRM_TEST_NO_SUCH_VARIABLE"}, "token_env")):
        with pytest.raises(ValueError, match=match):
            reward_for(**kwargs)
    with pytest.raises(ValueError, match="both"):
        GenRMReward("http://unused", num_generations=N, process_index=0)


def test_trl_sees_an_async_callable_with_a_name() -> None:
    """What TRL 1.16 checks (trainer/utils.py ``is_async_callable``, ``get_callable_name``):
    an ``async def __call__`` and a ``__name__``."""
    import inspect

    hook = reward_for(name="judge")
    assert inspect.iscoroutinefunction(hook.__call__)
    assert getattr(hook, "__name__", None) == "judge"


# ----------------------------------------------------------------------------- on TRL's loop


async def test_64_completions_at_a_bound_of_32_connections_on_trls_loop(
        cohort_log: pytest.LogCaptureFixture) -> None:
    """The pool bound: TRL awaits the hook on its one asyncio loop; 64 completions (16 groups)
    wait at once with 32 connections, no thread per member, and all are rewarded."""
    rows, completions = batch([conversation(i) for i in range(16)])
    async with server() as url:
        hook = reward_for(url=url, max_connections=32)
        with trl_loop() as loop:
            rewards = await on_trl_loop(loop, lambda: hook(
                prompts=rows, completions=completions, completion_ids=None,
                trainer_state=None))
    assert len(rewards) == 64 and all(isinstance(r, float) for r in rewards)
    lines = cohort_lines(cohort_log)
    assert len(lines) == 16
    assert {(r.kind, r.members) for r in lines} == {("completed", N)}  # type: ignore[attr-defined]


async def test_two_processes_slices_give_the_rewards_of_one(
        cohort_log: pytest.LogCaptureFixture) -> None:
    """A faithful simulation of TRL's per-process slices: process p scores rows
    [6p, 6p + 6) of a 12-row global batch (N = 4: group 1 straddles), each process on its own
    TRL loop, both at once. The rewards are those of the same batch scored by one process."""
    rows, completions = batch([conversation(i) for i in range(3)])
    async with server() as url:
        whole = reward_for(url=url, run_id="one")
        halves = [reward_for(p, 2, url=url, run_id="two") for p in range(2)]
        with trl_loop() as loop0, trl_loop() as loop1:
            expected = await on_trl_loop(loop0, lambda: whole(prompts=rows,
                                                              completions=completions))
            got: list[list[float | None]] = [[], []]

            async def process(p: int, loop: asyncio.AbstractEventLoop) -> None:
                part = slice(p * 6, (p + 1) * 6)
                got[p] = await on_trl_loop(loop, lambda: halves[p](
                    prompts=rows[part], completions=completions[part]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(process, 1, loop1)  # the second slice may come first
                nursery.start_soon(process, 0, loop0)
    assert got[0] + got[1] == expected and all(isinstance(r, float) for r in expected)
    lines = cohort_lines(cohort_log)
    assert len(lines) == 6 and {r.members for r in lines} == {N}  # type: ignore[attr-defined]


class FakeTrainer:
    """What the hook reads through TRL's ``log_metric`` argument (a bound method of the
    trainer): ``model.training`` and ``accelerator.process_index``."""

    def __init__(self, training: bool) -> None:
        self.model = type("Model", (), {"training": training})()
        self.accelerator = type("Accelerator", (), {"process_index": 0})()
        self.metrics: dict[str, list[float]] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(value)


async def test_a_masked_cohort_is_none_and_counted() -> None:
    rows, completions = batch(["masked prompt"])
    trainer = FakeTrainer(training=True)
    async with server(judge=MockJudgeState(fault=Fault.HTTP_503)) as url:
        hook = reward_for(url=url)
        with trl_loop() as loop:
            rewards = await on_trl_loop(loop, lambda: hook(
                prompts=rows, completions=completions, log_metric=trainer.log_metric))
    assert rewards == [None] * N
    assert trainer.metrics == {"genrm/masked": [1.0], "genrm/failed": [0.0]}


async def test_evaluation_uses_num_generations_eval_and_n_is_checked() -> None:
    rows, completions = batch(["eval prompt"], n=2)
    async with server(n=2) as url:
        hook = reward_for(url=url, num_generations_eval=2)
        with trl_loop() as loop:
            rewards = await on_trl_loop(loop, lambda: hook(
                prompts=rows, completions=completions,
                log_metric=FakeTrainer(training=False).log_metric))
            assert all(isinstance(r, float) for r in rewards) and len(rewards) == 2
            # Training rounds have 4 per prompt, the server 2: refused before sending.
            with pytest.raises(ValueError, match="num_rollouts_per_prompt is 2"):
                await on_trl_loop(loop, lambda: hook(
                    prompts=batch(["p"])[0], completions=batch(["p"])[1],
                    log_metric=FakeTrainer(training=True).log_metric))
    assert hook.calls == 2
