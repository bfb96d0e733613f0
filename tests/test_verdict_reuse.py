"""Verdict reuse (issue 18 item 1): a parsed verdict is kept by content key and scores the same
pair again, within a group (default) or anywhere, bounded, journaled; on the autojump clock."""

from __future__ import annotations

import json
import logging
import os
import random
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
import trio
import trio.testing

from genrm_trio import identity, scoring
from genrm_trio.config import Config, JudgeConfig
from genrm_trio.errors import JudgeFailed
from genrm_trio.server.app import verify_answer
from genrm_trio.server.cohort import Failure, Rewarded
from genrm_trio.server.journal import FILE_NAME, Journal
from genrm_trio.server.judge import JudgeRequest, JudgeStats, open_judge
from genrm_trio.server.prometheus import ServerMetrics
from genrm_trio.server.verdicts import VerdictCache
from tests.lifecycle_helpers import (
    PROMPT,
    Outcomes,
    answer,
    member,
    open_registry,
    reference_rewards,
    response_obj,
)

N = 4


def cfg_for(n: int = N, **kw: Any) -> Config:
    base: dict[str, Any] = {
        "num_rollouts_per_prompt": n,
        "cohort_collection_timeout_s": 60.0,
        "cohort_evaluation_timeout_s": 30.0,
    }
    base.update(kw)
    return Config(**base)


