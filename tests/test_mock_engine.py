"""The mock judge's batched engine (``engine: batched``): calls that run together share one
compute, so their prefills cost each other time while their decoding is batched; chunked
prefill; calls that arrive together compute a shared prefix once (none, without a cache); a
cancelled call leaves the batch. All on trio's autojump clock."""

from __future__ import annotations

import functools
from typing import Any

import httpx2
import pytest
import trio
import trio.testing

from genrm_trio.errors import ConfigError
from genrm_trio.mock.engine import BatchedEngine
from genrm_trio.mock.http import CHAT_PATH
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.prefix_cache import PrefixCache, block_keys, prompt_tokens
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState, settings_from_mapping

PROMPT_S = 0.01  # per prompt token computed
STEP_S = 0.001  # per step (each decoding call's output token)


def prompt(text: str) -> bytes:
    return (text * 400)[:400].encode()  # 400 bytes: 100 tokens, 6 full blocks


async def timed(engine: BatchedEngine, body: bytes, decode: int,
                out: dict[str, tuple[float, int]], name: str, delay: float = 0.0) -> None:
    await trio.sleep(delay)
    cached = await engine.serve(block_keys(body), prompt_tokens(body), decode)
    out[name] = (trio.current_time(), cached)


async def run_calls(engine: BatchedEngine, *calls: tuple[str, bytes, int, float]
                    ) -> dict[str, tuple[float, int]]:
    out: dict[str, tuple[float, int]] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        async with trio.open_nursery() as callers:
            for name, body, decode, delay in calls:
                callers.start_soon(timed, engine, body, decode, out, name, delay)
        nursery.cancel_scope.cancel()
    return out


def engine(step_tokens: int = 8192, cache_tokens: int = 16_384) -> BatchedEngine:
    return BatchedEngine(PrefixCache(cache_tokens), PROMPT_S, STEP_S, step_tokens)


async def test_one_call_pays_its_prefill_in_its_first_step_then_a_step_per_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    out = await run_calls(engine(), ("a", prompt("a"), 3, 0.0))
    # step 1: 100 prompt tokens and the first output token; steps 2, 3: one token each
    assert out["a"][0] - start == pytest.approx(100 * PROMPT_S + 3 * STEP_S)


async def test_calls_running_together_share_the_compute_and_batch_their_decoding(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    out = await run_calls(engine(), ("a", prompt("a"), 50, 0.0), ("b", prompt("b"), 50, 0.0))
    # Both prefills in one step (200 tokens: twice one call's), then 49 steps in which both
    # decode: as long as one call's decoding, not twice.
    for name in "ab":
        assert out[name][0] - start == pytest.approx(200 * PROMPT_S + 50 * STEP_S)
    # per_call would have been 100 * PROMPT_S + 50 * 0.001 each: the prefills did cost each
    # other, the decoding did not
    assert out["a"][0] - start > 100 * PROMPT_S + 50 * STEP_S + 0.5


async def test_a_step_computes_at_most_its_token_budget_oldest_call_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    out = await run_calls(engine(step_tokens=60), ("a", prompt("a"), 1, 0.0),
                          ("b", prompt("b"), 1, 0.0))
    # 200 prompt tokens at 60 a step: the call that joined first (trio starts the two in
    # either order) gets 60, then 40 (+20 of the other), the other 40 and 40 more: one is
    # done after step 2, the other after step 4.
    first, second = sorted(end - start for end, _ in out.values())
    assert first == pytest.approx(120 * PROMPT_S + 2 * STEP_S)
    assert second == pytest.approx(200 * PROMPT_S + 4 * STEP_S)


async def test_calls_that_arrive_together_compute_their_shared_prefix_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    same = prompt("s")
    start = trio.current_time()
    out = await run_calls(engine(), ("first", same, 1, 0.0), ("twin", same, 1, 0.0),
                          ("later", same, 1, 5.0))
    # whichever of the two was planned first computed the 6 full blocks in the step they
    # share; the other found them (as vLLM caches a block when it schedules it)
    assert sorted((out["first"][1], out["twin"][1])) == [0, 96]
    assert out["later"][1] == 96
    assert out["first"][0] - start == pytest.approx((100 + 4) * PROMPT_S + STEP_S)
    # without a cache both compute everything
    out = await run_calls(engine(cache_tokens=0), ("first", same, 1, 0.0),
                          ("twin", same, 1, 0.0))
    assert out["first"][1] == out["twin"][1] == 0


async def test_a_cancelled_call_leaves_the_batch_and_the_others_go_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batched = engine()
    done: dict[str, tuple[float, int]] = {}
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batched.run)
        # both prefills take the first step (2.001 s), short's one token with them; cancel
        # while long decodes
        with trio.move_on_after(2.5):
            await run_calls_inside(batched, done)
        assert "long" not in done and done["short"][0] - start == pytest.approx(2.001)
        # the short call was done; the engine still serves a new call by itself
        await timed(batched, prompt("n"), 1, done, "new")
        await trio.sleep(STEP_S)  # one more step: the engine drops what is gone
        assert batched.running == 0  # the long call (10,000 tokens to go) left the batch
        nursery.cancel_scope.cancel()
    assert done["new"][0] - start < 2.5 + 100 * PROMPT_S + 0.01
    assert batched.batch_peak == 2


