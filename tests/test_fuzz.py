"""Property-based fuzzing of ``/verify`` and ``/compare`` on a live loopback server.

The field list and the JSON types come from the served ``/openapi.json`` (built from the msgspec
structs), so the fuzzer follows the schema. Properties: never a 5xx; a malformed body gets a
JSON error naming the field; the registry is identical before and after (``GET /status``).

The server runs in a thread with its own ``trio.run`` so hypothesis can drive plain synchronous
examples against it; the registry holds one completed and one collecting cohort meanwhile.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import msgspec
import pytest
import trio
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from genrm_trio.config import Config
from genrm_trio.errors import WireError
from genrm_trio.server.openapi import build_openapi
from genrm_trio.server.serve import run_server
from genrm_trio.torture.contract import response_object
from genrm_trio.torture.fuzz import run_http_fuzz
from genrm_trio.wire import decode_verify

# On a failure hypothesis writes a patch with libcst, whose import warns (DeprecationWarning);
# with filterwarnings=error that would hide the falsifying example. Import it quietly first.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import libcst.codemod  # noqa: F401
        import libcst.metadata  # noqa: F401
    except ImportError:
        pass

N = 2
FIELDS_SCHEMA = build_openapi()["components"]["schemas"]["VerifyFields"]
COMPARE_SCHEMA = build_openapi()["components"]["schemas"]["CompareRequest"]

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def allowed_types(prop: dict[str, Any]) -> set[str]:
    options = prop.get("anyOf", [prop])
    return {o["type"] for o in options if "type" in o}


def wrong_value(prop: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A JSON value of a type the schema property does not allow (a float that happens to be
    integral counts as an integer for msgspec, so those are left out for integer fields)."""
    allowed = allowed_types(prop)

    def wrong(value: Any) -> bool:
        kind = json_type(value)
        if kind == "number" and "integer" in allowed and float(value).is_integer():
            return False
        return kind not in allowed

    return json_values.filter(wrong)


def valid_verify(group: str = "fuzz-new") -> dict[str, Any]:
    return {
        "responses_create_params": {"input": "Fuzzing prompt: say something."},
        "response": response_object("a fuzzed answer"),
        "_ng_group_id": group,
        "_ng_group_attempt": 0,
        "_ng_rollout_index": 0,
        "extra": {"kept": True},
    }


@dataclass
class Live:
    client: httpx2.Client

    def status(self) -> dict[str, Any]:
        answer = self.client.get("/status")
        assert answer.status_code == 200
        cohorts: dict[str, Any] = answer.json()["cohorts"]
        return cohorts


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    """A live server in a thread, holding one completed and one collecting cohort."""
    cfg = Config(num_rollouts_per_prompt=N, port=0, cohort_collection_timeout_s=600.0,
                 shutdown_grace_s=1.0)
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = trio.Event()
        box["stop"] = stop
        box["token"] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(run_server, cfg, shutdown=stop))
            box["url"] = url
            async with httpx2.AsyncClient(base_url=url, timeout=30) as client:
                done = [valid_verify("fuzz-done"), valid_verify("fuzz-done")]
                done[1]["_ng_rollout_index"] = 1
                done[1]["response"] = response_object("another answer")
                async with trio.open_nursery() as both:
                    for body in done:
                        both.start_soon(functools.partial(client.post, "/verify", json=body))

                async def waiting_member() -> None:
                    async with httpx2.AsyncClient(base_url=url, timeout=None) as waiter:
                        answer = await waiter.post("/verify", json=valid_verify("fuzz-wait"))
                        box["waiter_status"] = answer.status_code

                nursery.start_soon(waiting_member)
                while True:  # until the waiting member is registered
                    snap = (await client.get("/status")).json()["cohorts"]
                    if snap["waiters"] == 1:
                        break
                    await trio.sleep(0.01)
            started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(30)
    with httpx2.Client(base_url=box["url"], timeout=30) as client:
        yield Live(client)
    trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
    thread.join(30)
    assert not thread.is_alive()
    assert box["waiter_status"] == 503  # the collecting member was answered `shutdown`


def assert_error(answer: httpx2.Response, status: int, kind: str, names: str | None) -> None:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["failure_kind"] == kind, body
    assert isinstance(body["detail"], str) and body["detail"]
    if names is not None:
        assert names in body["detail"], body["detail"]


def assert_no_state_change(live: Live, before: dict[str, Any]) -> None:
    assert live.status() == before


FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])

verify_fields = sorted(FIELDS_SCHEMA["properties"])


@FUZZ
@given(field=st.sampled_from(verify_fields), data=st.data())
def test_verify_wrong_type_names_the_field(live: Live, field: str, data: st.DataObject) -> None:
    body = valid_verify()
    body[field] = data.draw(wrong_value(FIELDS_SCHEMA["properties"][field]))
    before = live.status()
    answer = live.client.post("/verify", json=body)
    assert_error(answer, 400, "bad_request", f"$.{field}")
    assert_no_state_change(live, before)


@FUZZ
@given(field=st.sampled_from(sorted(FIELDS_SCHEMA["required"])),
       extra=st.dictionaries(st.text(min_size=1, max_size=6).filter(
           lambda k: k not in FIELDS_SCHEMA["properties"] and k not in ("group_id",
                                                                        "group_attempt")),
           json_values, max_size=3))
def test_verify_missing_required_field(live: Live, field: str, extra: dict[str, Any]) -> None:
    body = {**valid_verify(), **extra}
    del body[field]
    before = live.status()
    answer = live.client.post("/verify", json=body)
    assert_error(answer, 400, "bad_request", field)
    assert_no_state_change(live, before)


@FUZZ
@given(prompt=wrong_value({"anyOf": [{"type": "string"}, {"type": "array"}]}))
def test_verify_prompt_input_must_be_text_or_items(live: Live, prompt: Any) -> None:
    body = valid_verify()
    body["responses_create_params"] = {"input": prompt}
    before = live.status()
    assert_error(live.client.post("/verify", json=body), 400, "bad_request",
                 "$.responses_create_params.input")
    assert_no_state_change(live, before)


@FUZZ
@given(index=st.one_of(st.integers(-(2**63), -1), st.integers(N, 2**63 - 1)) | st.none(),
       attempt=st.integers(-(2**63), -1) | st.none())
def test_verify_bad_coordinates(live: Live, index: int | None, attempt: int | None) -> None:
    body = valid_verify()
    if index is None and attempt is None:
        del body["_ng_rollout_index"]
        names = "_ng_rollout_index"
    elif attempt is not None:
        body["_ng_group_attempt"] = attempt
        names = "_ng_group_attempt"
    else:
        body["_ng_rollout_index"] = index
        names = "_ng_rollout_index"
    before = live.status()
    answer = live.client.post("/verify", json=body)
    assert_error(answer, 422, "bad_coordinates", names)
    assert_no_state_change(live, before)


@FUZZ
@given(raw=st.one_of(
    st.binary(max_size=64).filter(lambda b: not _is_json_object(b)),
    json_values.filter(lambda v: not isinstance(v, dict)).map(msgspec.json.encode),
    st.dictionaries(st.text(max_size=10), json_values, max_size=5).map(msgspec.json.encode),
))
def test_verify_arbitrary_bytes_never_5xx(live: Live, raw: bytes) -> None:
    before = live.status()
    answer = live.client.post("/verify", content=raw,
                              headers={"content-type": "application/json"})
    assert answer.status_code < 500, answer.text
    body = answer.json()
    # Nothing random is a complete member: it is refused, with the reason.
    assert answer.status_code in (400, 422), body
    assert body["failure_kind"] in ("bad_request", "bad_coordinates")
    assert body["detail"]
    assert_no_state_change(live, before)


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(msgspec.json.decode(raw), dict)
    except msgspec.DecodeError:
        return False


compare_fields = sorted(COMPARE_SCHEMA["properties"])


@FUZZ
@given(field=st.sampled_from(compare_fields), data=st.data())
def test_compare_wrong_type_names_the_field(live: Live, field: str,
                                            data: st.DataObject) -> None:
    body: dict[str, Any] = {
        "conversation_history": [{"role": "user", "content": "hi"}],
        "response_objs": [response_object("one"), response_object("two")],
    }
    prop = COMPARE_SCHEMA["properties"][field]
    if prop.get("type") == "array" and data.draw(st.booleans()):
        # A list whose item is not an object: the path names the item.
        item = data.draw(json_values.filter(lambda v: not isinstance(v, dict)))
        body[field] = [item]
        names = f"$.{field}[0]"
    else:
        body[field] = data.draw(wrong_value(prop))
        names = f"$.{field}"
    before = live.status()
    assert_error(live.client.post("/compare", json=body), 400, "bad_request", names)
    assert_no_state_change(live, before)