class NoisyJudge:
    """A judge that draws a fresh random verdict on every call (a sampling judge at
    temperature > 0), records every draw, and fails the pairs in ``failing`` (by answer texts)
    after ``fail_after_s``, while the others answer after ``latency_s``."""

    def __init__(self, seed: int = 7, latency_s: float = 1.0, stagger_s: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.latency_s = latency_s
        self.stagger_s = stagger_s  # each call this much slower than the one before
        self.failing: set[tuple[str, str]] = set()
        self.fail_after_s = 2.0
        self.asked: list[tuple[str, str]] = []  # every call, in the order made
        self.draws: dict[tuple[str, str, int], list[scoring.Verdict]] = {}
        self.defaulting: set[tuple[str, str]] = set()
        self.stats = JudgeStats()  # what /metrics reads of a judge

    def status(self) -> dict[str, Any]:
        return {"limiter": {"in_use": 0, "total": 1}, "endpoints": []}

    @property
    def calls(self) -> int:
        return len(self.asked)

    def pairs(self) -> list[tuple[str, str]]:
        return list(self.asked)

    async def judge_pair(self, request: JudgeRequest, group: object = None,
                         trace: object = None) -> scoring.Verdict:
        pair = (request.response_1, request.response_2)
        self.asked.append(pair)
        if pair in self.failing:
            await trio.sleep(self.fail_after_s)
            raise JudgeFailed("judge http://judge.test: HTTP 503 after 4 attempts")
        if pair in self.defaulting:
            verdict = scoring.Verdict(3.0, 3.0, 3.5, defaulted=True)
        else:
            verdict = scoring.Verdict(float(self.rng.randint(1, 5)),
                                      float(self.rng.randint(1, 5)),
                                      float(self.rng.randint(1, 6)), input_tokens=100)
        await trio.sleep(self.latency_s + self.stagger_s * len(self.asked))
        self.draws.setdefault((*pair, request.judge_idx), []).append(verdict)
        return verdict

    def latest(self, a: str, b: str, k: int) -> scoring.Verdict:
        """The verdict last drawn for (a, b, pass k): the one a cohort judged now would use."""
        return self.draws[(a, b, k)][-1]

    def drawn_once(self) -> bool:
        """Every pair's verdict was drawn once: reuse never re-drew the judge's noise."""
        return all(len(v) == 1 for v in self.draws.values())


def rewards_given(cfg: Config, texts: list[str],
                  verdict_of: Callable[[str, str, int], scoring.Verdict]) -> list[float]:
    """The rewards of a fresh cohort of ``texts`` whose judge gave ``verdict_of(a, b, pass)``."""
    comparisons = []
    for i, j, k in scoring.comparison_pairs(len(texts), cfg.comparison_strategy,
                                            cfg.num_judges_per_comparison):
        v = verdict_of(texts[i], texts[j], k)
        comparisons.append(scoring.Comparison(response_i=i, response_j=j, judge_idx=k,
                                              score_1=v.score_1, score_2=v.score_2,
                                              ranking=v.ranking))
    rewards, _ = scoring.aggregate(comparisons, [response_obj(t) for t in texts], cfg)
    return rewards


async def run_cohort(registry: Any, cfg: Config, texts: list[str], *, group: str | None = "g",
                     attempt: int | None = 0, **kw: Any) -> list[Rewarded | Failure]:
    """Send a whole cohort of ``texts`` and return every member's outcome, by slot."""
    async with trio.open_nursery() as nursery:
        out = Outcomes(registry, nursery)
        for slot, text in enumerate(texts):
            out.send(f"m{slot}", member(cfg, slot, text=text, group=group, attempt=attempt,
                                        **kw))
    return [out.results[f"m{s}"][1] for s in range(len(texts))]


def rewards_of(outcomes: list[Rewarded | Failure]) -> list[float]:
    assert all(isinstance(o, Rewarded) for o in outcomes), outcomes
    return [o.reward for o in outcomes if isinstance(o, Rewarded)]


TEXTS = [answer(s) for s in range(N)]


# ------------------------------------------------------------------ the replacement attempt


@pytest.mark.parametrize(("reuse", "attempt_1_calls"), [("group", 1), ("off", N)])
async def test_replacement_after_outage_rejudges_only_the_missing_pair(
    autojump_clock: trio.abc.Clock, reuse: str, attempt_1_calls: int,
) -> None:
    cfg = cfg_for(verdict_reuse=reuse)
    judge = NoisyJudge()
    judge.failing = {(TEXTS[2], TEXTS[3])}  # circular (2, 3) fails at t=2; the others are in
    async with open_registry(cfg, judge) as registry:
        first = await run_cohort(registry, cfg, TEXTS)
        assert all(isinstance(o, Failure) and o.masked for o in first)
        assert judge.calls == N
        judge.failing = set()  # the outage is over; the caller resends the group
        second = await run_cohort(registry, cfg, TEXTS, attempt=1)
    assert judge.calls == N + attempt_1_calls
    if reuse == "group":
        assert judge.pairs()[N:] == [(TEXTS[2], TEXTS[3])]  # only the one that had failed
        assert registry.counters["comparisons_reused"] == N - 1
    # Rewards are those of a fresh cohort whose judge gave the verdicts last drawn; with reuse,
    # that is the one draw of each pair (the same sample, however many attempts it took).
    assert rewards_of(second) == rewards_given(cfg, TEXTS, judge.latest)
    assert judge.drawn_once() == (reuse == "group")
    reused = [o.reused_comparisons for o in second if isinstance(o, Rewarded)]
    assert reused == [N - attempt_1_calls] * N


@pytest.mark.parametrize("routing", ["least_loaded", "cohort_affinity"])
@pytest.mark.parametrize(("strategy", "pairs", "touching"),
                         [("circular", 8, 2), ("all_pairs", 28, 7)])
async def test_one_changed_answer_of_eight_costs_only_its_comparisons(
    autojump_clock: trio.abc.Clock, strategy: str, pairs: int, touching: int, routing: str,
) -> None:
    # cohort_affinity: one warm-up judge call, then the rest; kept verdicts are not a warm-up
    cfg = cfg_for(8, comparison_strategy=strategy, judge=JudgeConfig(routing=routing))
    judge = NoisyJudge()
    texts = [answer(s) for s in range(8)]
    changed = [*texts[:5], "a regenerated answer for slot 5", *texts[6:]]
    async with open_registry(cfg, judge) as registry:
        rewards_of(await run_cohort(registry, cfg, texts))
        second = await run_cohort(registry, cfg, changed, attempt=1)
    assert judge.calls == pairs + touching  # k=1: 6 of 8 circular, 21 of 28 all_pairs avoided
    assert all(changed[5] in pair for pair in judge.pairs()[pairs:])
    assert rewards_of(second) == rewards_given(cfg, changed, judge.latest)
    assert judge.drawn_once()


async def test_restart_with_state_dir_reuses(autojump_clock: trio.abc.Clock,
                                             tmp_path: Path) -> None:
    cfg = cfg_for(state_dir=str(tmp_path))
    judge = NoisyJudge()
    judge.failing = {(TEXTS[2], TEXTS[3])}
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, judge, journal) as registry:
        first = await run_cohort(registry, cfg, TEXTS)
    assert all(isinstance(o, Failure) for o in first)
    journal.close()  # the process is gone; a new one opens the same state_dir
    judge.failing = set()
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, judge, journal) as registry:
        assert registry.verdict_status()["entries"] == N - 1
        second = await run_cohort(registry, cfg, TEXTS, attempt=1)
    journal.close()
    assert judge.pairs()[N:] == [(TEXTS[2], TEXTS[3])]
    assert rewards_of(second) == rewards_given(cfg, TEXTS, judge.latest)
    assert judge.drawn_once()
    assert journal.skipped_rows == 0


