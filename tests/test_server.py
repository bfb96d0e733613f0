"""The HTTP surface over real sockets (hypercorn on 127.0.0.1 port 0, no autojump)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from typing import Any

import h11
import httpx2
import pytest
import trio

from genrm_trio.config import Config, JudgeConfig, format_bytes
from tests.lifecycle_helpers import body
from tests.server_helpers import raw_http, read_answer, running_server


def verify_bytes(obj: Any) -> bytes:
    return json.dumps(obj).encode()


async def wait_for_cohorts(client: httpx2.AsyncClient, key: str, predicate: Any,
                           timeout_s: float = 20.0) -> None:
    """Poll GET /status until ``predicate(cohorts[key])``: the server is another party here, its
    state is only visible over HTTP, so polling (bounded by a deadline) is the honest way."""
    with trio.fail_after(timeout_s):
        while not predicate((await client.get("/status")).json()["cohorts"][key]):  # noqa: ASYNC110
            await trio.sleep(0.01)


async def post_all(
    client: httpx2.AsyncClient, bodies: list[dict[str, Any]],
) -> list[httpx2.Response]:
    results: list[httpx2.Response | None] = [None] * len(bodies)

    async def one(i: int) -> None:
        results[i] = await client.post("/verify", json=bodies[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(bodies)):
            nursery.start_soon(one, i)
    return [r for r in results if r is not None]


async def test_cohort_over_http_echoes_and_rewards_by_slot() -> None:
    cfg = Config(num_rollouts_per_prompt=3, port=0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        bodies = [body(s, group="http", attempt=None, carried={"k": s}) for s in (2, 0, 1)]
        bodies[0]["group_id"] = bodies[0].pop("_ng_group_id")  # the old alias spelling
        answers = await post_all(client, bodies)
        for sent, got in zip(bodies, answers, strict=True):
            assert got.status_code == 200
            data = got.json()
            assert data["carried"] == sent["carried"]
            assert data["response"] == sent["response"]
            assert data["responses_create_params"] == sent["responses_create_params"]
            assert data["_ng_group_id"] == "http" and "group_id" not in data
            assert data["_ng_group_attempt"] == 0
            assert data["_ng_rollout_index"] == sent["_ng_rollout_index"]
            assert (data["mask_sample"], data["failure_kind"], data["failure_reason"]) == (
                False, None, None)
            assert isinstance(data["reward"], float)
        status = (await client.get("/status")).json()
        assert status["cohorts"]["active_cohorts"] == 0 and status["cohorts"]["waiters"] == 0
        assert status["judge"]["kind"] == "builtin"


async def test_masked_judge_failure_has_the_exact_shape() -> None:
    # A closed judge port: every attempt fails to connect, the budget runs out quickly.
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    cfg = Config(
        num_rollouts_per_prompt=2, port=0, genrm_parse_retries=1,
        genrm_parse_retry_sleep_s=0.01, judge_request_timeout_s=5.0,
        judge=JudgeConfig(base_urls=(f"http://127.0.0.1:{dead_port}",)),
    )
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        bodies = [body(s, group=None, attempt=None, task=5,
                       instance_config={"dataset": "x", "mask_sample": False}) for s in range(2)]
        with trio.fail_after(5.0):  # fails within the request deadline, not after it
            answers = await post_all(client, bodies)
        for sent, got in zip(bodies, answers, strict=True):
            assert got.status_code == 200
            data = got.json()
            expected_keys = set(sent) | {
                "reward", "mask_sample", "failure_kind", "failure_reason", "instance_config",
                "_ng_failure_class", "_ng_failure_judge_error"}
            assert set(data) == expected_keys
            for key, value in sent.items():
                if key != "instance_config":
                    assert data[key] == value
            assert data["reward"] == 0.0 and data["mask_sample"] is True
            assert data["failure_kind"] == "judge_failed"
            assert data["_ng_failure_class"] == "judge_failed"
            assert data["instance_config"] == {"dataset": "x", "mask_sample": True}
            reason = data["failure_reason"]
            assert reason == data["_ng_failure_judge_error"] and len(reason) <= 2000
            assert str(dead_port) in reason
            assert reason.endswith("keep their recorded failure).")  # fresh-id guidance
        # The failed legacy cohort is retained: a regenerated answer gets the same failure.
        again = await client.post("/verify", json=body(0, group=None, attempt=None, task=5,
                                                       text="regenerated"))
        assert again.json()["failure_reason"] == answers[0].json()["failure_reason"]


async def test_bad_inputs_get_specific_errors_and_change_nothing() -> None:
    cfg = Config(num_rollouts_per_prompt=4, port=0, max_request_bytes=4096)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        pending = body(0, group="keep")

        async def waiting() -> None:
            await client.post("/verify", json=pending)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting)
            await wait_for_cohorts(client, "waiters", lambda n: n == 1)
            before = (await client.get("/status")).json()["cohorts"]
            cases: list[tuple[bytes, int, str, str]] = [
                (b"{not json", 400, "bad_request", "not valid JSON"),
                (b"[1, 2]", 400, "bad_request", "JSON object"),
                (verify_bytes({**body(1, group="keep"), "response": "text"}), 400,
                 "bad_request", "$.response"),
                (verify_bytes({**body(1, group="keep"), "_ng_rollout_index": "1"}), 400,
                 "bad_request", "$._ng_rollout_index"),
                (verify_bytes({**body(1, group="keep"), "responses_create_params": {}}), 400,
                 "bad_request", "$.responses_create_params.input"),
                (verify_bytes(body(None, group="keep")), 422, "bad_coordinates",
                 "_ng_rollout_index"),
                (verify_bytes(body(4, group="keep")), 422, "bad_coordinates", "[0, 4)"),
                (verify_bytes(body(1, group="keep", attempt=-1)), 422, "bad_coordinates",
                 "_ng_group_attempt"),
                (verify_bytes(body(0, group="keep", text="other")), 409, "conflict", "slot 0"),
                (verify_bytes(body(1, group="keep", text="x" * 5000)), 413, "too_large",
                 "max_request_bytes"),
            ]
            for payload, status, kind, needle in cases:
                got = await client.post("/verify", content=payload)
                assert got.status_code == status, (payload[:80], got.text)
                assert got.headers["content-type"] == "application/json"
                assert got.json()["failure_kind"] == kind
                assert needle in got.json()["detail"]
            assert (await client.get("/status")).json()["cohorts"] == before
            nursery.cancel_scope.cancel()


async def test_keep_alive_connection_survives_every_kind_of_answer() -> None:
    cfg = Config(num_rollouts_per_prompt=1, port=0, max_request_bytes=4096)
    async with running_server(cfg) as url:
        ok = verify_bytes(body(None, group=None))
        answers = await raw_http(url, [
            ("POST", "/verify", ok),
            ("POST", "/verify", b"[]"),
            ("POST", "/verify", ok),
            ("GET", "/health", b""),
            ("POST", "/seed_session", verify_bytes({"resources_session_id": "s-1"})),
            ("POST", "/close_session", b"{}"),
            ("GET", "/reverify_mode", b""),
            ("GET", "/nope", b""),
            ("GET", "/verify", b""),
            ("POST", "/verify", ok),
        ])
        assert [a[0] for a in answers] == [200, 400, 200, 200, 200, 200, 200, 404, 405, 200]
        assert answers[8][1]["allow"] == "POST"
        first = json.loads(answers[0][2])
        assert first["reward"] == 3.0 and first["mask_sample"] is False  # N <= 1 short cut
        assert json.loads(answers[4][2]) == {"resources_session_id": "s-1"}
        assert json.loads(answers[5][2]) == {}
        assert json.loads(answers[6][2]) == "unsupported"
        assert json.loads(answers[7][2])["detail"]
        # Too large: a JSON 413, then the server closes the connection rather than hang it.
        big = await raw_http(url, [("POST", "/verify", b"x" * 10_000), ("GET", "/health", b"")])
        assert big[0][0] == 413 and json.loads(big[0][2])["failure_kind"] == "too_large"
        assert len(big) == 1


async def test_compare_health_readiness_and_no_secret_leaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GENRM_TEST_JUDGE_KEY", "sk-very-secret-value")
    cfg = Config(num_rollouts_per_prompt=2, port=0,
                 judge=JudgeConfig(api_key_env="GENRM_TEST_JUDGE_KEY"))
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        responses = [body(s)["response"] for s in range(3)]
        got = await client.post("/compare", json={
            "conversation_history": [{"role": "user", "content": "Why is the sky blue?"}],
            "response_objs": responses,
        })
        data = got.json()
        assert got.status_code == 200 and len(data["rewards"]) == 3
        assert [(c["response_i"], c["response_j"]) for c in data["comparison_results"]] == [
            (0, 1), (1, 2), (2, 0)]
        assert set(data["metrics"]) >= {"mean_individual_score", "tiebreak_usage_rate"}
        one = (await client.post("/compare", json={
            "conversation_history": [], "response_objs": responses[:1]})).json()
        assert one == {"rewards": [3.0], "comparison_results": None, "metrics": None}
        bad = await client.post("/compare", json={"conversation_history": [],
                                                  "response_objs": "x"})
        assert bad.status_code == 400 and "$.response_objs" in bad.json()["detail"]
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200
        status = await client.get("/status")
        metrics = await client.get("/metrics")
        for text in (status.text, metrics.text):
            assert "sk-very-secret-value" not in text
        assert status.json()["config"]["genrm_responses_create_params"][
            "max_output_tokens"] == 16384
        assert "genrm_cohorts_opened_total" in metrics.text
        assert (await client.get("/readyz")).json() == {"status": "ready"}


async def test_default_byte_budget_is_shown_in_status_and_answers_429_past_it() -> None:
    cfg = Config(num_rollouts_per_prompt=2, port=0)  # max_active_bytes: auto
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        config = (await client.get("/status")).json()["config"]
    assert isinstance(config["memory_limit_bytes"], int) and config["memory_limit_source"]
    assert config["max_active_bytes"] == config["memory_limit_bytes"] // 4
    assert config["max_active_bytes_source"] == (
        "auto: a quarter of memory_limit_bytes "
        f"({format_bytes(config['memory_limit_bytes'])}, {config['memory_limit_source']})")

    # A budget of 2 MiB (auto, from memory_limit_bytes) and members of 1.5 MB each.
    cfg = Config(num_rollouts_per_prompt=2, port=0, memory_limit_bytes=8 * 2**20)
    big = "a" * 1_500_000
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        async with trio.open_nursery() as nursery:
            answers: dict[str, httpx2.Response] = {}

            async def send(name: str, sent: dict[str, Any]) -> None:
                answers[name] = await client.post("/verify", json=sent)

            for opened, name in enumerate(("a", "b"), 1):  # 1.5 MB, then 3 MB held
                nursery.start_soon(send, f"{name}0", body(0, group=name, text=big))
                await wait_for_cohorts(client, "active_cohorts", lambda n: n == opened)  # noqa: B023
            refused = await client.post("/verify", json=body(0, group="c", text=big))
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["failure_kind"] == "overloaded"
            assert "max_active_bytes (2097152) reached" in refused.json()["detail"]
            for name in ("a", "b"):  # members of open cohorts are admitted past the budget
                nursery.start_soon(send, f"{name}1", body(1, group=name, text=big))
        assert {k: r.status_code for k, r in answers.items()} == {
            "a0": 200, "a1": 200, "b0": 200, "b1": 200}
        assert (await client.get("/status")).json()["cohorts"]["active_bytes"] == 0


async def test_client_disconnect_releases_only_its_waiter() -> None:
    cfg = Config(num_rollouts_per_prompt=2, port=0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        payload = verify_bytes(body(0, group="gone"))
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

        await wait_for_cohorts(client, "waiters", lambda n: n == 1)
        await stream.aclose()  # the client goes away
        await wait_for_cohorts(client, "waiters", lambda n: n == 0)
        assert (await client.get("/status")).json()["cohorts"]["active_cohorts"] == 1
        first, second = await post_all(client, [body(0, group="gone"), body(1, group="gone")])
        assert first.status_code == second.status_code == 200  # identical retry re-attaches


def decoded_holders(text: str) -> list[object]:
    """Every garbage-collected container that holds the string ``text``, directly or in a dict
    it holds (CPython leaves a dict of strings untracked, so it is not found on its own)."""
    found: list[object] = []
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            values: Any = obj.values()
        elif isinstance(obj, (list, tuple)):
            values = obj
        else:
            continue
        for value in values:
            if (isinstance(value, str) and value == text) or (
                    isinstance(value, dict) and any(
                        isinstance(v, str) and v == text for v in value.values())):
                found.append(obj)
                break
    return found


async def test_waiting_members_hold_their_body_as_bytes_not_decoded() -> None:
    """Issue 21: a member waits holding the bytes it was sent (decoded again for its answer),
    not the decoded body, which takes about twice the memory in dozens of objects. While two
    members wait, no decoded copy of their answers exists anywhere in the process; their
    answers still echo what they sent."""
    cfg = Config(num_rollouts_per_prompt=3, port=0)

    def text(slot: int) -> str:  # built afresh on each call: the test holds no copy
        return f"bytes-only answer {slot}: " + "shorter wavelengths scatter more. " * 8

    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        waiting = []
        for s in (0, 1):
            payload = verify_bytes(body(s, group="bytes", text=text(s)))
            stream = await trio.open_tcp_stream(host, int(port))
            conn = h11.Connection(h11.CLIENT)
            headers = [("Host", host), ("Content-Length", str(len(payload))),
                       ("Content-Type", "application/json")]
            await stream.send_all(conn.send(h11.Request(method="POST", target="/verify",
                                                        headers=headers))
                                  + conn.send(h11.Data(data=payload))
                                  + conn.send(h11.EndOfMessage()))
            waiting.append((stream, conn))
            del payload
        await wait_for_cohorts(client, "waiters", lambda n: n == 2)
        gc.collect()
        assert [decoded_holders(text(s)) for s in (0, 1)] == [[], []]
        last = await client.post("/verify", json=body(2, group="bytes", text=text(2)))
        assert last.status_code == 200
        for s, (stream, conn) in enumerate(waiting):
            async with stream:
                answer = await read_answer(stream, conn)
            assert answer is not None and answer[0] == 200
            sent = body(s, group="bytes", text=text(s))
            got = json.loads(answer[2])
            assert {k: got[k] for k in sent} == sent


def our_frames_of_waiting_handlers() -> list[list[str]]:
    """For each task of this process waiting in the registry, the names of the coroutine frames
    of the handler and the registry (server/app.py, server/cohort.py) it is suspended in,
    outermost first."""
    found: list[list[str]] = []
    tasks = [trio.lowlevel.current_root_task()]
    while tasks:
        task = tasks.pop()
        tasks.extend(t for n in task.child_nurseries for t in n.child_tasks)
        names: list[str] = []
        awaited: Any = task.coro
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None and frame.f_code.co_filename.endswith(
                    ("genrm_trio/server/app.py", "genrm_trio/server/cohort.py")):
                names.append(frame.f_code.co_name)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        if "verify_unless_gone" in names:
            found.append(names)
    return found


async def test_a_waiting_handler_is_three_frames_deep_then_four_watching() -> None:
    """Issue 21: each coroutine frame a waiting /verify request is suspended in costs a few
    hundred bytes per waiter. The ASGI application, the endpoint and the registry's wait; once
    the cohort is old enough to watch connections, the read of the client's connection."""
    cfg = Config(num_rollouts_per_prompt=2, port=0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        payload = verify_bytes(body(0, group="frames"))
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(
                b"POST /verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            await wait_for_cohorts(client, "waiters", lambda n: n == 1)
            waiting = ["application", "__call__", "verify_unless_gone"]
            assert our_frames_of_waiting_handlers() == [waiting]
            with trio.fail_after(20.0):  # the registry's watch timer, DISCONNECT_WATCH_AFTER_S
                while our_frames_of_waiting_handlers() != [[*waiting, "_until_disconnect"]]:  # noqa: ASYNC110
                    await trio.sleep(0.01)
        await wait_for_cohorts(client, "waiters", lambda n: n == 0)


def test_sigterm_answers_200_waiting_members_and_exits_zero(tmp_path: Any) -> None:
    """A real `genrm-trio serve` process, 200 members waiting in incomplete cohorts, SIGTERM."""
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
         "--set", "num_rollouts_per_prompt=4", "--set", "shutdown_grace_s=5"],
        stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        url = line.split("listening on ", 1)[1].strip()
        results: list[httpx2.Response] = []

        async def main() -> None:
            limits = httpx2.Limits(max_connections=250)
            async with httpx2.AsyncClient(base_url=url, limits=limits, timeout=30) as client:

                async def one(i: int) -> None:
                    member = body(i % 3, group=f"g{i // 3}")
                    results.append(await client.post("/verify", json=member))

                async with trio.open_nursery() as nursery:
                    for i in range(200):
                        nursery.start_soon(one, i)
                    await wait_for_cohorts(client, "waiters", lambda n: n >= 200)
                    proc.send_signal(signal.SIGTERM)

        trio.run(main)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        log.close()
    assert len(results) == 200
    assert {r.status_code for r in results} == {503}
    assert {r.json()["failure_kind"] for r in results} == {"shutdown"}


async def test_connection_close_requests_get_their_socket_closed() -> None:
    """A client that sends `Connection: close` reads to EOF; the server must close its side
    after the answer, on Quart routes and on the /verify fast path alike."""
    cfg = Config(num_rollouts_per_prompt=1, port=0)
    async with running_server(cfg) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        payload = verify_bytes(body(None, group=None))
        for raw in (
            b"GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"POST /verify HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload,
        ):
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(raw)
                received = b""
                with trio.fail_after(5.0):
                    while chunk := await stream.receive_some(65536):
                        received += chunk
            assert received.startswith(b"HTTP/1.1 200")
