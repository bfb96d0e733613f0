"""The scale-out bench's load generator: wrk with the Lua script of genrm_trio.bench.wrk. The
script must make whole, correctly keyed cohorts, or every number the bench reports is wrong."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import trio

from genrm_trio.bench.loadgen import BodyFactory, LoadgenError
from genrm_trio.bench.wrk import cohort_script, ensure_wrk, member_templates, run_wrk
from tests.process_helpers import get_json, http_call, require_program, serve_process

N = 4


def test_templates_rebuild_every_member_body_of_any_cohort() -> None:
    bodies = BodyFactory(seed=3, run_tag="tmpl")
    templates = member_templates(bodies, N)
    assert len(templates) == N
    prompts = set()
    for cohort in (0, 7, 123456):
        members = [json.loads(str(cohort).join(parts)) for parts in templates]
        expected = json.loads(bodies.member(cohort, 0))
        for index, body in enumerate(members):
            assert body["_ng_group_id"] == expected["_ng_group_id"] == f"tmpl-g{cohort}"
            assert body["_ng_rollout_index"] == index and body["_ng_group_attempt"] == 0
            assert body["responses_create_params"] == expected["responses_create_params"]
            assert body["response"]["id"] == f"resp_{cohort}_{index}"
        prompts.add(json.dumps(members[0]["responses_create_params"]))
        assert len({json.dumps(m["response"]["output"]) for m in members}) == N  # distinct
    assert len(prompts) == 3
    script = cohort_script(bodies, N)
    assert script.count("\n  {[") == N  # one template per rollout index
    assert f"local n = {N}" in script
    with pytest.raises(ValueError):
        member_templates(bodies, 0)


@pytest.fixture(scope="session")
def wrk() -> str:
    return require_program(ensure_wrk, LoadgenError, "wrk")


async def test_wrk_sends_whole_cohorts_that_the_server_rewards(wrk: str, tmp_path: Path) -> None:
    """Every answer is a real reward, every cohort the server opened from wrk's requests was
    whole (no conflicts, nothing refused), and wrk's count matches the server's."""
    async with serve_process([f"num_rollouts_per_prompt={N}", "log_level=WARNING"],
                             tmp_path / "serve.log") as server:
        result = await run_wrk(server.url, BodyFactory(seed=5, run_tag="w"), N,
                               connections=4 * N, window_s=1, workdir=tmp_path,
                               watch=[server.proc.pid])
        # The members in flight when wrk stopped are dropped; their waiters go once their
        # cohorts watch connections (DISCONNECT_WATCH_AFTER_S): poll, never a fixed sleep.
        with trio.fail_after(30):
            while True:
                snapshot = (await get_json(server.host, server.port, "/status"))["cohorts"]
                if snapshot["waiters"] == 0:
                    break
                await trio.sleep(0.05)
        status, _, body = await http_call(server.host, server.port, "GET", "/metrics")
        assert status == 200
    # How many answers a second brings, and how much CPU wrk spends in it (read from /proc in
    # clock ticks: 0 when wrk got less than one tick), depend on the machine: only that they
    # were measured is asserted.
    assert result.good >= N and result.bad == 0, result
    assert 0 < result.window_good <= result.good and result.window_bad == 0, result
    assert result.window_s == 1.0 and result.wrk_cpu_s >= 0
    assert result.cpu_s[server.proc.pid] >= 0
    text = body.decode()

    def counter(name: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
        return float(lines[0].split()[1]) if lines else 0.0

    completed = counter("genrm_cohorts_completed_total")
    assert completed * N >= result.good  # every good answer came from a completed cohort
    assert completed * N <= result.good + 8 * N  # at most the cohorts in flight at the end
    assert snapshot["waiters"] == 0


async def test_wrk_against_nothing_is_a_clear_error(wrk: str, tmp_path: Path) -> None:
    """No server on the port: the run ends at once with a LoadgenError naming the refusal (the
    bench stops with it instead of reporting numbers), and the script file is removed."""
    with trio.socket.socket() as sock:  # a port nothing listens on once this closes
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with trio.fail_after(30), pytest.raises(LoadgenError, match="refused"):
        await run_wrk(f"http://127.0.0.1:{port}", BodyFactory(seed=6, run_tag="x"), N,
                      connections=N, window_s=1, workdir=tmp_path)
    assert not list(await trio.Path(tmp_path).glob("wrk-*.lua"))


async def test_a_window_start_without_a_second_of_load_before_it_is_refused(
        wrk: str, tmp_path: Path) -> None:
    """Runs started together share a window by passing one ``window_start``; one too soon to
    have a second of load before it is a ValueError before wrk starts (no script is left)."""
    with pytest.raises(ValueError, match="window_start"):
        await run_wrk("http://127.0.0.1:9", BodyFactory(seed=7, run_tag="s"), N,
                      connections=N, window_s=1, workdir=tmp_path,
                      window_start=int(time.time()))
    assert not list(await trio.Path(tmp_path).glob("wrk-*.lua"))
