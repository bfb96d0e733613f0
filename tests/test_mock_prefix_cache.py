"""The mock judge's engine model: tokenizer rule, chained block keys, LRU capacity, the time it
charges per computed prompt token and per output token, and how it reports cached tokens."""

from __future__ import annotations

import functools
import re
from typing import Any

import httpx2
import pytest
import trio

from genrm_trio.errors import ConfigError
from genrm_trio.mock.cli import _settings_from_cli
from genrm_trio.mock.http import CHAT_PATH, RESPONSES_PATH
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.prefix_cache import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    MAX_PREFIX_CACHE_TOKENS,
    PREFIX_CACHE_SIZES,
    PrefixCache,
    block_keys,
    parse_capacity,
    prompt_tokens,
    render_prompt,
)
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState, settings_from_mapping

HISTORY = [{"role": "user", "content": "Explain the proof in detail. " * 40}]  # 1,160 bytes


def chat(r1: str, r2: str) -> dict[str, Any]:
    return {"model": "m", "messages": [*HISTORY, {"role": "response_1", "content": r1},
                                       {"role": "response_2", "content": r2}]}


def responses(r1: str, r2: str) -> dict[str, Any]:
    return {"model": "m", "input": HISTORY, "metadata": {"response_1": r1, "response_2": r2}}


def test_tokenizer_rule_is_four_bytes_a_token_rounded_up() -> None:
    assert prompt_tokens(b"") == 0
    assert prompt_tokens(b"abcd") == 1
    assert prompt_tokens(b"abcde") == 2
    assert render_prompt([("user", "hi"), ("response_1", "é")]) == (
        b"<|user|>\nhi\n<|response_1|>\n\xc3\xa9\n")


def test_block_keys_are_chained_over_full_blocks_only() -> None:
    a = b"x" * (3 * BLOCK_BYTES + 10)
    b = b"x" * (2 * BLOCK_BYTES) + b"y" * BLOCK_BYTES
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 3 and len(kb) == 3  # the 10-byte tail is not a block
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    # the same block bytes after a different prefix get a different key
    c = b"z" * BLOCK_BYTES + b"x" * BLOCK_BYTES
    assert block_keys(c)[1] != ka[1]


def test_lookup_finds_the_leading_cached_blocks_and_never_the_whole_prompt() -> None:
    cache = PrefixCache(1000 * BLOCK_TOKENS)
    first = b"h" * (4 * BLOCK_BYTES) + b"A" * (2 * BLOCK_BYTES)
    tokens = prompt_tokens(first)
    assert cache.lookup(block_keys(first), tokens) == 0
    cache.insert(block_keys(first))
    # another answer after the same history: the 4 history blocks are found
    second = b"h" * (4 * BLOCK_BYTES) + b"B" * (2 * BLOCK_BYTES)
    assert cache.lookup(block_keys(second), prompt_tokens(second)) == 4 * BLOCK_TOKENS
    # the very same prompt again: everything but its last token
    assert cache.lookup(block_keys(first), tokens) == tokens - 1


def test_capacity_evicts_least_recently_used_and_a_prefix_outlives_its_tails() -> None:
    cache = PrefixCache(5 * BLOCK_TOKENS)  # five blocks
    history = b"h" * (3 * BLOCK_BYTES)
    one = history + b"1" * (2 * BLOCK_BYTES)
    two = history + b"2" * (2 * BLOCK_BYTES)
    cache.insert(block_keys(one))
    assert len(cache) == 5
    cache.insert(block_keys(two))  # two new tail blocks: one's tail goes, the history stays
    assert len(cache) == 5 and cache.evicted_blocks == 2
    assert cache.lookup(block_keys(two), prompt_tokens(two)) == 5 * BLOCK_TOKENS - 1
    assert cache.lookup(block_keys(one), prompt_tokens(one)) == 3 * BLOCK_TOKENS
    # an unrelated prompt pushes out tails first: the history (touched last) survives
    fresh = PrefixCache(5 * BLOCK_TOKENS)
    fresh.insert(block_keys(one))
    fresh.insert(block_keys(b"u" * (2 * BLOCK_BYTES)))
    assert fresh.lookup(block_keys(one), prompt_tokens(one)) == 3 * BLOCK_TOKENS
    off = PrefixCache(0)
    off.insert(block_keys(one))
    assert len(off) == 0 and off.lookup(block_keys(one), prompt_tokens(one)) == 0


