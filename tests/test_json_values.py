"""The bound on JSON values per body (``max_json_values``, issue 26).

A body of many tiny values (``[{}, {}, ...]``) is cheap on the wire and costs the event loop
seconds to decode, check and weigh; the bound is counted on the bytes (1 plus the ``{ [ , :``
in them) before anything decodes them. Every route that decodes JSON refuses a body past it with
413 ``too_large`` naming ``max_json_values``, changes no state and keeps the connection usable;
a body at the bound is accepted. No timing here: the loop's figures are the ``hostile_body``
bench preset's.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import pytest

from genrm_trio import wire
from genrm_trio.config import Config
from genrm_trio.errors import BadRequest, TooManyValues
from genrm_trio.server.openapi import build_openapi
from tests.lifecycle_helpers import body
from tests.server_helpers import raw_http, running_server

MAX_VALUES = 2000


def enc(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def at_count(make: Any, count: int) -> bytes:
    """``make(pad)`` with a ``pad`` list of zeros as long as needed for the body's
    :func:`wire.json_values_bound` to be exactly ``count``."""
    base = wire.json_values_bound(make([0]))
    raw = make([0] * (count - base + 1))
    assert wire.json_values_bound(raw) == count
    return raw


def verify_body(pad: list[int]) -> bytes:
    return enc(body(0, group="values", pad=pad))


ROUTE_BODIES = {
    "/verify": verify_body,
    "/ng-rollout/r-1/verify": verify_body,
    "/compare": lambda pad: enc({"conversation_history": [{"role": "user", "content": "hi"}],
                                 "response_objs": [body(0)["response"], body(1)["response"]],
                                 "pad": pad}),
    "/aggregate_metrics": lambda pad: enc({"verify_responses": [
        {"_ng_task_index": 0, "reward": 1.0, "pad": pad}]}),
    "/seed_session": lambda pad: enc({"resources_session_id": "s", "pad": pad}),
    "/close_session": lambda pad: enc({"resources_session_id": "s", "pad": pad}),
}


# ------------------------------------------------------------------------------- the count


@pytest.mark.parametrize(("raw", "values"), [
    (b"{}", 2), (b"[]", 2), (b"0", 1), (b'"a,b:{["', 5), (b'{"a": [1, 2, {}]}', 7),
    (b"[" + b",".join([b"{}"] * 1000) + b"]", 2001),
])
def test_the_count_is_one_plus_the_structural_bytes(raw: bytes, values: int) -> None:
    assert wire.json_values_bound(raw) == values


def test_the_count_bounds_the_decoded_values_and_keys() -> None:
    def decoded(value: Any) -> int:
        if isinstance(value, dict):
            return 1 + sum(1 + decoded(v) for v in value.values())
        if isinstance(value, list):
            return 1 + sum(decoded(v) for v in value)
        return 1
    for raw in (verify_body([0, 1]), enc({"a": [[], {}, [{}], {"b": {"c": []}}], "d": ""}),
                enc(["x", 1, 2.5, None, True, {"k": "v"}])):
        assert decoded(msgspec.json.decode(raw)) <= wire.json_values_bound(raw)


@pytest.mark.parametrize("decode", [
    lambda raw: wire.decode_verify(raw, 2, None, MAX_VALUES),
    lambda raw: wire.decode_object(raw, MAX_VALUES),
    lambda raw: wire.decode_compare(raw, 8, MAX_VALUES),
    lambda raw: wire.decode_aggregate(raw, MAX_VALUES),
])
def test_past_the_bound_is_refused_before_decoding(decode: Any) -> None:
    over = at_count(verify_body, MAX_VALUES + 1)
    with pytest.raises(TooManyValues) as info:
        decode(over)
    assert info.value.status == 413 and info.value.failure_kind == "too_large"
    assert f"max_json_values ({MAX_VALUES})" in info.value.detail
    assert f"{MAX_VALUES + 1} JSON values" in info.value.detail
    # Counted before decoding: a body past the bound that is not even JSON gets the 413.
    with pytest.raises(TooManyValues):
        decode(b"[" * MAX_VALUES)
    with pytest.raises(BadRequest):  # and at the bound, the decoder's own answer
        decode(b"[" * (MAX_VALUES - 1))


def test_at_the_bound_is_accepted() -> None:
    member = wire.decode_verify(at_count(verify_body, MAX_VALUES), 2, None, MAX_VALUES)
    assert len(member.body()["pad"]) > MAX_VALUES // 2


def test_the_default_bound_takes_the_largest_real_bodies() -> None:
    # A 200-turn agent trajectory shaped like NeMo Gym 0.7.0's densest example rollouts
    # (swe_agents, job_bench: 74 to 93 counted values per output item): per turn a reasoning
    # item, a function call and its output, the output holding code with commas and colons.
    turn = [
        {"type": "reasoning", "id": "rs_1", "summary": [
            {"type": "summary_text", "text": "Let me look: the file, then the tests."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "bash",
         "arguments": json.dumps({"command": "grep -n 'a, b: c' -r src/ | head"}),
         "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1",
         "output": "src/x.py:12: a, b: c = {1: [2, 3]}\n" * 30},
    ]
    raw = enc(body(0, group="real", text="done") | {"responses_create_params": {
        "input": [{"role": "user", "content": "fix the bug"}] + turn * 200}})
    assert 200 * 3 * 74 < wire.json_values_bound(raw) < Config().max_json_values
    wire.decode_verify(raw, 2)


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


@pytest.mark.parametrize("literal", [
    "0.1", "-0.0", "1E5", "1e-7", "5e-324", "2.2250738585072011e-308", "1e23", "1e300",
    "1.7976931348623157e308", "123456789.123456789", "0.30000000000000004",
])
def test_floats_decode_to_the_same_values(literal: str) -> None:
    raw = f'{{"v": [{literal}]}}'.encode()
    ours = wire.JSON_DECODER.decode(raw)["v"][0]
    assert ours == msgspec.json.decode(raw)["v"][0] == float(literal)
    assert type(ours) is float and repr(ours) == repr(float(literal))
    assert wire.member_response(enc(body(0)).replace(b'"output"', f'"v": {literal}, "output"'
                                                     .encode()))["v"] == float(literal)


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
