"""The bound on JSON values per body (``max_json_values``, issue 26).

A body of many tiny values (``[{}, {}, ...]``, ``[1e300, ...]``) is cheap on the wire and costs
the event loop seconds to decode, check and weigh; the bound is counted on the bytes (strings
taken out, objects and arrays weighing 8, numbers with an exponent 200) before anything decodes
them. Every route that decodes JSON refuses a body past it with 413 ``too_large`` naming
``max_json_values``, changes no state and keeps the connection usable; a body at the bound is
accepted, also one big enough to be decoded in steps. No timing here: the loop's
figures are the ``hostile_body`` bench preset's.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from genrm_trio import wire
from genrm_trio.config import Config
from genrm_trio.errors import BadRequest, TooManyValues
from genrm_trio.server import app as app_mod
from genrm_trio.server.openapi import build_openapi
from tests.lifecycle_helpers import body
from tests.server_helpers import raw_http, running_server

MAX_VALUES = 2000


def enc(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def at_count(make: Any, count: int) -> bytes:
    """``make(pad)`` with a ``pad`` list of zeros as long as needed for the body's
    :func:`wire.json_value_count` to be exactly ``count``."""
    base = wire.json_value_count(make([0]))
    raw = make([0] * (count - base + 1))
    assert wire.json_value_count(raw) == count
    return raw


def verify_body(pad: list[int]) -> bytes:
    return enc(body(0, group="values", pad=pad))


ROUTE_BODIES = {
    "/verify": verify_body,
    "/ng-rollout/r-1/verify": verify_body,
    "/compare": lambda pad: enc({"conversation_history": [{"role": "user", "content": "hi"}],
                                 "response_objs": [body(0)["response"], body(1)["response"]],
                                 "pad": pad}),
    "/get_reward": lambda pad: enc({"query": ["p and its answer"], "prompts": ["p"],
                                    "labels": ["x"], "pad": pad}),
    "/aggregate_metrics": lambda pad: enc({"verify_responses": [
        {"_ng_task_index": 0, "reward": 1.0, "pad": pad}]}),
    "/seed_session": lambda pad: enc({"resources_session_id": "s", "pad": pad}),
    "/close_session": lambda pad: enc({"resources_session_id": "s", "pad": pad}),
}


# ------------------------------------------------------------------------------- the count


@pytest.mark.parametrize(("raw", "values"), [
    (b"{}", 9), (b"[]", 9), (b"0", 1), (b'"a,b:{[e"', 1), (b'{"a": [1, 2, {}]}', 1 + 3 + 24),
    (b"[" + b",".join([b"{}"] * 1000) + b"]", 1 + 999 + 8 * 1001),
    # Escaped quotes and backslashes do not end a string; what is inside one counts nothing.
    (b'["a\\"", "\\\\", "\\\\\\"[,,,]"]', 1 + 2 + 8),
    # A number with an exponent counts 200, true and false do not.
    (b"[1e300, 2E-5, 0.5, true, false, null]", 1 + 5 + 8 + 400),
])
def test_the_count_weighs_each_value_outside_strings(raw: bytes, values: int) -> None:
    assert wire.json_value_count(raw) == values


def test_the_count_bounds_the_decoded_values_and_keys() -> None:
    def decoded(value: Any) -> int:
        if isinstance(value, dict):
            return 1 + sum(1 + decoded(v) for v in value.values())
        if isinstance(value, list):
            return 1 + sum(decoded(v) for v in value)
        return 1
    for raw in (verify_body([0, 1]), enc({"a": [[], {}, [{}], {"b": {"c": []}}], "d": ""}),
                enc(["x", 1, 2.5, None, True, {"k": "v"}]), enc({"k\"": ['"', "\\"]})):
        assert decoded(msgspec.json.decode(raw)) <= wire.json_value_count(raw)


@settings(max_examples=500)
@given(st.one_of(st.binary(max_size=300),
                 st.text(alphabet='{}[]",:\\eEtruefalsn0-1. ', max_size=300).map(str.encode)))
def test_the_quick_bound_is_never_below_the_count(raw: bytes) -> None:
    # The quick check (bodies of at most 64 KiB) lets a body through on this bound alone: it
    # must never be less than the exact count, whatever the bytes.
    assert wire._value_count_bound(raw) >= wire.json_value_count(raw)


def test_a_small_body_past_the_bound_is_counted_exactly() -> None:
    # Past the quick bound, the exact count decides: strings full of 'e' pass, exponents do not.
    text = enc({"x": "e" * 20_000})
    assert wire._value_count_bound(text) > 1_000_000 and wire.json_value_count(text) == 10
    assert wire.run_steps(wire.check_json_values_steps(text, 1000)) == 10
    with pytest.raises(TooManyValues):
        wire.run_steps(wire.check_json_values_steps(enc([1e300] * 10), 1000))


def test_strings_past_the_bound_stop_the_count_early() -> None:
    raw = enc([""] * 5000)
    assert wire.json_value_count(raw, 1000) == 5000  # the strings, not split out
    assert wire.json_value_count(raw) == 5000 + 8


@pytest.mark.parametrize("decode", [
    lambda raw: wire.decode_verify(raw, 2, max_values=MAX_VALUES),
    lambda raw: wire.decode_object(raw, MAX_VALUES),
    lambda raw: wire.decode_compare(raw, 8, MAX_VALUES),
    lambda raw: wire.decode_aggregate(raw, MAX_VALUES),
    lambda raw: wire.decode_get_reward(raw, MAX_VALUES),
])
def test_past_the_bound_is_refused_before_decoding(decode: Any) -> None:
    over = at_count(verify_body, MAX_VALUES + 1)
    with pytest.raises(TooManyValues) as info:
        decode(over)
    assert info.value.status == 413 and info.value.failure_kind == "too_large"
    assert f"max_json_values ({MAX_VALUES})" in info.value.detail
    assert f"counted at least {MAX_VALUES + 1}" in info.value.detail
    # Counted before decoding: a body past the bound that is not even JSON gets the 413.
    with pytest.raises(TooManyValues):
        decode(b"[" * (MAX_VALUES // 8 + 1))
    with pytest.raises(TooManyValues):
        decode(b"[" + b"1e300," * (MAX_VALUES // 200))
    with pytest.raises(BadRequest):  # and at the bound, the decoder's own answer
        decode(b"[" * ((MAX_VALUES - 1) // 8))


def test_at_the_bound_is_accepted() -> None:
    member = wire.decode_verify(at_count(verify_body, MAX_VALUES), 2, max_values=MAX_VALUES)
    assert len(member.body()["pad"]) > MAX_VALUES // 2


def trajectory(turns: int, token_ids: bool = False) -> bytes:
    """A NeMo Gym agent trajectory of ``turns`` turns, shaped like its densest example rollouts
    (swe_agents, job_bench): per turn a reasoning item, a function call and its output (code,
    full of commas and colons), and an assistant message; with ``token_ids``, each assistant
    message carries NeMo RL's token ids and log-probs as the policy's vLLM server adds them (the
    prompt's ids growing by about 1,000 tokens a turn)."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "fix the failing test"}]
    prompt_ids: list[int] = []
    for turn in range(turns):
        items += [
            {"type": "reasoning", "id": f"rs_{turn}", "summary": [
                {"type": "summary_text", "text": "Let me look: the file, then the tests."}]},
            {"type": "function_call", "id": f"fc_{turn}", "call_id": f"call_{turn}",
             "name": "bash", "arguments": json.dumps({"command": "grep -n 'a, b: c' -r src/"}),
             "status": "completed"},
            {"type": "function_call_output", "call_id": f"call_{turn}",
             "output": "src/x.py:12: a, b: c = {1: [2, 3]}\n" * 30},
        ]
        message: dict[str, Any] = {
            "type": "message", "id": f"msg_{turn}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Done: the test passes.",
                         "annotations": []}]}
        if token_ids:
            generated = [(7 * turn + i) % 151_000 for i in range(200)]
            prompt_ids = prompt_ids + generated + list(range(800))
            message |= {"prompt_token_ids": prompt_ids, "generation_token_ids": generated,
                        "generation_log_probs": [-0.01 * (i % 300) for i in range(200)]}
        items.append(message)
    return enc(body(0, group="real", text="done") | {"responses_create_params": {
        "input": items, "tools": [{"type": "function", "name": "bash", "strict": True,
                                   "parameters": {"type": "object", "properties": {
                                       "command": {"type": "string"}}}}]}})