async def test_a_call_cancelled_mid_prefill_takes_nothing_of_the_next_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batched = engine(step_tokens=50)
    done: dict[str, tuple[float, int]] = {}
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batched.run)
        with trio.move_on_after(0.2):  # in the first step, half of its 100 tokens planned
            await timed(batched, prompt("x"), 1, done, "gone")
        await timed(batched, prompt("y"), 1, done, "next")
        nursery.cancel_scope.cancel()
    # the next call joins at the second step and has the whole budget of steps 2 and 3
    assert "gone" not in done
    assert done["next"][0] - start == pytest.approx(3 * (50 * PROMPT_S + STEP_S))


async def run_calls_inside(batched: BatchedEngine, out: dict[str, tuple[float, int]]) -> None:
    async with trio.open_nursery() as callers:
        callers.start_soon(timed, batched, prompt("l"), 10_000, out, "long")
        callers.start_soon(timed, batched, prompt("k"), 1, out, "short")


def chat(r1: str, r2: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "The question. " * 60},
                                       {"role": "response_1", "content": r1},
                                       {"role": "response_2", "content": r2}]}


@pytest.mark.parametrize("engine_kind", ["per_call", "batched"])
async def test_through_http_the_batched_engine_makes_concurrent_prefills_wait_for_each_other(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, engine_kind: str,
) -> None:
    state = MockJudgeState()
    settings = MockJudgeSettings(prefix_cache_tokens=0, prompt_token_s=PROMPT_S,
                                 output_token_s=STEP_S, capacity=4, engine=engine_kind)
    url = await nursery.start(functools.partial(run_mock_judge, settings, state=state))
    ends: list[float] = []
    usage: list[dict[str, Any]] = []
    start = trio.current_time()
    async with httpx2.AsyncClient(timeout=600.0) as c:

        async def one(i: int) -> None:
            answer = (await c.post(url + CHAT_PATH, json=chat(f"answer {i}", "other"))).json()
            usage.append(answer["usage"])
            ends.append(trio.current_time() - start)

        async with trio.open_nursery() as calls:
            for i in range(4):
                calls.start_soon(one, i)
    alone = max(u["prompt_tokens"] * PROMPT_S + u["completion_tokens"] * STEP_S for u in usage)
    together = sum(u["prompt_tokens"] for u in usage) * PROMPT_S
    if engine_kind == "per_call":
        assert max(ends) == pytest.approx(alone, abs=0.05)
    else:  # the four prefills are computed by one engine: about four times as long
        assert max(ends) >= together
    assert state.prompt_tokens == sum(u["prompt_tokens"] for u in usage)


@pytest.mark.parametrize(("values", "key"), [
    ({"engine": "vllm"}, "engine"),
    ({"engine_step_tokens": 0}, "engine_step_tokens"),
    ({"engine_step_tokens": 2**21}, "engine_step_tokens"),
])
def test_bad_batched_engine_settings_name_the_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(values)
    assert info.value.key == key