@FUZZ
@given(history=st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]), json_values,
                                        max_size=3), max_size=3),
       responses=st.lists(st.dictionaries(st.sampled_from(["output", "id", "status"]),
                                          json_values, max_size=3), max_size=4),
       principle=st.none() | st.text(max_size=20))
def test_compare_well_typed_bodies_are_judged(live: Live, history: list[dict[str, Any]],
                                              responses: list[dict[str, Any]],
                                              principle: str | None) -> None:
    body = {"conversation_history": history, "response_objs": responses, "principle": principle}
    before = live.status()
    answer = live.client.post("/compare", json=body)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert len(out["rewards"]) == len(responses)
    assert all(isinstance(r, (int, float)) and math.isfinite(r) for r in out["rewards"])
    assert_no_state_change(live, before)


def test_openapi_document_is_served_and_matches_the_decoder(live: Live) -> None:
    answer = live.client.get("/openapi.json")
    assert answer.status_code == 200
    doc = answer.json()
    assert doc["openapi"].startswith("3.1")
    assert {"/verify", "/compare", "/aggregate_metrics", "/status"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert set(schemas["VerifyFields"]["required"]) == {"responses_create_params", "response"}
    assert "_ng_rollout_index" in schemas["VerifyFields"]["properties"]
    verify_errors = doc["paths"]["/verify"]["post"]["responses"]
    assert {"200", "400", "409", "413", "422", "429", "503"} <= set(verify_errors)
    # Every $ref points at a component that exists.
    refs = _refs(doc)
    assert refs and all(r.removeprefix("#/components/schemas/") in schemas for r in refs)


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


async def test_the_torture_tool_fuzzes_a_live_server_without_findings() -> None:
    cfg = Config(num_rollouts_per_prompt=3, port=0, shutdown_grace_s=1.0)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(run_server, cfg, shutdown=stop))
        summary = await run_http_fuzz(url, bodies=150, seed=11)
        stop.set()
    assert summary.violations == []
    assert summary.bodies == 150
    assert set(summary.statuses) == {400, 422}


# Arbitrary JSON, unbounded: big integers, deep nesting, any text (lone surrogates as escapes).
any_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
any_json = st.recursive(
    any_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=40,
)
POST_ENDPOINTS = ("/verify", "/compare", "/aggregate_metrics", "/seed_session",
                  "/close_session")
identity_keys = st.sampled_from(["responses_create_params", "response", "_ng_group_id",
                                 "_ng_group_attempt", "_ng_rollout_index", "_ng_task_index",
                                 "prompt_id", "principle", "instance_config", "group_id",
                                 "conversation_history", "response_objs", "verify_responses"])


def _is_valid_member(raw: bytes) -> bool:
    try:
        decode_verify(raw, N)
    except WireError:
        return False
    return True


@FUZZ
@given(path=st.sampled_from(POST_ENDPOINTS), data=st.data())
def test_arbitrary_json_to_every_post_endpoint_is_never_5xx(
    live: Live, path: str, data: st.DataObject,
) -> None:
    shape = data.draw(st.sampled_from(["any", "object", "valid_base", "deep"]))
    value: Any
    if shape == "any":
        value = data.draw(any_json)
    elif shape == "object":
        value = data.draw(st.dictionaries(identity_keys, any_json, max_size=6))
    elif shape == "valid_base":  # a valid /verify body with some keys replaced
        value = {**valid_verify("fuzz-any"),
                 **data.draw(st.dictionaries(identity_keys, any_json, max_size=3))}
    else:
        value = None
    if value is None:  # nesting written as text: deeper than json.dumps could encode
        depth = data.draw(st.integers(50, 5000))
        key = json.dumps(data.draw(identity_keys))
        raw = f'{{{key}: {"[" * depth}{json.dumps(data.draw(any_scalars))}{"]" * depth}}}'.encode()
    else:
        raw = json.dumps(value).encode()
    if path == "/verify" and _is_valid_member(raw):
        assume(False)  # a complete, valid member would wait for its cohort: not this test
    before = live.status()
    answer = live.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert answer.status_code < 500, (path, answer.status_code, answer.text[:300])
    if answer.status_code >= 400:
        detail = answer.json()["detail"]
        assert isinstance(detail, str) and detail
    if path == "/verify" and answer.status_code != 200:
        assert_no_state_change(live, before)