def test_the_default_bound_takes_the_largest_real_bodies() -> None:
    default = Config().max_json_values
    # 200 turns with tool calls (320 KB): about 23,000 counted, under a twentieth of the default.
    long_history = trajectory(200)
    assert 15_000 < wire.json_value_count(long_history) < default // 20
    wire.decode_verify(long_history, 2)
    # 20 turns carrying token ids (1.1 MB; the prompt's ids are re-sent every turn, so they grow
    # with the square of the turns): about 221,000 counted, under half the default. 30 such
    # turns (2.4 MB, 481,000) are the most the default takes.
    with_ids = trajectory(20, token_ids=True)
    assert 200_000 < wire.json_value_count(with_ids) < default // 2
    wire.decode_verify(with_ids, 2)
    assert wire.json_value_count(trajectory(30, token_ids=True)) < default


# ------------------------------------------------------------------ what the decoders keep


def _reference_size(obj: Any) -> int:
    getsize = sys.getsizeof
    size = getsize(obj)
    if isinstance(obj, dict):
        return size + sum(getsize(k) + _reference_size(v) for k, v in obj.items())
    if isinstance(obj, list):
        return size + sum(_reference_size(v) for v in obj)
    return size


@pytest.mark.parametrize("obj", [
    body(0), {"a": [[], {}, [{"é": "—"}], {"b": {"c": ["\U0001f600", 2**62, 1.5, None]}}]},
    {"x": [{}] * 50, "y": [""] * 50, "z": list(range(-5, 300))},
])
def test_the_weight_is_every_objects_size(obj: dict[str, Any]) -> None:
    raw = enc(obj)
    assert wire.decode_verify(enc(body(0) | obj), 2).size_bytes == _reference_size(
        msgspec.json.decode(enc(body(0) | obj)))
    assert wire.decoded_size(msgspec.json.decode(raw)) == _reference_size(
        msgspec.json.decode(raw))