@pytest.mark.parametrize(("values", "key"), [
    ({"prefix_cache_tokens": -1}, "prefix_cache_tokens"),
    ({"prefix_cache_tokens": 2**31}, "prefix_cache_tokens"),
    ({"prefix_cache_tokens": "huge"}, "prefix_cache_tokens"),
    ({"prompt_token_s": -0.1}, "prompt_token_s"),
    ({"output_token_s": 2.0}, "output_token_s"),
    ({"prompt_token_s": float("inf")}, "prompt_token_s"),
    ({"cache_report": "prometheus"}, "cache_report"),
])
def test_bad_engine_settings_name_the_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(values)
    assert info.value.key == key


CLI_FLAGS: dict[str, Any] = {"host": None, "port": None, "config_path": None, "overrides": (),
                             "latency_ms": None, "capacity": None, "fault": None,
                             "fault_count": None}


def test_named_cache_sizes_from_settings_and_the_cli_flag() -> None:
    assert settings_from_mapping({"prefix_cache_tokens": "small"}).prefix_cache_tokens == 16_384
    flags = CLI_FLAGS
    assert _settings_from_cli(**flags, prefix_cache="large").prefix_cache_tokens == 1_048_576
    assert _settings_from_cli(**flags, prefix_cache="4096").prefix_cache_tokens == 4096
    assert _settings_from_cli(**flags, prefix_cache="0").prefix_cache_tokens == 0
    assert _settings_from_cli(**flags).prefix_cache_tokens == 0  # no flag: off
    for bad in ("big", "1e4", "-4096", "4096.5", "", str(MAX_PREFIX_CACHE_TOKENS + 1)):
        with pytest.raises(ConfigError, match="off, small, large or a token count") as info:
            _settings_from_cli(**flags, prefix_cache=bad)
        assert info.value.key == "prefix_cache_tokens"


def test_parse_capacity_takes_a_name_or_a_whole_token_count() -> None:
    assert [parse_capacity(v) for v in ("off", "small", "large")] == [
        PREFIX_CACHE_SIZES["off"], PREFIX_CACHE_SIZES["small"], PREFIX_CACHE_SIZES["large"]]
    assert parse_capacity("6144") == 6144 and parse_capacity(" 8192 ") == 8192
    assert parse_capacity(str(MAX_PREFIX_CACHE_TOKENS)) == MAX_PREFIX_CACHE_TOKENS
    for bad in ("SMALL", "huge", "-1", "+8", "8k", "0x100", "1_000", "",
                str(MAX_PREFIX_CACHE_TOKENS + 1)):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_capacity(bad)


async def _start(nursery: trio.Nursery, **settings: Any) -> tuple[str, MockJudgeState]:
    state = MockJudgeState()
    url = await nursery.start(functools.partial(
        run_mock_judge, MockJudgeSettings(**settings), state=state))
    return url, state


