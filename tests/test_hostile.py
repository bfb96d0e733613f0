"""A hostile-input corpus against every endpoint of a live server on a real socket.

Each case is raw bytes on the wire (bodies and headers: depth, sizes, types, encodings, integer
extremes, duplicated keys, wrong content types, chunked and truncated bodies). Each must get a 4xx
whose JSON ``detail`` names the field or the bound, change no state (``/status`` identical), and
leave the process serving. The server holds one completed and one collecting cohort meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import h11
import httpx2
import pytest
import trio

from genrm_trio.config import Config
from genrm_trio.wire import INT64_MAX, MAX_IDENTITY_CHARS, MAX_JSON_DEPTH
from tests.lifecycle_helpers import body
from tests.server_helpers import read_answer, running_server

N = 2
MAX_BYTES = 64 * 1024
MAX_COMPARE = 8


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    payload: bytes
    status: int
    names: str  # must appear in the answer's detail
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    method: str = "POST"
    chunked: bool = False
    send_bytes: int | None = None  # send only this many payload bytes, then wait


def enc(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def verify(**changes: Any) -> bytes:
    out = body(0, group="hostile")
    out.update(changes)
    return enc(out)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return value


def compare(**changes: Any) -> bytes:
    out: dict[str, Any] = {"conversation_history": [{"role": "user", "content": "hi"}],
                           "response_objs": [body(0)["response"], body(1)["response"]]}
    out.update(changes)
    return enc(out)


def rows(*row: dict[str, Any]) -> bytes:
    return enc({"verify_responses": list(row)})


BIG = 10**400
GOOD = verify()
CASES = [
    # --- /verify: not a JSON object
    Case("empty body", "/verify", b"", 400, "not valid JSON"),
    Case("null", "/verify", b"null", 400, "got null at `$`"),
    Case("array", "/verify", b"[]", 400, "got list at `$`"),
    Case("string", "/verify", b'"hello"', 400, "got str at `$`"),
    Case("number", "/verify", b"42", 400, "got number at `$`"),
    Case("truncated JSON", "/verify", GOOD[: len(GOOD) // 2], 400, "not valid JSON"),
    Case("trailing garbage", "/verify", GOOD + b" trailing", 400, "not valid JSON"),
    Case("invalid UTF-8", "/verify", GOOD.replace(b"Explain", b"Expl\xff\xfein"), 400,
         "not valid JSON"),
    Case("UTF-16 body", "/verify", GOOD.decode().encode("utf-16"), 400, "not valid JSON"),
    Case("NaN literal", "/verify", verify(extra="X").replace(b'"X"', b"NaN"), 400,
         "not valid JSON"),
    Case("float overflow", "/verify", verify(extra="X").replace(b'"X"', b"1e400"), 400,
         "out of range"),
    # --- /verify: bounds
    Case("depth over the bound", "/verify",
         verify(response={"id": "r", "output": nested(MAX_JSON_DEPTH)}), 400,
         f"deeper than {MAX_JSON_DEPTH}"),
    Case("depth 5000", "/verify", b"[" * 5000 + b"]" * 5000, 400, "nesting"),
    Case("attempt beyond int64", "/verify", verify(_ng_group_attempt=INT64_MAX + 1), 400,
         "$._ng_group_attempt"),
    Case("negative attempt", "/verify", verify(_ng_group_attempt=-1), 422,
         "_ng_group_attempt"),
    Case("rollout index beyond int64", "/verify", verify(_ng_rollout_index=2**64), 400,
         "$._ng_rollout_index"),
    Case("rollout index out of range", "/verify", verify(_ng_rollout_index=N), 422,
         "_ng_rollout_index"),
    Case("task index beyond int64", "/verify", verify(_ng_task_index=-(2**63) - 1), 400,
         "$._ng_task_index"),
    Case("400-digit integer in the response", "/verify",
         verify(response={"id": "r", "output": [], "usage": {"tokens": BIG}}), 400,
         "$.response.usage.tokens"),
    Case("huge integer in an echoed key", "/verify", verify(extra={"n": [BIG]}), 400,
         "$.extra.n[0]"),
    Case("group id over the bound", "/verify", verify(_ng_group_id="g" * (MAX_IDENTITY_CHARS + 1)),
         400, "$._ng_group_id"),
    Case("prompt id over the bound", "/verify",
         verify(prompt_id="p" * (MAX_IDENTITY_CHARS + 1)), 400, "$.prompt_id"),
    Case("alias group id over the bound", "/verify",
         enc({**{k: v for k, v in body(0).items() if k != "_ng_group_id"},
              "group_id": "g" * (MAX_IDENTITY_CHARS + 1)}), 400, "$._ng_group_id"),
    # --- /verify: types and duplicated keys
    Case("group id a number", "/verify", verify(_ng_group_id=7), 400, "$._ng_group_id"),
    Case("attempt a string", "/verify", verify(_ng_group_attempt="1"), 400,
         "$._ng_group_attempt"),
    Case("attempt a float", "/verify", verify(_ng_group_attempt=1.5), 400,
         "$._ng_group_attempt"),
    Case("response a list", "/verify", verify(response=[]), 400, "$.response"),
    Case("response missing", "/verify",
         enc({k: v for k, v in body(0).items() if k != "response"}), 400, "response"),
    Case("prompt a number", "/verify", verify(responses_create_params={"input": 5}), 400,
         "$.responses_create_params.input"),
    Case("instance_config a string", "/verify", verify(instance_config="x"), 400,
         "$.instance_config"),
    Case("principle a list", "/verify", verify(principle=["be fair"]), 400, "$.principle"),
    Case("duplicated rollout index", "/verify",
         GOOD[:-1] + b', "_ng_rollout_index": 1}', 400, "$._ng_rollout_index"),
    Case("duplicated group id", "/verify", GOOD[:-1] + b', "_ng_group_id": "other"}', 400,
         "$._ng_group_id"),
    Case("duplicated group id in a body naming \"response\" as a value", "/verify",
         verify(response={"id": "r", "object": "response", "output": []})[:-1]
         + b', "_ng_group_id": "other"}', 400, "$._ng_group_id"),
    Case("duplicated group id with blanks before its colon", "/verify",
         GOOD[:-1] + b', "_ng_group_id" \n\t : "other"}', 400, "$._ng_group_id"),
    Case("duplicated group id spelled with an escape", "/verify",
         GOOD[:-1] + b', "\\u005fng_group_id": "other"}', 400, "$._ng_group_id"),
    Case("alias and canonical disagree", "/verify", verify(group_id="another"), 400,
         "group_id"),
    # --- /verify: headers and framing
    Case("text/plain content type", "/verify", GOOD, 415, "Content-Type",
         headers=(("Content-Type", "text/plain"),)),
    Case("form content type", "/verify", GOOD, 415, "Content-Type",
         headers=(("Content-Type", "application/x-www-form-urlencoded"),)),
    Case("latin-1 charset", "/verify", GOOD, 415, "charset",
         headers=(("Content-Type", "application/json; charset=latin-1"),)),
    Case("declared too large", "/verify", b"{}" * (MAX_BYTES // 2 + 1), 413,
         "max_request_bytes"),
    Case("chunked too large", "/verify", b" " * (MAX_BYTES + 10) + b"{}", 413,
         "max_request_bytes", chunked=True),
    Case("chunked, not an object", "/verify", b"[1, 2, 3]", 400, "got list at `$`",
         chunked=True),
    Case("truncated body", "/verify", GOOD, 408, "request_read_timeout_s", send_bytes=40),
    Case("GET /verify", "/verify", b"", 405, "use POST", method="GET", headers=()),
    # --- /compare
    Case("compare: too many responses", "/compare",
         compare(response_objs=[{"id": str(i)} for i in range(MAX_COMPARE + 1)]), 400,
         "$.response_objs"),
    Case("compare: response not an object", "/compare", compare(response_objs=[1, 2]), 400,
         "$.response_objs[0]"),
    Case("compare: history a string", "/compare", compare(conversation_history="hi"), 400,
         "$.conversation_history"),
    Case("compare: depth", "/compare", compare(principle=nested(MAX_JSON_DEPTH + 1)), 400,
         "nesting"),
    Case("compare: huge integer", "/compare", compare(response_objs=[{"n": BIG}]), 400,
         "$.response_objs[0].n"),
    Case("compare: wrong content type", "/compare", compare(), 415, "Content-Type",
         headers=(("Content-Type", "text/csv"),)),
    Case("compare: not JSON", "/compare", b"{oops", 400, "not valid JSON"),
    # --- /aggregate_metrics
    Case("metrics: task index a list", "/aggregate_metrics",
         rows({"_ng_task_index": [1], "reward": 1.0}), 400,
         "$.verify_responses[0]._ng_task_index"),
    Case("metrics: 400-digit reward", "/aggregate_metrics",
         rows({"_ng_task_index": 0, "reward": 1.0}, {"_ng_task_index": 1, "reward": BIG}),
         400, "$.verify_responses[1].reward"),
    Case("metrics: reward a string", "/aggregate_metrics",
         rows({"_ng_task_index": 0, "reward": "high"}), 400, "$.verify_responses[0].reward"),
    Case("metrics: mask flag a string", "/aggregate_metrics",
         rows({"_ng_task_index": 0, "reward": 1.0, "mask_sample": "yes"}), 400,
         "$.verify_responses[0].mask_sample"),
    Case("metrics: rows not a list", "/aggregate_metrics", enc({"verify_responses": {}}), 400,
         "$.verify_responses"),
    Case("metrics: row not an object", "/aggregate_metrics", enc({"verify_responses": [3]}),
         400, "$.verify_responses[0]"),
    # --- session hooks
    Case("seed_session: array", "/seed_session", b"[1]", 400, "got list at `$`"),
    Case("seed_session: depth", "/seed_session", enc({"a": nested(MAX_JSON_DEPTH + 5)}), 400,
         "nesting"),
    Case("close_session: huge integer", "/close_session", enc({"resources_session_id": BIG}),
         400, "$.resources_session_id"),
]


async def exchange(url: str, case: Case) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        headers = [("Host", host), *case.headers]
        payload = case.payload
        if case.chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        else:
            headers.append(("Content-Length", str(len(payload))))
        await stream.send_all(conn.send(h11.Request(method=case.method, target=case.path,
                                                    headers=headers)))
        if case.chunked:
            for start in range(0, len(payload), 8192):
                await stream.send_all(conn.send(h11.Data(data=payload[start:start + 8192])))
            await stream.send_all(conn.send(h11.EndOfMessage()))
        elif case.send_bytes is not None:
            await stream.send_all(conn.send(h11.Data(data=payload[: case.send_bytes])))
        elif payload:
            await stream.send_all(conn.send(h11.Data(data=payload)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
        answer = await read_answer(stream, conn)
        assert answer is not None, f"{case.name}: the connection closed without an answer"
        return answer


@pytest.fixture
async def live() -> AsyncIterator[tuple[str, httpx2.AsyncClient]]:
    cfg = Config(num_rollouts_per_prompt=N, port=0, max_request_bytes=MAX_BYTES,
                 max_compare_responses=MAX_COMPARE, request_read_timeout_s=1.0,
                 cohort_collection_timeout_s=600.0, shutdown_grace_s=1.0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url, timeout=30) as c:
        async with trio.open_nursery() as nursery:
            done = [body(s, group="done") for s in range(N)]
            for one in done:
                nursery.start_soon(lambda one=one: c.post("/verify", json=one))
        waiting = httpx2.AsyncClient(base_url=url, timeout=None)
        async with waiting, trio.open_nursery() as nursery:
            nursery.start_soon(lambda: waiting.post("/verify", json=body(0, group="waiting")))
            while (await c.get("/status")).json()["cohorts"]["waiters"] != 1:  # noqa: ASYNC110
                await trio.sleep(0.01)  # polling another process's state over HTTP
            yield url, c
            nursery.cancel_scope.cancel()


async def test_the_corpus_is_refused_by_field_without_state_change(
    live: tuple[str, httpx2.AsyncClient],
) -> None:
    url, client = live
    assert len(CASES) >= 40
    before = (await client.get("/status")).json()["cohorts"]
    assert before["retained_records"] == 1 and before["active_cohorts"] == 1
    for case in CASES:
        with trio.fail_after(20):
            status, headers, content = await exchange(url, case)
        assert status == case.status, (case.name, status, content[:300])
        answer = json.loads(content)
        assert case.names in answer["detail"], (case.name, answer["detail"][:300])
        assert answer["failure_kind"] in ("bad_request", "bad_coordinates", "too_large",
                                          "request_timeout"), case.name
        assert (await client.get("/status")).json()["cohorts"] == before, case.name
        assert (await client.get("/healthz")).status_code == 200, case.name
    # Still serving: the collecting cohort completes with its second member.
    answer = await client.post("/verify", json=body(1, group="waiting"))
    assert answer.status_code == 200 and answer.json()["mask_sample"] is False