def test_openapi_lists_the_bound() -> None:
    bound = build_openapi()["x-bounds"]["max_json_values"]
    assert "max_json_values" in bound and f"{wire.DEFAULT_MAX_JSON_VALUES:,}" in bound
    assert "413" in bound


# ------------------------------------------------------------------------------ on the wire


async def test_every_route_refuses_past_the_bound_and_keeps_the_connection() -> None:
    cfg = Config(num_rollouts_per_prompt=1, port=0, max_json_values=MAX_VALUES,
                 max_request_bytes=256 * 1024, shutdown_grace_s=1.0)
    async with running_server(cfg) as url:
        before = await raw_http(url, [("GET", "/status", b"")])
        for path, make in ROUTE_BODIES.items():
            over = at_count(make, MAX_VALUES + 1)
            at = at_count(make, MAX_VALUES)
            # One keep-alive connection: the refusal, then the same route at the bound, then a
            # probe; all three answered on it.
            answers = await raw_http(url, [("POST", path, over), ("POST", path, at),
                                           ("GET", "/healthz", b"")])
            assert len(answers) == 3, (path, answers)
            (status, headers, content), accepted, probe = answers
            assert status == 413, (path, status, content[:300])
            assert headers.get("connection") != "close", path
            detail = json.loads(content)
            assert detail["failure_kind"] == "too_large", path
            assert f"max_json_values ({MAX_VALUES})" in detail["detail"], path
            assert accepted[0] == 200, (path, accepted[0], accepted[2][:300])
            assert probe[0] == 200, path
        after = await raw_http(url, [("GET", "/status", b"")])
        assert json.loads(after[0][2])["cohorts"] == json.loads(before[0][2])["cohorts"]