# ------------------------------------------------------------------ scope


@pytest.mark.parametrize(("reuse", "second_group_calls"), [("group", N), ("global", 0)])
async def test_global_reuses_across_groups_and_group_does_not(
    autojump_clock: trio.abc.Clock, reuse: str, second_group_calls: int,
) -> None:
    cfg = cfg_for(verdict_reuse=reuse)
    judge = NoisyJudge()
    async with open_registry(cfg, judge) as registry:
        one = await run_cohort(registry, cfg, TEXTS, group="g1")
        two = await run_cohort(registry, cfg, TEXTS, group="g2")
    assert judge.calls == N + second_group_calls
    if reuse == "global":
        assert rewards_of(two) == rewards_of(one)


async def test_group_scope_covers_a_legacy_key_not_another_task(
    autojump_clock: trio.abc.Clock,
) -> None:
    cfg = cfg_for()
    judge = NoisyJudge()
    async with open_registry(cfg, judge) as registry:
        await run_cohort(registry, cfg, TEXTS, group=None, attempt=None, task=1)
        await run_cohort(registry, cfg, TEXTS, group=None, attempt=None, task=1)
        assert judge.calls == N  # the same legacy key: reused
        await run_cohort(registry, cfg, TEXTS, group=None, attempt=None, task=2)
    assert judge.calls == 2 * N  # another task: another scope


async def test_a_changed_judge_configuration_is_another_key(
    autojump_clock: trio.abc.Clock, tmp_path: Path,
) -> None:
    judge = NoisyJudge()
    for attempt, temperature in enumerate((0.6, 0.6, 1.0)):
        cfg = cfg_for(genrm_responses_create_params={"temperature": temperature})
        journal = Journal.open(str(tmp_path))
        async with open_registry(cfg, judge, journal) as registry:
            rewards_of(await run_cohort(registry, cfg, TEXTS, attempt=attempt))
        journal.close()
    assert judge.calls == 2 * N  # the second run reused, the new temperature did not


# ------------------------------------------------------------------ what is never kept


async def test_position_matters_the_swapped_pair_is_judged(autojump_clock: trio.abc.Clock,
                                                           ) -> None:
    cfg = cfg_for()
    judge = NoisyJudge()
    swapped = [TEXTS[1], TEXTS[0], TEXTS[2], TEXTS[3]]
    async with open_registry(cfg, judge) as registry:
        await run_cohort(registry, cfg, TEXTS)
        await run_cohort(registry, cfg, swapped, attempt=1)
    # circular: (0,1) is now (b, a), (1,2) is (a, c), (3,0) is (d, b): only (c, d) is kept.
    assert sorted(judge.pairs()[N:]) == sorted([(TEXTS[1], TEXTS[0]), (TEXTS[0], TEXTS[2]),
                                                (TEXTS[3], TEXTS[1])])
    prefix = identity.verdict_prefix(None, b"fp", None, [])
    assert identity.verdict_key(prefix, 0, "a", "b") != identity.verdict_key(prefix, 0, "b", "a")


