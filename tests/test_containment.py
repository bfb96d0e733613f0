"""Containment: whatever one cohort meets (a crash, absurd verdicts, a failing journal, a slow
client) stays inside that cohort or request; every other cohort and the process go on."""

from __future__ import annotations

import functools
import logging
import sqlite3
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio
import trio.testing

from genrm_trio import scoring, wire
from genrm_trio.config import Config, JudgeConfig
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.app import VerifyEndpoint
from genrm_trio.server.cohort import CohortRegistry, Failure, Rewarded
from genrm_trio.server.journal import FILE_NAME, Journal
from genrm_trio.server.judge import JudgeRequest
from tests.lifecycle_helpers import Outcomes, ScriptedJudge, body, member, open_registry
from tests.server_helpers import running_server

N = 3


def cfg_for(**kw: Any) -> Config:
    base: dict[str, Any] = {"num_rollouts_per_prompt": N, "cohort_collection_timeout_s": 30.0,
                            "cohort_evaluation_timeout_s": 20.0}
    base.update(kw)
    return Config(**base)


async def run_group(registry: CohortRegistry, cfg: Config, **kw: Any) -> Outcomes:
    async with trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot in range(cfg.num_rollouts_per_prompt):
            out.send(f"m{slot}", member(cfg, slot, **kw))
    return out


class PoisonJudge(ScriptedJudge):
    """Answers absurd verdicts (as a broken plugin could) for prompts that ask for them."""

    async def judge_pair(self, request: JudgeRequest, group: object = None,
                         trace: object = None) -> scoring.Verdict:
        verdict = await super().judge_pair(request)
        if "poison" in request.history[-1]["content"]:
            sign = 1.0 if request.response_1 < request.response_2 else -1.0
            return scoring.Verdict(score_1=sign * 1.7e308, score_2=-sign * 1.7e308, ranking=1.0)
        return verdict


