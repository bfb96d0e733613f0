"""The mock judge over real loopback sockets: answers, faults on the wire, counters, capacity, CLI.

Real-socket tests: no autojump clock; the only deadlines are small real ones that a hung or
trickling judge must trip.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio

from genrm_trio import scoring
from genrm_trio.errors import ConfigError, JudgeParseError
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.http import CHAT_PATH, RESPONSES_PATH
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState, settings_from_mapping

REPO = Path(__file__).resolve().parents[1]

HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name the capital of France and one landmark there."},
]
ANSWER_A = "Paris is the capital of France; the Eiffel Tower is its best-known landmark."
ANSWER_B = "I think it might be Lyon."
PRINCIPLE = "Prefer correct answers."


def responses_body(r1: str = ANSWER_A, r2: str = ANSWER_B, principle: str | None = None) -> Any:
    metadata = {"response_1": r1, "response_2": r2}
    if principle is not None:
        metadata["principle"] = principle
    return {"model": "genrm-test", "input": HISTORY, "metadata": metadata, "max_output_tokens": 64}


def chat_body(r1: str = ANSWER_A, r2: str = ANSWER_B, principle: str | None = None) -> Any:
    messages: list[dict[str, Any]] = list(HISTORY)
    if principle is not None:
        messages.append({"role": "principle", "content": principle})
    messages.append({"role": "response_1", "content": r1})
    messages.append({"role": "response_2", "content": [{"type": "text", "text": r2}]})
    return {"model": "genrm-test", "messages": messages, "max_tokens": 64}


def answer_text(path: str, payload: dict[str, Any]) -> str:
    if path == RESPONSES_PATH:
        return "".join(
            part["text"]
            for item in payload["output"]
            if item["type"] == "message"
            for part in item["content"]
            if part["type"] == "output_text"
        )
    return str(payload["choices"][0]["message"]["content"])


async def start_judge(
    nursery: trio.Nursery,
    settings: MockJudgeSettings | None = None,
    state: MockJudgeState | None = None,
) -> tuple[str, MockJudgeState]:
    state = state if state is not None else MockJudgeState()
    url = await nursery.start(
        functools.partial(run_mock_judge, settings or MockJudgeSettings(), state=state)
    )
    return url, state


@pytest.fixture
async def client() -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(timeout=None) as c:
        yield c


async def raw_exchange(url: str, body: bytes) -> tuple[bytes, BaseException | None]:
    """Send one POST /v1/responses on a fresh socket; return all bytes read until EOF or error."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    request = (
        b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )
    received = b""
    error: BaseException | None = None
    async with stream:
        await stream.send_all(request)
        try:
            with trio.fail_after(5):
                while chunk := await stream.receive_some(65536):
                    received += chunk
        except trio.BrokenResourceError as exc:
            error = exc
    return received, error


def split_response(raw: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines)}
    return status_line, headers, body


# -- healthy answers ------------------------------------------------------------------------


