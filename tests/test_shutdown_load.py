"""Shutdown under load: a real ``genrm-trio serve`` process with 1,000 waiting members gets
SIGTERM. Every one of the 1,000 must get a 503 JSON ``shutdown`` answer (not a dropped
connection), and the process must exit 0 within ``shutdown_grace_s``."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import trio

from tests.process_helpers import get_json, http_call, raise_fd_limit, serve_process

WAITERS = 1000
GRACE_S = 5.0
EXIT_SLACK_S = 3.0


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
    status, _, raw = await http_call(host, port, "POST", "/verify", _verify_body(index))
    answers.append((status, json.loads(raw) if raw else {}, time.monotonic()))


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM semantics")
async def test_sigterm_answers_1000_waiters_with_503_shutdown(tmp_path: Path) -> None:
    raise_fd_limit(4 * WAITERS)
    settings = ["num_rollouts_per_prompt=2", "cohort_collection_timeout_s=600",
                f"shutdown_grace_s={GRACE_S}", "log_level=WARNING"]
    async with serve_process(settings, tmp_path / "serve.stderr") as server:
        host, port = server.host, server.port
        answers: list[tuple[int, dict[str, object], float]] = []
        async with trio.open_nursery() as nursery:
            for index in range(WAITERS):
                nursery.start_soon(_one_waiter, host, port, index, answers)
            with trio.fail_after(60):
                # Real sockets, real process: poll until every member is registered.
                while True:
                    await trio.sleep(0.1)
                    with trio.move_on_after(5):
                        status = await get_json(host, port, "/status")
                        if status["cohorts"]["waiters"] == WAITERS:
                            break
            assert answers == []
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(GRACE_S + EXIT_SLACK_S + 5):
                code = await server.proc.wait()
                exited = time.monotonic()
        last_answer = max(at for _, _, at in answers)
        log = server.log_tail(2000)

    assert code == 0, log
    assert len(answers) == WAITERS
    statuses = {status for status, _, _ in answers}
    assert statuses == {503}, statuses
    assert all(body.get("failure_kind") == "shutdown" and body.get("detail")
               for _, body, _ in answers)
    answer_s, exit_s = last_answer - signalled, exited - signalled
    print(f"\nshutdown under load: {WAITERS} waiters answered 503 shutdown in "
          f"{answer_s * 1000:.0f} ms after SIGTERM; process exited 0 after "
          f"{exit_s * 1000:.0f} ms")
    # Bounded by the grace period, not by anything longer (the 600 s collection timeout): the
    # slack covers a slow or starved machine tearing a process with 1,000 connections down
    # (seen: grace + 1.4 s at an eighth of a core). How soon it exits is the release
    # preset's figure (`genrm-trio bench --preset release`), not this test's.
    assert exit_s < GRACE_S + EXIT_SLACK_S