async def test_a_crashing_cohort_fails_alone_and_is_logged_once(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = cfg_for()
    real_aggregate = scoring.aggregate
    crashes = 0

    def sometimes_broken(comparisons: Any, responses: Any, config: Config, **kw: Any) -> Any:
        nonlocal crashes
        if any("crash" in str(r) for r in responses):
            crashes += 1
            raise KeyError("a bug nobody anticipated")
        return real_aggregate(comparisons, responses, config, **kw)

    monkeypatch.setattr(scoring, "aggregate", sometimes_broken)
    caplog.set_level(logging.ERROR, logger="genrm_trio.server.cohort")
    async with open_registry(cfg, ScriptedJudge(latency_s=1.0)) as registry:
        async with trio.open_nursery() as nursery:
            bad = Outcomes(registry, nursery)
            good = Outcomes(registry, nursery)
            for slot in range(N):
                bad.send(f"b{slot}", member(cfg, slot, group="bad", text=f"crash {slot}"))
                good.send(f"g{slot}", member(cfg, slot, group="good"))
        for slot in range(N):
            failure = bad.failure(f"b{slot}")
            assert (failure.status, failure.kind) == (503, "evaluation_error")
            assert "KeyError" in failure.detail and "a bug nobody anticipated" in failure.detail
            assert isinstance(good.results[f"g{slot}"][1], Rewarded)
        assert crashes == 1
        crash_logs = [r for r in caplog.records if "crashed" in r.getMessage()]
        assert len(crash_logs) == 1 and crash_logs[0].exc_info is not None
        assert registry.counters["cohort_task_crashes"] == 1
        # The registry still serves: a new cohort completes, the failed one is retained.
        after = await run_group(registry, cfg, group="after")
        assert all(isinstance(after.results[f"m{s}"][1], Rewarded) for s in range(N))
        again = await registry.verify(member(cfg, 0, group="bad", text="crash 0"))
        assert again == bad.failure("b0")


async def test_extreme_verdicts_fail_only_their_cohort(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for()
    async with open_registry(cfg, PoisonJudge()) as registry:
        async with trio.open_nursery() as nursery:
            bad = Outcomes(registry, nursery)
            good = Outcomes(registry, nursery)
            for slot in range(N):
                bad.send(f"b{slot}", member(cfg, slot, group="bad", prompt="poison please"))
                good.send(f"g{slot}", member(cfg, slot, group="good"))
        failure = bad.failure("b0")
        assert (failure.status, failure.kind) == (503, "evaluation_error")
        assert "reward aggregation failed" in failure.detail and "score_1" in failure.detail
        assert all(isinstance(good.results[f"g{s}"][1], Rewarded) for s in range(N))


def test_parsed_verdicts_outside_the_scale_are_not_verdicts() -> None:
    for text in (
        '{"score_1": 1.7e308, "score_2": -1.7e308, "ranking": 1}',
        '{"score_1": 6, "score_2": 3}',
        '{"score_1": 0, "score_2": 3}',
        '{"ranking": 7}',
        '{"ranking": 0.5}',
        '{"score_1": [4], "score_2": 3}',
        '{"score_1": {"v": 4}, "score_2": 3}',
    ):
        with pytest.raises(scoring.JudgeParseError):
            scoring.parse_judge_output(text, 3.0, 3.5)
    edge = scoring.parse_judge_output('{"score_1": 1, "score_2": 5, "ranking": 6}', 3.0, 3.5)
    assert edge == scoring.Verdict(score_1=1.0, score_2=5.0, ranking=6.0)


async def test_watermark_pruning_never_visits_active_groups(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = Config(num_rollouts_per_prompt=2, max_terminal_cohorts=1000,
                 cohort_collection_timeout_s=1e6)
    async with open_registry(cfg, ScriptedJudge()) as registry:
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            for g in range(3000):  # completed groups: idle watermarks over the record cap
                for slot in range(2):
                    out.send(f"done{g}-{slot}", member(cfg, slot, group=f"done{g}"))
                await trio.testing.wait_all_tasks_blocked()
            for g in range(5000):  # 5,000 active groups (collecting)
                out.send(f"a{g}", member(cfg, 0, group=f"active{g}"))
            await trio.testing.wait_all_tasks_blocked()
            assert registry.snapshot()["active_cohorts"] == 5000
            visits = []
            for g in range(200):
                before = registry.watermark_visits
                out.send(f"n{g}", member(cfg, 0, group=f"new{g}"))
                await trio.testing.wait_all_tasks_blocked()
                visits.append(registry.watermark_visits - before)
            # One visit stops the walk per prune; each admission prunes once or twice (the
            # request, and the retirement of nothing): never a walk over the active groups.
            assert max(visits) <= 2, visits
            assert registry.snapshot()["watermarks"] <= 5000 + 200 + 2 * 1000
            registry.begin_shutdown()


async def test_duplicate_waiters_count_towards_max_active_bytes(
    autojump_clock: trio.abc.Clock,
) -> None:
    one = member(cfg_for(), 0, group="a").size_bytes
    cfg = cfg_for(max_active_bytes=3 * one)
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("first", member(cfg, 0, group="a"))
        await trio.testing.wait_all_tasks_blocked()
        assert registry.snapshot()["active_bytes"] == one
        out.send("dup1", member(cfg, 0, group="a"))
        out.send("dup2", member(cfg, 0, group="a"))
        await trio.testing.wait_all_tasks_blocked()
        assert registry.snapshot()["active_bytes"] == 3 * one
        refused = await registry.verify(member(cfg, 0, group="b"))
        assert isinstance(refused, Failure) and refused.kind == "overloaded"
        out.disconnect("dup1")
        await trio.testing.wait_all_tasks_blocked()
        assert registry.snapshot()["active_bytes"] == 2 * one
        out.send("b0", member(cfg, 0, group="b"))  # room again: admitted
        await trio.testing.wait_all_tasks_blocked()
        assert registry.snapshot()["active_cohorts"] == 2
        registry.begin_shutdown()


def test_a_member_weighs_what_its_decoded_body_holds() -> None:
    # One character outside Latin-1 makes every character of a Python string 2 bytes, one
    # outside the BMP 4 (measured: RSS per 1 MB body 1.06x, 2.03x, 4.02x; bench/README.md).
    cfg = cfg_for()
    text = "a" * 100_000
    wire_sizes = []
    held = []
    for last in ("a", "\u2014", "\U0001F600"):
        raw = msgspec.json.encode(body(0, text=text[:-1] + last))
        wire_sizes.append(len(raw))
        held.append(member(cfg, 0, text=text[:-1] + last).size_bytes)
    assert max(wire_sizes) - min(wire_sizes) <= 12  # the same size on the wire
    assert 1.0 <= held[0] / wire_sizes[0] < 1.1
    assert 1.9 < held[1] / held[0] < 2.1
    assert 3.8 < held[2] / held[0] < 4.1
    small_objects = b'{"responses_create_params": {"input": "x"}, "response": {"output": [' + (
        b",".join([b"{}"] * 10_000)) + b']}, "_ng_rollout_index": 0}'
    assert wire.decode_verify(small_objects, N).size_bytes > 20 * len(small_objects)


async def test_the_byte_budget_counts_decoded_bytes_and_refuses_new_cohorts_only(
    autojump_clock: trio.abc.Clock,
) -> None:
    text = "a" * 100_000
    ascii_size = member(cfg_for(), 0, group="x", text=text).size_bytes
    cfg = cfg_for(max_active_bytes=3 * ascii_size)
    emoji = text[:-1] + "\U0001F600"  # same wire size, four times the memory
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("e0", member(cfg, 0, group="e", text=emoji))
        await trio.testing.wait_all_tasks_blocked()
        assert registry.snapshot()["active_bytes"] > 3 * ascii_size
        refused = await registry.verify(member(cfg, 0, group="b", text=text))
        assert isinstance(refused, Failure)
        assert (refused.status, refused.kind, refused.retry_after_s) == (429, "overloaded", 1.0)
        assert f"max_active_bytes ({3 * ascii_size}) reached" in refused.detail
        for slot in range(1, N):  # the open cohort's members are admitted past the budget
            out.send(f"e{slot}", member(cfg, slot, group="e", text=emoji))
    assert all(isinstance(out.results[f"e{s}"][1], Rewarded) for s in range(N))


async def test_the_default_budget_is_resolved_by_the_registry(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(memory_limit_bytes=8 * 2**20)  # auto: a quarter, 2 MiB
    one = member(cfg, 0, group="a", text="a" * 1_500_000).size_bytes
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        out.send("a0", member(cfg, 0, group="a", text="a" * 1_500_000))
        await trio.testing.wait_all_tasks_blocked()
        assert registry.snapshot()["active_bytes"] == one < 2 * 2**20
        out.send("b0", member(cfg, 0, group="b", text="a" * 1_500_000))  # still under: admitted
        await trio.testing.wait_all_tasks_blocked()
        refused = await registry.verify(member(cfg, 0, group="c"))
        assert isinstance(refused, Failure) and refused.kind == "overloaded"
        assert f"max_active_bytes ({2 * 2**20}) reached" in refused.detail
        registry.begin_shutdown()


async def test_a_trickled_body_gets_408_at_the_read_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(request_read_timeout_s=7.0)
    async with open_registry(cfg, ScriptedJudge()) as registry:
        endpoint = VerifyEndpoint(cfg, registry)
        sent: list[dict[str, Any]] = []
        raw = msgspec.json.encode(body(0))
        chunks = [raw[:10], raw[10:20]]

        async def receive() -> dict[str, Any]:
            if chunks:
                await trio.sleep(3.0)  # a piece every 3 s, then nothing more
                return {"type": "http.request", "body": chunks.pop(0), "more_body": True}
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        started = trio.current_time()
        scope = {"type": "http", "method": "POST", "path": "/verify",
                 "headers": [(b"content-type", b"application/json")]}
        await endpoint(scope, receive, send)
        assert trio.current_time() - started == 7.0
        assert sent[0]["status"] == 408
        assert (b"connection", b"close") in sent[0]["headers"]
        answer = msgspec.json.decode(sent[1]["body"])
        assert answer["failure_kind"] == "request_timeout"
        assert "request_read_timeout_s" in answer["detail"]
        assert registry.snapshot()["active_cohorts"] == 0  # nothing was admitted


# ------------------------------------------------------------------------- journal faults


def _fill_disk(journal: Journal) -> None:
    """Make the database full: no page can be added any more (SQLITE_FULL)."""
    db = journal._db
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")


def _read_only(path: Path) -> Journal:
    Journal.open(str(path)).close()
    connection = sqlite3.connect(f"file:{path / FILE_NAME}?mode=ro", uri=True,
                                 isolation_level=None, check_same_thread=False)
    return Journal(connection, str(path / FILE_NAME))


@pytest.mark.parametrize("fault", ["disk_full", "read_only", "closed"])
async def test_journal_faults_degrade_and_answers_still_go_out(
    tmp_path: Path, autojump_clock: trio.abc.Clock, fault: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = cfg_for(state_dir=str(tmp_path))
    if fault == "read_only":
        journal = _read_only(tmp_path)
    else:
        journal = Journal.open(str(tmp_path))
    judge = ScriptedJudge()
    async with open_registry(cfg, judge, journal=journal) as registry:
        await run_group(registry, cfg, group="before-fault")
        assert journal.degraded is (fault == "read_only")  # read-only fails from the start
        if fault == "disk_full":
            # Writes fit until the file must grow: add records until it does.
            _fill_disk(journal)
        elif fault == "closed":
            journal._db.close()
        for g in range(40):
            out = await run_group(registry, cfg, group=f"g{g}",
                                  text=f"a long answer to fill pages {'x' * 2000} {g}")
            assert all(isinstance(out.results[f"m{s}"][1], Rewarded) for s in range(N))
        judge.mode = "fail"
        masked = await run_group(registry, cfg, group="masked")
        assert masked.failure("m0").masked
        state = journal.status()
        assert state["degraded"] is True and state["failed_writes"] > 0
        assert state["last_error"]
        # Memory stays the truth: replay and failure records work without the journal.
        replay = await registry.verify(member(cfg, 0, group="g3",
                                              text=f"a long answer to fill pages {'x' * 2000} 3"))
        assert isinstance(replay, Rewarded)
        assert await registry.verify(member(cfg, 1, group="masked")) == masked.failure("m1")
    degraded_logs = [r for r in caplog.records if "degraded" in r.getMessage()]
    assert len(degraded_logs) == 1  # logged once, counted always


async def test_reload_skips_bad_rows_with_one_warning(
    tmp_path: Path, autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = cfg_for()
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, ScriptedJudge(), journal=journal) as registry:
        for g in range(3):
            await run_group(registry, cfg, group=f"g{g}")
    db = journal._db
    db.execute("UPDATE records SET rewards = '[1.0, \"x\", 2.0]' WHERE key LIKE '%g0%'")
    db.execute("INSERT INTO records VALUES ('not json', 99, NULL, '[]', '[]', NULL)")
    db.execute("INSERT INTO records VALUES ('[\"h\",null,-1]', 98, NULL, '[]', '[]', "
               "'{\"status\": 503}')")
    db.execute("INSERT INTO watermarks VALUES ('w', 97, 0, 'abc', 1.0, 0)")
    journal.close()

    # The same file under a changed cohort size: every completed record no longer fits.
    for size, expected in ((N, 2), (N + 1, 0)):
        caplog.clear()
        journal = Journal.open(str(tmp_path))
        cfg2 = cfg_for(num_rollouts_per_prompt=size)
        async with open_registry(cfg2, ScriptedJudge(), journal=journal) as registry:
            assert registry.snapshot()["retained_records"] == expected
            assert registry.snapshot()["watermarks"] == 3
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                    and "skipped at reload" in r.getMessage()]
        assert len(warnings) == 1
        journal.close()


async def test_a_mass_expiry_is_one_transaction(
    tmp_path: Path, autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for(cohort_result_ttl_s=100.0)
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, ScriptedJudge(), journal=journal) as registry:
        for g in range(20):
            await run_group(registry, cfg, group=f"g{g}")
        await trio.sleep(150.0)
        commits: list[str] = []
        journal._db.set_trace_callback(commits.append)
        await run_group(registry, cfg, group="late")
        journal._db.set_trace_callback(None)
    deletes = [c for c in commits if c.startswith("DELETE FROM records")]
    assert len(deletes) == 20
    # The 20 deletions sit in one transaction (the writer's group commit may hold more).
    first = commits.index(deletes[0])
    last = commits.index(deletes[-1])
    assert any("BEGIN" in c for c in commits[:first])
    assert any("COMMIT" in c for c in commits[last:])
    assert not any("COMMIT" in c or "BEGIN" in c for c in commits[first:last])
    assert [r.key.group_id for r in journal.records(N)] == ["late"]
    journal.close()


async def test_a_failing_journal_shows_in_status_and_metrics_over_http(tmp_path: Path) -> None:
    """Writes that fail inside SQLite (a trigger raising, as a full disk or a constraint would)
    on a real server: every answer goes out, the next cohort completes, /status and /metrics
    say the journal is degraded."""
    journal = Journal.open(str(tmp_path))
    journal._db.execute(
        "CREATE TRIGGER fail_records BEFORE INSERT ON records "
        "BEGIN SELECT RAISE(ABORT, 'injected: database or disk is full'); END")
    journal.close()
    cfg = Config(num_rollouts_per_prompt=2, port=0, state_dir=str(tmp_path),
                 shutdown_grace_s=1.0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url, timeout=30) as c:
        async def one(answers: list[httpx2.Response], slot: int, group: str) -> None:
            answers.append(await c.post("/verify", json=body(slot, group=group)))

        for group in ("first", "second"):
            answers: list[httpx2.Response] = []
            async with trio.open_nursery() as nursery:
                for slot in range(2):
                    nursery.start_soon(one, answers, slot, group)
            assert sorted(a.status_code for a in answers) == [200, 200]
            assert all(a.json()["mask_sample"] is False for a in answers)
        status = (await c.get("/status")).json()
        assert status["journal"]["degraded"] is True
        assert "injected" in status["journal"]["last_error"]
        metrics = (await c.get("/metrics")).text
        assert "genrm_journal_degraded 1" in metrics
        assert (await c.get("/healthz")).status_code == 200


@pytest.mark.parametrize("poison", [Fault.EXTREME, Fault.WRONG_TYPES, Fault.OUT_OF_RANGE,
                                    Fault.NONFINITE])
@pytest.mark.parametrize("policy", ["default", "mask"])
async def test_poisoned_judge_answers_over_a_real_socket(
    nursery: trio.Nursery, poison: Fault, policy: str,
) -> None:
    """A judge answering absurd verdicts (mixed-sign extremes near the float limit, wrong types,
    off-scale values) for one cohort: that cohort alone is affected (the default verdict, or
    masked with a reason naming the cause under ``mask``), the process lives and the next
    cohort is judged normally."""
    state = MockJudgeState()
    judge_url = await nursery.start(functools.partial(
        run_mock_judge, MockJudgeSettings(), state=state))
    cfg = Config(num_rollouts_per_prompt=2, port=0, genrm_parse_retries=1,
                 genrm_parse_retry_sleep_s=0.0, shutdown_grace_s=1.0,
                 unparseable_verdict_policy=policy,
                 judge=JudgeConfig(base_urls=(judge_url,), api="chat"))
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url, timeout=30) as c:
        async def group(name: str) -> list[dict[str, Any]]:
            out: dict[int, dict[str, Any]] = {}

            async def one(slot: int) -> None:
                answer = await c.post("/verify", json=body(slot, group=name))
                assert answer.status_code == 200, answer.text
                out[slot] = answer.json()

            async with trio.open_nursery() as both:
                for slot in range(2):
                    both.start_soon(one, slot)
            return [out[0], out[1]]

        state.set_fault(poison, 4)  # both comparisons, both attempts
        poisoned = await group("poisoned")
        if policy == "mask":
            for out in poisoned:
                assert out["mask_sample"] is True and out["failure_kind"] == "judge_failed"
                assert "unparseable" in out["failure_reason"]
        else:
            assert [out["reward"] for out in poisoned] == [cfg.default_score] * 2
            assert all(out["mask_sample"] is False for out in poisoned)
        healthy = await group("healthy")
        assert all(out["mask_sample"] is False for out in healthy)
        assert healthy[0]["reward"] != healthy[1]["reward"]  # a real verdict, not the default
        assert (await c.get("/healthz")).status_code == 200
        assert state.calls == 6