@pytest.mark.parametrize("principle", [None, PRINCIPLE])
async def test_responses_api_answers_the_heuristic_verdict(
    nursery: trio.Nursery, client: httpx2.AsyncClient, principle: str | None
) -> None:
    url, _ = await start_judge(nursery)
    r = await client.post(url + RESPONSES_PATH, json=responses_body(principle=principle))
    assert r.status_code == 200
    payload = r.json()
    assert payload["object"] == "response"
    assert payload["status"] == "completed"
    assert payload["model"] == "genrm-test"
    [item] = payload["output"]
    assert (item["type"], item["role"], item["status"]) == ("message", "assistant", "completed")
    assert item["content"][0]["annotations"] == []
    assert payload["usage"]["total_tokens"] > 0
    # OpenAI's usage schema requires both detail objects (NeMo Gym's model servers check it).
    assert payload["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    assert payload["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    text = answer_text(RESPONSES_PATH, payload)
    assert text == scoring.heuristic_judge_text(HISTORY, ANSWER_A, ANSWER_B, principle)
    verdict = scoring.parse_judge_output(text, 3.0, 3.5)
    assert verdict.ranking < 3.5  # the correct answer wins


@pytest.mark.parametrize("principle", [None, PRINCIPLE])
async def test_chat_api_answers_the_heuristic_verdict(
    nursery: trio.Nursery, client: httpx2.AsyncClient, principle: str | None
) -> None:
    url, _ = await start_judge(nursery)
    r = await client.post(url + CHAT_PATH, json=chat_body(principle=principle))
    assert r.status_code == 200
    payload = r.json()
    assert payload["object"] == "chat.completion"
    [choice] = payload["choices"]
    assert (choice["index"], choice["finish_reason"]) == (0, "stop")
    assert choice["message"]["role"] == "assistant"
    text = answer_text(CHAT_PATH, payload)
    # principle/response roles are not history; list content is read as its text parts
    assert text == scoring.heuristic_judge_text(HISTORY, ANSWER_A, ANSWER_B, principle)
    scoring.parse_judge_output(text, 3.0, 3.5)


async def test_verdict_is_deterministic_across_servers_and_apis(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url_1, _ = await start_judge(nursery)
    url_2, _ = await start_judge(nursery, MockJudgeSettings(seed=99, latency_jitter_s=0.001))
    texts = set()
    for url in (url_1, url_2, url_1):
        r = await client.post(url + RESPONSES_PATH, json=responses_body())
        texts.add(answer_text(RESPONSES_PATH, r.json()))
        r = await client.post(url + CHAT_PATH, json=chat_body())
        texts.add(answer_text(CHAT_PATH, r.json()))
    assert len(texts) == 1
    swapped = await client.post(url_1 + RESPONSES_PATH, json=responses_body(ANSWER_B, ANSWER_A))
    v = scoring.parse_judge_output(answer_text(RESPONSES_PATH, swapped.json()), 3.0, 3.5)
    assert v.ranking > 3.5


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (RESPONSES_PATH, b"not json"),
        (RESPONSES_PATH, b'{"input": "q", "metadata": {"response_1": "a"}}'),
        (CHAT_PATH, b'{"messages": "q"}'),
        (CHAT_PATH, b'{"messages": [{"role": "response_1", "content": "a"}]}'),
        (CHAT_PATH, b'{"messages": [], "max_tokens": 0}'),
        (CHAT_PATH, b'{"messages": [{"role": "user", "content": "q"}], '
                    b'"response_format": {"type": "json_schema", "json_schema": {"name": "v"}}}'),
        (RESPONSES_PATH, b'{"input": "q", "text": {"format": {"type": "grammar"}}}'),
    ],
)
async def test_malformed_judge_request_is_400_and_counted(
    nursery: trio.Nursery, client: httpx2.AsyncClient, path: str, body: bytes
) -> None:
    url, state = await start_judge(nursery, MockJudgeSettings(fault=Fault.HTTP_503))
    r = await client.post(url + path, content=body)
    assert r.status_code == 400
    assert "bad judge request" in r.json()["error"]["message"]
    assert state.calls == 1
    assert state.calls_by_path[path] == 1
    assert state.faults_injected == {}  # a rejected request does not use up a fault


# -- faults on the wire ---------------------------------------------------------------------