@pytest.mark.parametrize("path", [CHAT_PATH, RESPONSES_PATH])
async def test_a_shared_prefix_is_reported_as_cached_tokens(nursery: trio.Nursery,
                                                            path: str) -> None:
    url, state = await _start(nursery, prefix_cache_tokens=16_384)
    build = chat if path == CHAT_PATH else responses
    async with httpx2.AsyncClient(timeout=30.0) as c:
        first = (await c.post(url + path, json=build("A first answer.", "B"))).json()
        second = (await c.post(url + path, json=build("Another answer!", "C"))).json()
    details = "prompt_tokens_details" if path == CHAT_PATH else "input_tokens_details"
    tokens = "prompt_tokens" if path == CHAT_PATH else "input_tokens"
    assert first["usage"][details] == {"cached_tokens": 0}
    history_bytes = len(render_prompt((m["role"], m["content"]) for m in HISTORY))
    # the history's full blocks are shared; the answers start right after it
    assert second["usage"][details] == {
        "cached_tokens": history_bytes // BLOCK_BYTES * BLOCK_TOKENS}
    assert state.cached_tokens == second["usage"][details]["cached_tokens"]
    assert state.prompt_tokens == first["usage"][tokens] + second["usage"][tokens]
    assert "timings" not in second


async def test_llama_cpp_style_timings_and_no_report(nursery: trio.Nursery) -> None:
    url, _ = await _start(nursery, prefix_cache_tokens=16_384, cache_report="timings")
    quiet, _ = await _start(nursery, prefix_cache_tokens=16_384, cache_report="none")
    async with httpx2.AsyncClient(timeout=30.0) as c:
        await c.post(url + CHAT_PATH, json=chat("x", "y"))
        answer = (await c.post(url + CHAT_PATH, json=chat("x", "z"))).json()
        await c.post(quiet + CHAT_PATH, json=chat("x", "y"))
        silent = (await c.post(quiet + CHAT_PATH, json=chat("x", "z"))).json()
    timings = answer["timings"]
    assert timings["cache_n"] > 0
    assert timings["cache_n"] + timings["prompt_n"] == answer["usage"]["prompt_tokens"]
    assert "prompt_tokens_details" not in answer["usage"]
    assert "timings" not in silent and "prompt_tokens_details" not in silent["usage"]


async def test_time_is_charged_per_computed_prompt_token_and_per_output_token(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock,
) -> None:
    url, state = await _start(nursery, prefix_cache_tokens=16_384, prompt_token_s=0.001,
                              output_token_s=0.01)
    async with httpx2.AsyncClient(timeout=30.0) as c:
        first = (await c.post(url + CHAT_PATH, json=chat("x", "y"))).json()
        busy_first = state.busy_s
        second = (await c.post(url + CHAT_PATH, json=chat("x", "z"))).json()
    usage_1, usage_2 = first["usage"], second["usage"]
    assert busy_first == pytest.approx(
        usage_1["prompt_tokens"] * 0.001 + usage_1["completion_tokens"] * 0.01)
    computed = usage_2["prompt_tokens"] - usage_2["prompt_tokens_details"]["cached_tokens"]
    assert state.busy_s - busy_first == pytest.approx(
        computed * 0.001 + usage_2["completion_tokens"] * 0.01)
    assert state.snapshot()["computed_tokens"] == usage_1["prompt_tokens"] + computed


async def test_each_mock_judge_is_its_own_engine_and_reset_clears_its_cache(
    nursery: trio.Nursery,
) -> None:
    a, _ = await _start(nursery, prefix_cache_tokens=16_384)
    b, _ = await _start(nursery, prefix_cache_tokens=16_384)
    async with httpx2.AsyncClient(timeout=30.0) as c:
        await c.post(a + CHAT_PATH, json=chat("x", "y"))
        other = (await c.post(b + CHAT_PATH, json=chat("x", "z"))).json()
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await c.post(a + "/admin/reset")
        again = (await c.post(a + CHAT_PATH, json=chat("x", "z"))).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _conversation(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Explain the proof of {topic} in detail. " * 30}]


@pytest.mark.parametrize("holds_both", [False, True])
async def test_the_mock_honours_a_numeric_capacity(nursery: trio.Nursery,
                                                   holds_both: bool) -> None:
    """A capacity given as a token count (``--prefix-cache TOKENS``) bounds what the mock
    keeps: one that holds one conversation's prompt but not two evicts the first when the
    second is computed; one that holds both finds the first again."""
    one = {"model": "m", "messages": [*_conversation("A"), {"role": "response_1", "content": "x"},
                                      {"role": "response_2", "content": "y"}]}
    two = {"model": "m", "messages": [*_conversation("B"), {"role": "response_1", "content": "x"},
                                      {"role": "response_2", "content": "y"}]}
    blocks = len(block_keys(render_prompt((m["role"], m["content"]) for m in one["messages"])))
    assert blocks == len(block_keys(render_prompt(
        (m["role"], m["content"]) for m in two["messages"])))
    capacity = (2 if holds_both else 1) * blocks * BLOCK_TOKENS + BLOCK_TOKENS // 2
    settings = _settings_from_cli(**CLI_FLAGS, prefix_cache=str(capacity))
    assert settings.prefix_cache_tokens == capacity
    state = MockJudgeState()
    url = await nursery.start(functools.partial(run_mock_judge, settings, state=state))
    async with httpx2.AsyncClient(timeout=30.0) as c:
        for body in (one, two):
            first = (await c.post(url + CHAT_PATH, json=body)).json()
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = (await c.post(url + CHAT_PATH, json=one)).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    tokens = again["usage"]["prompt_tokens"]
    # held: every full block (at most tokens - 1); evicted by the second prompt: nothing of it
    assert cached == (min(blocks * BLOCK_TOKENS, tokens - 1) if holds_both else 0)