async def test_a_defaulted_verdict_is_never_kept(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for()
    judge = NoisyJudge()
    judge.defaulting = {(TEXTS[0], TEXTS[1])}
    async with open_registry(cfg, judge) as registry:
        await run_cohort(registry, cfg, TEXTS)
        second = await run_cohort(registry, cfg, TEXTS, attempt=1)
        assert registry.verdict_status()["entries"] == N - 1
    assert judge.pairs()[N:] == [(TEXTS[0], TEXTS[1])]
    assert [o.defaulted_comparisons for o in second if isinstance(o, Rewarded)] == [1] * N


def _responses_answer(text: str, status: str = "completed") -> httpx2.Response:
    return httpx2.Response(200, json={
        "status": status, "output": [{"type": "message", "role": "assistant",
                                      "content": [{"type": "output_text", "text": text}]}]})


async def test_truncated_and_unparseable_answers_are_never_reused(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Through the real judge client: pair (0, 1) only ever answers prose (the default verdict
    stands in), pair (1, 2) is cut by the output budget (no verdict: the cohort is masked);
    the replacement attempt asks the judge for both again and for nothing else."""
    cfg = cfg_for(genrm_parse_retries=0,
                  judge=JudgeConfig(base_urls=("http://judge.test",), transport="httpx"))
    sent: list[tuple[str, str]] = []
    broken = True

    async def handler(request: httpx2.Request) -> httpx2.Response:
        metadata = json.loads(request.content)["metadata"]
        pair = (metadata["response_1"], metadata["response_2"])
        sent.append(pair)
        if broken and pair == (TEXTS[0], TEXTS[1]):
            return _responses_answer("I cannot decide between them.")
        if broken and pair == (TEXTS[1], TEXTS[2]):
            await trio.sleep(1.0)  # after the others are in
            return _responses_answer('{"score_1": 4', status="incomplete")
        return _responses_answer('{"score_1": 4, "score_2": 2, "ranking": 2}')

    async with open_judge(cfg, transport=httpx2.MockTransport(handler)) as judge, \
            open_registry(cfg, judge) as registry:
        first = await run_cohort(registry, cfg, TEXTS)
        assert all(isinstance(o, Failure) and o.masked for o in first)
        assert "output budget" in first[0].detail  # type: ignore[union-attr]
        assert registry.verdict_status()["entries"] == 2  # (2, 3) and (3, 0) parsed
        broken = False
        second = await run_cohort(registry, cfg, TEXTS, attempt=1)
    assert sorted(sent[N:]) == sorted([(TEXTS[0], TEXTS[1]), (TEXTS[1], TEXTS[2])])
    assert [o.reused_comparisons for o in second if isinstance(o, Rewarded)] == [2] * N


# ------------------------------------------------------------------ bounds


async def test_the_cap_evicts_oldest_first_in_memory_and_on_disk(
    autojump_clock: trio.abc.Clock, tmp_path: Path,
) -> None:
    cfg = cfg_for(verdict_cache_max_entries=2)
    judge = NoisyJudge(stagger_s=0.5)
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, judge, journal) as registry:
        await run_cohort(registry, cfg, TEXTS)  # verdicts come back in the order asked
        assert registry.retention()["verdicts"] == {"count": 2, "cap": 2, "ttl_s": 3600.0}
        await run_cohort(registry, cfg, TEXTS, attempt=1)
    journal.close()
    # The two newest were kept; the two oldest are judged again.
    oldest = judge.pairs()[:2]
    assert sorted(judge.pairs()[N:]) == sorted(oldest)
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        assert db.execute("SELECT count(*) FROM verdicts").fetchone() == (2,)


async def test_verdicts_expire_with_the_records_ttl(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(cohort_result_ttl_s=100.0)
    judge = NoisyJudge()
    async with open_registry(cfg, judge) as registry:
        await run_cohort(registry, cfg, TEXTS)
        await trio.sleep(50.0)
        await run_cohort(registry, cfg, TEXTS, attempt=1)
        assert judge.calls == N  # within the TTL: all reused
        await trio.sleep(100.0)
        await run_cohort(registry, cfg, TEXTS, attempt=2)
        assert registry.verdict_status()["entries"] == N
    assert judge.calls == 2 * N  # past it: all judged again (and kept anew)


# ------------------------------------------------------------------ the journal refuses bad rows


async def test_corrupt_journal_rows_are_skipped_counted_and_never_trusted(
    autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = cfg_for(state_dir=str(tmp_path))
    judge = NoisyJudge(stagger_s=0.5)
    journal = Journal.open(str(tmp_path))
    async with open_registry(cfg, judge, journal) as registry:
        await run_cohort(registry, cfg, TEXTS)  # verdicts come back (and are kept) in call order
    journal.close()
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        keys = [k for (k,) in db.execute("SELECT key FROM verdicts ORDER BY seq")]
        db.execute("UPDATE verdicts SET score_1 = 9.0 WHERE key = ?", (keys[0],))  # off scale
        db.execute("UPDATE verdicts SET ranking = 'high' WHERE key = ?", (keys[1],))
        db.execute("UPDATE verdicts SET key = 'not-a-digest' WHERE key = ?", (keys[2],))
    journal = Journal.open(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="genrm_trio.server.cohort"):
        async with open_registry(cfg, judge, journal) as registry:
            assert registry.verdict_status()["entries"] == 1
            second = await run_cohort(registry, cfg, TEXTS, attempt=1)
    journal.close()
    assert journal.skipped_rows == 3
    assert "3 malformed or mismatched rows skipped" in caplog.text
    # The three refused verdicts are judged again; only the intact fourth is reused.
    assert sorted(judge.pairs()[N:]) == sorted(judge.pairs()[:3])
    assert all(o.reused_comparisons == 1 for o in second if isinstance(o, Rewarded))
    assert rewards_of(second) == rewards_given(cfg, TEXTS, judge.latest)


# ------------------------------------------------------------------ what users see


async def test_answer_metrics_status_and_disposition_line_count_both(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = cfg_for()
    judge = NoisyJudge()
    metrics = ServerMetrics()
    async with open_registry(cfg, judge) as registry:
        metrics.read_from(registry, judge)  # type: ignore[arg-type]
        await run_cohort(registry, cfg, TEXTS)
        caplog.clear()  # only the replacement's line
        with caplog.at_level(logging.INFO, logger="genrm_trio.server.cohort"):
            second = await run_cohort(registry, cfg, [*TEXTS[:3], "new answer"], attempt=1)
        status = registry.verdict_status()
        exposition = metrics.render()[0].decode()
    assert status == {"mode": "group", "entries": N + 2, "cap": 65536, "ttl_s": 3600.0,
                      "reused_comparisons": 2, "judged_comparisons": N + 2}
    assert "genrm_comparisons_reused_total 2.0" in exposition
    assert f"genrm_comparisons_judged_total {N + 2}.0" in exposition
    assert f"genrm_verdict_cache_entries {N + 2}.0" in exposition
    lines = [r for r in caplog.records if getattr(r, "event", None) == "cohort"]
    assert len(lines) == 1
    assert "comparisons 2 judged, 2 reused" in lines[0].getMessage()
    assert (lines[0].judge_calls, lines[0].reused_comparisons) == (2, 2)  # type: ignore[attr-defined]
    # The rewarded answer on the wire.
    outcome = second[0]
    assert isinstance(outcome, Rewarded)
    _, payload, _ = verify_answer(member(cfg, 0, attempt=1), outcome)
    body = msgspec.json.decode(payload)
    assert body["genrm_reused_comparisons"] == 2
    assert body["genrm_defaulted_comparisons"] == 0


async def test_off_reproduces_the_call_pattern_of_no_reuse(autojump_clock: trio.abc.Clock,
                                                           ) -> None:
    cfg = cfg_for(verdict_reuse="off")
    judge = NoisyJudge()
    async with open_registry(cfg, judge) as registry:
        for attempt in range(3):
            out = await run_cohort(registry, cfg, TEXTS, attempt=attempt)
            assert [o.reused_comparisons for o in out if isinstance(o, Rewarded)] == [0] * N
        assert registry.verdict_status() == {"mode": "off", "entries": 0, "cap": 0,
                                             "ttl_s": None, "reused_comparisons": 0,
                                             "judged_comparisons": 3 * N}
    assert judge.calls == 3 * N
    assert sorted(judge.pairs()) == sorted(
        [(TEXTS[i], TEXTS[j]) for i, j, _ in scoring.comparison_pairs(N, "circular", 1)] * 3)


async def test_deterministic_judge_rewards_with_reuse_equal_without(
    autojump_clock: trio.abc.Clock,
) -> None:
    from tests.lifecycle_helpers import ScriptedJudge
    rewards: dict[str, list[float]] = {}
    for reuse in ("off", "group", "global"):
        cfg = cfg_for(verdict_reuse=reuse)
        async with open_registry(cfg, ScriptedJudge(latency_s=1.0)) as registry:
            await run_cohort(registry, cfg, TEXTS)
            rewards[reuse] = rewards_of(await run_cohort(registry, cfg, TEXTS, attempt=1))
    assert rewards["off"] == rewards["group"] == rewards["global"] == reference_rewards(
        cfg_for(), TEXTS, PROMPT)


# ------------------------------------------------------------------ the key and the cache alone


def test_the_key_is_the_same_in_another_process() -> None:
    code = ("from genrm_trio import identity; from genrm_trio.config import Config; "
            "fp = identity.judge_fingerprint(Config(), None); "
            "p = identity.verdict_prefix(['group', 'g'], fp, None, [{'role': 'user', "
            "'content': 'q\\ud800'}]); print(identity.verdict_key(p, 0, 'a', 'b').hex())")
    keys = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        keys.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    fp = identity.judge_fingerprint(Config(), None)
    here = identity.verdict_key(identity.verdict_prefix(
        ["group", "g"], fp, None, [{"role": "user", "content": "q\ud800"}]), 0, "a", "b")
    assert keys == {here.hex()}


def test_every_part_of_the_key_matters() -> None:
    fp = identity.judge_fingerprint(Config(), None)
    history = [{"role": "user", "content": "q"}]
    base = identity.verdict_key(identity.verdict_prefix(None, fp, None, history), 0, "a", "b")
    variants = [
        identity.verdict_key(identity.verdict_prefix(["group", "g"], fp, None, history), 0,
                             "a", "b"),
        identity.verdict_key(identity.verdict_prefix(None, fp + b" ", None, history), 0, "a",
                             "b"),
        identity.verdict_key(identity.verdict_prefix(None, fp, "be terse", history), 0, "a",
                             "b"),
        identity.verdict_key(identity.verdict_prefix(None, fp, None, [*history, *history]), 0,
                             "a", "b"),
        identity.verdict_key(identity.verdict_prefix(None, fp, None, history), 1, "a", "b"),
        identity.verdict_key(identity.verdict_prefix(None, fp, None, history), 0, "ab", ""),
        identity.verdict_key(identity.verdict_prefix(None, fp, None, history), 0, "b", "a"),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    fingerprints = {
        identity.judge_fingerprint(Config(**kw), None) for kw in (
            {}, {"judge": JudgeConfig(base_urls=("http://a.test",))},
            {"judge": JudgeConfig(base_urls=("http://a.test",), model="m")},
            {"judge": JudgeConfig(base_urls=("http://a.test",), api="chat")},
            {"judge": JudgeConfig(base_urls=("http://a.test",), structured_output="json_schema")},
            {"judge": JudgeConfig(base_urls=("http://a.test",), seed="content")},
            {"judge": JudgeConfig(base_urls=("http://a.test",), prompt="plain")},
            {"genrm_responses_create_params": {"temperature": 0.0}},
            {"default_score": 2.0},
        )
    }
    assert len(fingerprints) == 9
    # Endpoints of one model are one judge: routing never changes a key.
    assert identity.judge_fingerprint(Config(judge=JudgeConfig(
        base_urls=("http://a.test", "http://b.test"), model="m")), None) == \
        identity.judge_fingerprint(Config(judge=JudgeConfig(
            base_urls=("http://b.test",), model="m")), None)


async def test_an_expired_entry_is_a_miss_before_any_prune(autojump_clock: trio.abc.Clock,
                                                           ) -> None:
    cache = VerdictCache(cfg_for(cohort_result_ttl_s=10.0))
    key = b"k" * 32
    assert cache.put(key, scoring.Verdict(4.0, 2.0, 2.0, input_tokens=9), now=0.0)
    assert not cache.put(key, scoring.Verdict(1.0, 1.0, 1.0), now=1.0)  # the first stands
    assert cache.get(key, now=9.9) == scoring.Verdict(4.0, 2.0, 2.0)  # tokens are not kept
    assert cache.get(key, now=10.0) is None
    assert not cache.put(b"d" * 32, scoring.Verdict(3.0, 3.0, 3.5, defaulted=True), now=0.0)
    assert len(cache) == 1


async def test_eager_reuses_each_pair_once_as_members_arrive(autojump_clock: trio.abc.Clock,
                                                             ) -> None:
    cfg = cfg_for(judge_schedule="eager")
    judge = NoisyJudge()
    async with open_registry(cfg, judge) as registry:
        first = rewards_of(await run_cohort(registry, cfg, TEXTS))
        async with trio.open_nursery() as nursery:
            out = Outcomes(registry, nursery)
            for slot in range(N):
                out.send(f"m{slot}", member(cfg, slot, text=TEXTS[slot], attempt=1))
                out.send(f"dup{slot}", member(cfg, slot, text=TEXTS[slot], attempt=1))
                await trio.sleep(1.0)
    second = [out.results[f"m{s}"][1] for s in range(N)]
    assert judge.calls == N
    assert rewards_of(second) == first
    assert [o.reused_comparisons for o in second if isinstance(o, Rewarded)] == [N] * N
    assert registry.counters["comparisons_reused"] == N
    assert out.results["m0"][0] == out.results[f"m{N - 1}"][0]  # published at the last arrival