async def test_503_for_the_first_k_calls_then_healthy(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, state = await start_judge(nursery, MockJudgeSettings(fault=Fault.HTTP_503, fault_count=2))
    statuses = [
        (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code
        for _ in range(4)
    ]
    assert statuses == [503, 503, 200, 200]
    assert state.calls == 4
    assert state.faults_injected == {"503": 2}
    assert state.fault_remaining == 0


@pytest.mark.parametrize(("retry_after_s", "header"), [(1.0, "1"), (2.5, "2.5")])
async def test_429_carries_retry_after(
    nursery: trio.Nursery, client: httpx2.AsyncClient, retry_after_s: float, header: str
) -> None:
    settings = MockJudgeSettings(fault=Fault.HTTP_429, fault_count=1, retry_after_s=retry_after_s)
    url, _ = await start_judge(nursery, settings)
    r = await client.post(url + CHAT_PATH, json=chat_body())
    assert r.status_code == 429
    assert r.headers["retry-after"] == header
    assert (await client.post(url + CHAT_PATH, json=chat_body())).status_code == 200


async def test_408_closes_the_connection(nursery: trio.Nursery) -> None:
    url, _ = await start_judge(nursery, MockJudgeSettings(fault=Fault.HTTP_408))
    raw, error = await raw_exchange(url, msgspec.json.encode(responses_body()))
    status_line, headers, _ = split_response(raw)
    assert error is None  # a clean close after a complete answer
    assert status_line.startswith(b"HTTP/1.1 408")
    assert headers[b"connection"] == b"close"


async def test_reset_is_a_tcp_rst(nursery: trio.Nursery, client: httpx2.AsyncClient) -> None:
    url, state = await start_judge(nursery, MockJudgeSettings(fault=Fault.RESET))
    raw, error = await raw_exchange(url, msgspec.json.encode(responses_body()))
    assert raw == b""
    assert isinstance(error, trio.BrokenResourceError)
    assert isinstance(error.__cause__, ConnectionResetError)
    with pytest.raises((httpx2.ReadError, httpx2.RemoteProtocolError)):
        await client.post(url + RESPONSES_PATH, json=responses_body())
    assert state.faults_injected == {"reset": 2}


async def test_truncated_body_is_shorter_than_its_content_length(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, _ = await start_judge(nursery, MockJudgeSettings(fault=Fault.TRUNCATED))
    raw, error = await raw_exchange(url, msgspec.json.encode(responses_body()))
    status_line, headers, body = split_response(raw)
    assert error is None  # FIN, not RST
    assert status_line.startswith(b"HTTP/1.1 200")
    assert 0 < len(body) < int(headers[b"content-length"])
    with pytest.raises(httpx2.RemoteProtocolError):
        await client.post(url + RESPONSES_PATH, json=responses_body())


async def test_cut_chunked_body_never_ends(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, _ = await start_judge(nursery, MockJudgeSettings(fault=Fault.CUT_CHUNKED))
    raw, error = await raw_exchange(url, msgspec.json.encode(responses_body()))
    status_line, headers, body = split_response(raw)
    assert error is None
    assert headers[b"transfer-encoding"] == b"chunked"
    assert b"content-length" not in headers
    assert body and not body.endswith(b"0\r\n\r\n")
    with pytest.raises(httpx2.RemoteProtocolError):
        await client.post(url + CHAT_PATH, json=chat_body())


async def test_trickle_sends_a_valid_body_in_many_small_pieces(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, state = await start_judge(
        nursery, MockJudgeSettings(fault=Fault.TRICKLE, fault_count=1, trickle_interval_s=0.0005)
    )
    pieces: list[bytes] = []
    async with client.stream("POST", url + RESPONSES_PATH, json=responses_body()) as r:
        assert r.status_code == 200
        async for piece in r.aiter_raw():
            pieces.append(piece)
    assert len(pieces) > 10
    assert max(len(p) for p in pieces) < 64
    text = answer_text(RESPONSES_PATH, msgspec.json.decode(b"".join(pieces)))
    scoring.parse_judge_output(text, 3.0, 3.5)
    # the connection stays usable after a complete trickled answer
    assert (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code == 200
    assert state.connections == 1


async def test_trickle_outlasts_a_whole_call_deadline(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, state = await start_judge(nursery, MockJudgeSettings(fault=Fault.TRICKLE))
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(0.2):
            await client.post(url + RESPONSES_PATH, json=responses_body())
    with trio.fail_after(0.25):
        # the judge notices the client leaving well before its next 0.5 s trickle step
        await state.wait_for(lambda s: s.in_flight == 0)


async def test_hang_holds_the_call_until_the_client_leaves(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, state = await start_judge(nursery, MockJudgeSettings(fault=Fault.HANG, fault_count=1))
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(0.2):
            await client.post(url + RESPONSES_PATH, json=responses_body())
    assert state.max_in_flight == 1
    with trio.fail_after(5):
        await state.wait_for(lambda s: s.in_flight == 0)  # httpx2 dropped the connection
    assert (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code == 200


async def test_hang_ends_when_the_server_stops(client: httpx2.AsyncClient) -> None:
    outcome: list[BaseException] = []

    async def call(url: str) -> None:
        try:
            await client.post(url + RESPONSES_PATH, json=responses_body())
        except httpx2.TransportError as exc:
            outcome.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as server:
                url, state = await start_judge(server, MockJudgeSettings(fault=Fault.HANG))
                outer.start_soon(call, url)
                await state.wait_for(lambda s: s.in_flight == 1)
                server.cancel_scope.cancel()
    [error] = outcome
    assert isinstance(error, httpx2.RemoteProtocolError | httpx2.ReadError)


@pytest.mark.parametrize("path", [RESPONSES_PATH, CHAT_PATH])
async def test_content_faults_are_200s_without_a_usable_verdict(
    nursery: trio.Nursery, client: httpx2.AsyncClient, path: str
) -> None:
    url, state = await start_judge(nursery)
    body = responses_body() if path == RESPONSES_PATH else chat_body()
    results: dict[Fault, dict[str, Any]] = {}
    for fault in (Fault.GARBAGE, Fault.EMPTY, Fault.NONFINITE, Fault.INCOMPLETE):
        state.set_fault(fault, 1)
        r = await client.post(url + path, json=body)
        assert r.status_code == 200
        results[fault] = r.json()

    garbage = answer_text(path, results[Fault.GARBAGE])
    assert garbage.strip() and "{" not in garbage
    with pytest.raises(JudgeParseError):
        scoring.parse_judge_output(garbage, 3.0, 3.5)
    assert answer_text(path, results[Fault.EMPTY]).strip() == ""
    nonfinite = answer_text(path, results[Fault.NONFINITE])
    assert "1e999" in nonfinite
    with pytest.raises(JudgeParseError):
        scoring.parse_judge_output(nonfinite, 3.0, 3.5)
    incomplete = results[Fault.INCOMPLETE]
    if path == CHAT_PATH:  # as a real server says it: finish_reason only, no status field
        assert incomplete["choices"][0]["finish_reason"] == "length"
        assert "status" not in incomplete
    else:
        assert incomplete["status"] == "incomplete"
        assert incomplete["incomplete_details"] == {"reason": "max_output_tokens"}
    # and the judge is healthy again afterwards
    r = await client.post(url + path, json=body)
    assert r.json().get("status", "completed") == "completed"
    assert state.faults_injected == {"garbage": 1, "empty": 1, "nonfinite": 1, "incomplete": 1}


async def test_random_faults_follow_the_seed(client: httpx2.AsyncClient) -> None:
    async def statuses(seed: int) -> tuple[list[int], MockJudgeState]:
        settings = MockJudgeSettings(fault=Fault.HTTP_503, fault_rate=0.5, seed=seed)
        async with trio.open_nursery() as n:
            url, state = await start_judge(n, settings)
            got = [
                (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code
                for _ in range(40)
            ]
            n.cancel_scope.cancel()
        return got, state

    first, state = await statuses(7)
    again, _ = await statuses(7)
    other, _ = await statuses(8)
    assert first == again != other
    assert set(first) == {200, 503}
    assert state.faults_injected == {"503": first.count(503)}


def test_random_mix_leaves_out_hang_and_trickle_and_respects_the_count() -> None:
    state = MockJudgeState(Fault.NONE, 30, fault_rate=1.0, seed=3)
    drawn = [state.next_fault() for _ in range(40)]
    assert all(f is not Fault.NONE for f in drawn[:30])
    assert drawn[30:] == [Fault.NONE] * 10
    assert Fault.HANG not in drawn and Fault.TRICKLE not in drawn
    assert len(set(drawn[:30])) > 4
    assert sum(state.faults_injected.values()) == 30


# -- counters, admin, keep-alive, capacity --------------------------------------------------


async def test_admin_endpoints_drive_and_report_the_state(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, state = await start_judge(nursery)
    assert (await client.get(url + "/health")).status_code == 200
    r = await client.post(url + "/admin/fault", json={"fault": "503", "count": 1})
    assert r.status_code == 200 and r.json()["fault"] == "503"
    assert (await client.post(url + CHAT_PATH, json=chat_body())).status_code == 503
    assert (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code == 200
    stats = (await client.get(url + "/admin/stats")).json()
    assert stats == state.snapshot()
    assert stats["calls"] == 2  # admin and health requests are not judge calls
    assert stats["calls_by_path"] == {RESPONSES_PATH: 1, CHAT_PATH: 1}
    assert stats["faults_injected"] == {"503": 1}
    assert stats["in_flight"] == 0 and stats["max_in_flight"] == 1

    bad = await client.post(url + "/admin/fault", json={"fault": "teapot", "count": 1})
    assert bad.status_code == 400
    assert (
        await client.post(url + "/admin/fault", json={"fault": "408", "count": None})
    ).is_success
    assert state.fault is Fault.HTTP_408 and state.fault_remaining is None

    reset = (await client.post(url + "/admin/reset")).json()
    assert reset["calls"] == 0 and reset["faults_injected"] == {} and reset["fault"] == "none"
    assert (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code == 200
    assert (await client.get(url + "/nowhere")).status_code == 404
    assert (await client.get(url + RESPONSES_PATH)).status_code == 405


async def test_a_prompt_answered_again_counts_as_a_repeated_call(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, state = await start_judge(nursery)
    await client.post(url + "/admin/fault", json={"fault": "503", "count": 1})
    assert (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code == 503
    for _ in range(3):  # the faulted call answered nothing: the first of these is no repeat
        assert (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code == 200
    other = responses_body(principle=PRINCIPLE)
    assert (await client.post(url + RESPONSES_PATH, json=other)).status_code == 200
    stats = (await client.get(url + "/admin/stats")).json()
    assert (stats["distinct_prompts"], stats["repeated_calls"]) == (2, 2)
    reset = (await client.post(url + "/admin/reset")).json()
    assert (reset["distinct_prompts"], reset["repeated_calls"]) == (0, 0)
    assert state.repeated_calls == 0


async def test_keep_alive_serves_many_calls_on_one_connection(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, state = await start_judge(nursery, MockJudgeSettings(fault=Fault.HTTP_503, fault_count=2))
    for _ in range(6):
        await client.post(url + RESPONSES_PATH, json=responses_body())
    assert state.calls == 6
    assert state.connections == 1


async def test_capacity_limit_queues_the_rest(nursery: trio.Nursery) -> None:
    url, state = await start_judge(nursery, MockJudgeSettings(capacity=3, latency_s=0.04))
    statuses: list[int] = []

    async def call(c: httpx2.AsyncClient) -> None:
        statuses.append((await c.post(url + RESPONSES_PATH, json=responses_body())).status_code)

    limits = httpx2.Limits(max_connections=32)
    started = trio.current_time()
    async with httpx2.AsyncClient(timeout=None, limits=limits) as c:
        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                for _ in range(24):
                    n.start_soon(call, c)
                # calls wait in the queue while the three slots are busy
                await state.wait_for(lambda s: s.queued > 0 and s.in_flight == 3)
    assert statuses == [200] * 24
    assert state.max_in_flight == 3
    assert state.calls == 24 and state.in_flight == 0 and state.queued == 0
    # busy time counts only the time inside the capacity limit: 24 calls of at least 40 ms,
    # never more than 3 at once
    assert 24 * 0.04 <= state.busy_s <= 3 * (trio.current_time() - started)


async def test_given_state_takes_the_settings_fault_plan(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    mine = MockJudgeState(Fault.HTTP_408, 5)
    _, kept = await start_judge(nursery, MockJudgeSettings(), mine)
    assert kept.fault is Fault.HTTP_408 and kept.fault_remaining == 5
    other = MockJudgeState(Fault.HTTP_408, 5)
    url, replaced = await start_judge(
        nursery, MockJudgeSettings(fault=Fault.HTTP_429, fault_count=1), other
    )
    assert (await client.post(url + RESPONSES_PATH, json=responses_body())).status_code == 429
    assert replaced.fault_remaining == 0


# -- settings and CLI -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"latency": 1}, "latency"),
        ({"latency_s": -1}, "latency_s"),
        ({"latency_s": float("nan")}, "latency_s"),
        ({"capacity": 0}, "capacity"),
        ({"fault": "teapot"}, "fault"),
        ({"fault_rate": 1.5}, "fault_rate"),
        ({"port": "http"}, "port"),
        ({"fault_count": -2}, "fault_count"),
    ],
)
def test_invalid_settings_name_the_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(values)
    assert info.value.key == key


def test_settings_accept_yaml_shapes() -> None:
    s = settings_from_mapping({"fault": 503, "fault_count": None, "latency_s": 1, "capacity": 4})
    assert (s.fault, s.fault_count, s.latency_s, s.capacity) == (Fault.HTTP_503, None, 1.0, 4)


def mock_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "genrm_trio.mock.cli", *args]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
async def test_cli_prints_the_listening_line_and_exits_on_signal(
    tmp_path: Path, client: httpx2.AsyncClient, signum: signal.Signals, code: int
) -> None:
    config = tmp_path / "judge.yaml"
    config.write_text(
        "num_rollouts_per_prompt: 4\nmock_judge:\n  fault: 429\n  fault_count: 1\n",
        encoding="utf-8",
    )
    command = mock_command("--port", "0", "--config", str(config), "--set", "retry_after_s=2")
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            # run_process owns the child: a failing assertion cancels it, and it is killed.
            process: trio.Process = await n.start(
                functools.partial(
                    trio.run_process,
                    command,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    check=False,
                )
            )
            assert process.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                assert chunk, "mock judge exited before listening"
                line += chunk
            prefix = "genrm-trio mock-judge listening on http://127.0.0.1:"
            assert line.decode().startswith(prefix)
            url = line.decode().strip().removeprefix("genrm-trio mock-judge listening on ")
            first = await client.post(url + RESPONSES_PATH, json=responses_body())
            assert (first.status_code, first.headers["retry-after"]) == (429, "2")
            assert (await client.post(url + RESPONSES_PATH, json=responses_body())).is_success
            process.send_signal(signum)
            assert await process.wait() == code
            assert await process.stdout.receive_some() == b""  # nothing after the one line


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--set", "latency_s=slow"], "latency_s"),
        (["--set", "bogus=1"], "bogus"),
        (["--fault", "teapot"], "fault"),
        (["--prefix-cache", "1e4"], "prefix_cache_tokens"),
        (["--prefix-cache", "-4096"], "prefix_cache_tokens"),
    ],
)
async def test_cli_bad_setting_exits_2_with_one_line(args: list[str], key: str) -> None:
    with trio.fail_after(20):
        done = await trio.run_process(
            mock_command("--port", "0", *args),
            cwd=REPO,
            check=False,
            capture_stdout=True,
            capture_stderr=True,
        )
    assert done.returncode == 2
    assert done.stdout == b""
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and f"'{key}'" in lines[0]


# -- what a real OpenAI-compatible server does ----------------------------------------------


PLAIN_USER = (
    "Judge.\n\n<conversation>\n[user]\nName the capital of France and one landmark there.\n"
    f"</conversation>\n\n<response_1>\n{ANSWER_A}\n</response_1>\n\n"
    f"<response_2>\n{ANSWER_B}\n</response_2>\n\nReply with JSON."
)


def plain_chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "You judge."},
                         {"role": "user", "content": PLAIN_USER}], **extra}


def plain_responses(**extra: Any) -> dict[str, Any]:
    return {"input": [{"role": "system", "content": "You judge.", "type": "message"},
                      {"role": "user", "content": PLAIN_USER, "type": "message"}], **extra}


@pytest.mark.parametrize(("path", "body", "roles"), [
    (CHAT_PATH, chat_body(principle=PRINCIPLE), "principle, response_1, response_2"),
    (CHAT_PATH, chat_body(), "response_1, response_2"),
    (RESPONSES_PATH, responses_body(), "response_1, response_2"),
])
async def test_a_standard_server_refuses_genrm_roles_with_an_error_body(
    nursery: trio.Nursery, client: httpx2.AsyncClient, path: str, body: Any, roles: str
) -> None:
    url, _ = await start_judge(nursery, MockJudgeSettings(roles="standard"))
    r = await client.post(url + path, json=body)
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert f"Invalid role(s) in messages: {roles};" in message
    plain = plain_chat() if path == CHAT_PATH else plain_responses()
    assert (await client.post(url + path, json=plain)).status_code == 200


@pytest.mark.parametrize("path", [CHAT_PATH, RESPONSES_PATH])
async def test_plain_prompts_are_judged_from_their_tagged_answers(
    nursery: trio.Nursery, client: httpx2.AsyncClient, path: str
) -> None:
    url, _ = await start_judge(nursery)
    body = plain_chat() if path == CHAT_PATH else plain_responses()
    verdict = scoring.parse_judge_output(
        answer_text(path, (await client.post(url + path, json=body)).json()), 3.0, 3.5)
    assert verdict.ranking < 3.5  # the correct answer wins, as with GenRM roles
    untagged = {"messages": [{"role": "user", "content": "Which is better, A or B?"}]}
    texts = {answer_text(CHAT_PATH, (await client.post(url + CHAT_PATH, json=untagged)).json())
             for _ in range(2)}
    assert len(texts) == 1  # deterministic
    scoring.parse_judge_output(texts.pop(), 3.0, 3.5)


SCHEMA = {"type": "object", "properties": {
    "score_1": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
    "score_2": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
    "ranking": {"type": "integer", "enum": [1, 2, 3, 4, 5, 6]}},
    "required": ["score_1", "score_2", "ranking"]}


@pytest.mark.parametrize(("path", "body"), [
    (CHAT_PATH, plain_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}})),
    (CHAT_PATH, plain_chat(response_format={"type": "json_object", "schema": SCHEMA})),
    (CHAT_PATH, chat_body() | {"response_format": {"type": "json_object"}}),
    (RESPONSES_PATH, plain_responses(text={"format": {
        "type": "json_schema", "name": "v", "schema": SCHEMA, "strict": True}})),
    (RESPONSES_PATH, plain_responses(text={"format": {"type": "json_object"}})),
])
async def test_structured_output_is_honoured_as_bare_json(
    nursery: trio.Nursery, client: httpx2.AsyncClient, path: str, body: Any
) -> None:
    url, _ = await start_judge(nursery)
    r = await client.post(url + path, json=body)
    assert r.status_code == 200
    text = answer_text(path, r.json())
    verdict = msgspec.json.decode(text)  # the whole answer is the JSON object
    assert set(verdict) == {"score_1", "score_2", "ranking"}
    assert verdict["score_1"] in range(1, 6) and verdict["ranking"] in range(1, 7)


async def test_identical_answers_land_on_the_schemas_enum(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, _ = await start_judge(nursery)
    body = chat_body(ANSWER_A, ANSWER_A) | {
        "response_format": {"type": "json_object", "schema": SCHEMA}}
    verdict = msgspec.json.decode(answer_text(CHAT_PATH, (await client.post(
        url + CHAT_PATH, json=body)).json()))
    assert verdict["ranking"] == 3  # 3.5 is not in the enum: the nearest, ties to the lower
    free = (await client.post(url + CHAT_PATH, json=chat_body(ANSWER_A, ANSWER_A))).json()
    assert scoring.parse_judge_output(answer_text(CHAT_PATH, free), 3.0, 3.5).ranking == 3.5


async def test_json_schema_refused_like_llama_cpp_python(
    nursery: trio.Nursery, client: httpx2.AsyncClient
) -> None:
    url, _ = await start_judge(nursery, MockJudgeSettings(accept_json_schema=False))
    r = await client.post(url + CHAT_PATH, json=plain_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}))
    assert r.status_code == 500
    assert "input should be 'text' or 'json_object'" in r.json()["error"]["message"]
    ok = await client.post(url + CHAT_PATH, json=plain_chat(
        response_format={"type": "json_object", "schema": SCHEMA}))
    assert ok.status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    (CHAT_PATH, chat_body() | {"max_tokens": 3}),
    (RESPONSES_PATH, responses_body() | {"max_output_tokens": 3}),
])
async def test_the_output_budget_cuts_the_answer(
    nursery: trio.Nursery, client: httpx2.AsyncClient, path: str, body: Any
) -> None:
    url, _ = await start_judge(nursery)
    payload = (await client.post(url + path, json=body)).json()
    if path == CHAT_PATH:
        assert payload["choices"][0]["finish_reason"] == "length"
        assert "status" not in payload
    else:
        assert payload["status"] == "incomplete"
    assert len(answer_text(path, payload)) <= 3 * 4
    assert payload["usage"]["output_tokens" if path == RESPONSES_PATH
                            else "completion_tokens"] <= 4