async def test_a_big_body_is_decoded_in_steps_with_the_same_answers() -> None:
    # Past STEPPED_BYTES the body is decoded in steps: refused past the bound, decoded at it,
    # with the same answers as at once.
    bound = 50_000
    cfg = Config(num_rollouts_per_prompt=1, port=0, max_json_values=bound,
                 shutdown_grace_s=1.0)
    async with running_server(cfg) as url:
        over, at = at_count(verify_body, bound + 1), at_count(verify_body, bound)
        assert len(at) > app_mod.STEPPED_BYTES
        (refused, accepted) = await raw_http(url, [("POST", "/verify", over),
                                                   ("POST", "/verify", at)])
        assert refused[0] == 413, refused
        assert f"max_json_values ({bound})" in json.loads(refused[2])["detail"]
        assert accepted[0] == 200 and json.loads(accepted[2])["reward"] is not None
        assert json.loads(accepted[2])["pad"] == json.loads(at)["pad"]


async def test_a_refused_body_changes_no_state() -> None:
    # N = 2: an accepted /verify or /get_reward body would open a cohort and wait in it.
    cfg = Config(num_rollouts_per_prompt=2, port=0, max_json_values=MAX_VALUES,
                 shutdown_grace_s=1.0)
    async with running_server(cfg) as url:
        (before,) = await raw_http(url, [("GET", "/status", b"")])
        for path in ("/verify", "/ng-rollout/r-1/verify", "/get_reward"):
            (refused,) = await raw_http(url, [("POST", path, at_count(ROUTE_BODIES[path],
                                                                       MAX_VALUES + 1))])
            assert refused[0] == 413, (path, refused)
        (after,) = await raw_http(url, [("GET", "/status", b"")])
        assert json.loads(after[2])["cohorts"] == json.loads(before[2])["cohorts"]


async def test_a_big_body_lets_the_loop_run_between_its_steps() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    big = enc(body(0) | {"x": [{}, [0, "a"]] * 20_000})  # past STEPPED_BYTES
    small = enc(body(0))
    steps = sum(1 for _ in wire.decode_verify_steps(big, 2))
    assert steps >= 8  # counts, decode, weighing, duplicate check
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()
        before = ticks
        member = await app_mod.run_stepped(wire.decode_verify_steps(big, 2), len(big))
        assert ticks - before >= steps - 1
        assert member == wire.decode_verify(big, 2)
        before = ticks
        await app_mod.run_stepped(wire.decode_verify_steps(small, 2), len(small))
        assert ticks == before  # a small body at once
        with pytest.raises(TooManyValues):  # raised from a step, as at once
            await app_mod.run_stepped(wire.decode_verify_steps(big, 2, max_values=1000),
                                      len(big))
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("raw", "duplicated"), [
    (b'{"response": {}, "response": {}}', "response"),
    (b'{"_ng_group_id" : "a", "x": 1, "_ng_group_id":\n "b"}', "_ng_group_id"),
    (b'{"response": {"object": "response"}, "x": "\\n"}', None),  # a value, not a key
    (b'{"response": {"response": 1}}', None),  # only the top level counts
    (b'{"response": {}, "\\u0072esponse": {}}', "response"),
    (b'{"response": {}, "x": "\\u0072esponse"}', None),
])
def test_a_small_body_names_a_key_twice_or_not(raw: bytes, duplicated: str | None) -> None:
    assert wire._duplicated_key(raw) == duplicated


def test_a_duplicated_key_is_found_across_the_scan_windows() -> None:
    mib = 1 << 20
    for gap in (mib - 40, mib - 3, mib + 5):  # the second name near, on and past a window edge
        for spelled, space in ((b'"response"', b" "), (b'"\\u0072esponse"', b" " * (2 * mib))):
            raw = (b'{"response": {}, "x": "' + b"a" * gap + b'", ' + spelled + space
                   + b': {}}')
            assert wire._duplicated_key(raw) == "response", (gap, spelled)
    assert wire._duplicated_key(b'{"response": {}, "x": "' + b"a" * mib + b'"}') is None
