"""Shutdown under load: a real ``genrm-trio serve`` process with 1,000 waiting members gets
SIGTERM. Every one of the 1,000 must get a 503 JSON ``shutdown`` answer (not a dropped
connection), and the process must exit 0 within ``shutdown_grace_s``."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import h11
import pytest
import trio

WAITERS = 1000
GRACE_S = 5.0
REPO = Path(__file__).resolve().parent.parent


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _verify_body(index: int) -> bytes:
    return json.dumps({
        "responses_create_params": {"input": f"Prompt number {index}"},
        "response": {"output": [{"type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": f"a{index}"}]}]},
        "_ng_group_id": f"load-{index}",
        "_ng_group_attempt": 0,
        "_ng_rollout_index": 0,
    }).encode()


async def _one_waiter(host: str, port: int, index: int,
                      answers: list[tuple[int, dict[str, object], float]]) -> None:
    """One raw-socket request; records (status, JSON body, arrival time) of its answer. A
    dropped connection records status 0."""
    body = _verify_body(index)
    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(
            conn.send(h11.Request(method="POST", target="/verify", headers=[
                ("Host", host), ("Content-Type", "application/json"),
                ("Content-Length", str(len(body)))]))
            + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        status, raw = 0, b""
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                status = 0
                break
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                raw += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    answers.append((status, json.loads(raw) if raw else {}, time.monotonic()))


async def _get_json(host: str, port: int, path: str) -> dict[str, object]:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                              .encode())
        raw = b""
        while chunk := await stream.receive_some(65536):
            raw += chunk
    result: dict[str, object] = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    return result


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM semantics")
async def test_sigterm_answers_1000_waiters_with_503_shutdown(tmp_path: Path) -> None:
    _raise_fd_limit(4 * WAITERS)
    stderr_path = tmp_path / "serve.stderr"
    with stderr_path.open("wb") as stderr_file:  # noqa: ASYNC230 - before any task runs
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
             "--set", "num_rollouts_per_prompt=2", "--set", "cohort_collection_timeout_s=600",
             "--set", f"shutdown_grace_s={GRACE_S}", "--set", "log_level=WARNING"],
            stdout=subprocess.PIPE, stderr=stderr_file, cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    assert proc.stdout is not None
    try:
        with trio.fail_after(30):
            seen = b""
            while b"listening on http://" not in seen or not seen.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, f"serve exited early: {stderr_path.read_text()[-2000:]}"
                seen += chunk
        url = seen.decode().split("listening on ", 1)[1].split()[0]
        host, port_text = url.removeprefix("http://").rsplit(":", 1)
        port = int(port_text)

        answers: list[tuple[int, dict[str, object], float]] = []
        async with trio.open_nursery() as nursery:
            for index in range(WAITERS):
                nursery.start_soon(_one_waiter, host, port, index, answers)
            with trio.fail_after(60):
                # Real sockets, real process: poll until every member is registered.
                while True:
                    await trio.sleep(0.1)
                    with trio.move_on_after(5):
                        status = await _get_json(host, port, "/status")
                        cohorts = status["cohorts"]
                        assert isinstance(cohorts, dict)
                        if cohorts["waiters"] == WAITERS:
                            break
            assert answers == []
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(GRACE_S + 5):
                code = await proc.wait()
                exited = time.monotonic()
        last_answer = max(at for _, _, at in answers)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    assert code == 0, stderr_path.read_text()[-2000:]
    assert len(answers) == WAITERS
    statuses = {status for status, _, _ in answers}
    assert statuses == {503}, statuses
    assert all(body.get("failure_kind") == "shutdown" and body.get("detail")
               for _, body, _ in answers)
    answer_s, exit_s = last_answer - signalled, exited - signalled
    print(f"\nshutdown under load: {WAITERS} waiters answered 503 shutdown in "
          f"{answer_s * 1000:.0f} ms after SIGTERM; process exited 0 after "
          f"{exit_s * 1000:.0f} ms")
    assert exit_s < GRACE_S + 1.0
