"""Arrival slots (issue 30): legacy members without ``_ng_rollout_index`` under
``legacy_slots: arrival`` take the next free slot of their prompt-keyed cohort; an identical
re-send re-attaches only to a member with no live waiter (else it is a sibling); a member beyond
N gets 409 ``cohort_full``; ``judge_present`` applies to these cohorts and a late member gets
409 ``cohort_closed``, never a cohort of its own. And ``POST /get_reward`` (OpenRLHF's remote
reward protocol) over the same core. Autojump clock where time matters."""

from __future__ import annotations

from typing import Any

import httpx2
import msgspec
import pytest
import trio
import trio.testing

from genrm_trio import wire
from genrm_trio.config import Config
from genrm_trio.errors import BadCoordinates, BadRequest
from genrm_trio.server.cohort import Rewarded
from tests.lifecycle_helpers import (
    Outcomes,
    ScriptedJudge,
    answer,
    body,
    open_registry,
    reference_rewards,
)
from tests.server_helpers import running_server

DEADLINE_S = 10.0


def cfg_for(n: int = 4, **kw: Any) -> Config:
    return Config(num_rollouts_per_prompt=n, legacy_slots="arrival",
                  cohort_collection_timeout_s=DEADLINE_S, cohort_evaluation_timeout_s=60.0,
                  **kw)


def slotless(cfg: Config, text: str, **kw: Any) -> wire.VerifyMember:
    return wire.decode_verify(msgspec.json.encode(body(None, group=None, attempt=None,
                                                       text=text, **kw)),
                              cfg.num_rollouts_per_prompt, arrival_slots=True)


def test_a_slotless_legacy_member_is_refused_unless_arrival() -> None:
    raw = msgspec.json.encode(body(None, group=None, attempt=None))
    with pytest.raises(BadCoordinates, match="legacy_slots: arrival"):
        wire.decode_verify(raw, 4)
    assert wire.decode_verify(raw, 4, arrival_slots=True).rollout_index is None
    explicit = msgspec.json.encode(body(None, group="g"))
    with pytest.raises(BadCoordinates):  # explicit groups always need their index
        wire.decode_verify(explicit, 4, arrival_slots=True)


async def test_slots_by_arrival_rewards_by_slot(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(4)
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as n:
        out = Outcomes(registry, n)
        for i in range(4):
            out.send(f"m{i}", slotless(cfg, answer(i)))
            await trio.testing.wait_all_tasks_blocked()
    expected = reference_rewards(cfg, [answer(i) for i in range(4)])
    for i in range(4):
        outcome = out.results[f"m{i}"][1]
        assert isinstance(outcome, Rewarded) and outcome.slot == i
        assert outcome.reward == pytest.approx(expected[i])
    assert registry.counters["cohorts_opened"] == 1


async def test_retry_with_no_live_waiter_reattaches(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(4)
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as n:
        out = Outcomes(registry, n)
        out.send("a", slotless(cfg, answer(0)))
        out.send("b", slotless(cfg, answer(1)))
        await trio.testing.wait_all_tasks_blocked()
        out.disconnect("a")  # the client timed out ...
        await trio.testing.wait_all_tasks_blocked()
        out.send("a2", slotless(cfg, answer(0)))  # ... and re-sent the same sample
        await trio.testing.wait_all_tasks_blocked()
        assert registry.counters["arrival_reattached"] == 1
        out.send("c", slotless(cfg, answer(2)))
        out.send("d", slotless(cfg, answer(3)))
    assert "a" not in out.results
    expected = reference_rewards(cfg, [answer(i) for i in range(4)])
    assert [out.reward(k) for k in ("a2", "b", "c", "d")] == pytest.approx(expected)
    assert registry.counters["cohorts_opened"] == 1


async def test_identical_text_with_a_live_waiter_is_a_sibling(
        autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(4)
    texts = [answer(0), answer(0), answer(1), answer(2)]  # a low-temperature group
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as n:
        out = Outcomes(registry, n)
        for i, text in enumerate(texts):
            out.send(f"m{i}", slotless(cfg, text))
            await trio.testing.wait_all_tasks_blocked()
    assert registry.counters["arrival_identical_siblings"] == 1
    assert registry.counters["arrival_reattached"] == 0
    expected = reference_rewards(cfg, texts)
    assert [out.reward(f"m{i}") for i in range(4)] == pytest.approx(expected)


async def test_beyond_n_is_cohort_full_and_a_resend_of_a_member_reattaches(
        autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(3)
    judge = ScriptedJudge(latency_s=5.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as n:
        out = Outcomes(registry, n)
        for i in range(3):
            out.send(f"m{i}", slotless(cfg, answer(i)))
        await trio.testing.wait_all_tasks_blocked()
        out.send("extra", slotless(cfg, answer(7)))
        out.send("again", slotless(cfg, answer(1)))  # live waiter, but the cohort is full
        await trio.testing.wait_all_tasks_blocked()
        failure = out.failure("extra")
        assert (failure.status, failure.kind) == (409, "cohort_full")
    assert out.reward("again") == out.reward("m1")
    assert registry.counters["cohorts_opened"] == 1


async def test_resend_after_completion_replays_then_new_round_opens(
        autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(3)
    judge = ScriptedJudge()
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as n:
        out = Outcomes(registry, n)
        for i in range(3):
            out.send(f"m{i}", slotless(cfg, answer(i)))
        await trio.testing.wait_all_tasks_blocked()
        calls = judge.calls
        out.send("late-retry", slotless(cfg, answer(2)))
        await trio.testing.wait_all_tasks_blocked()
        assert out.reward("late-retry") == out.reward("m2")
        assert judge.calls == calls  # replayed, no judge call
        for i in range(3):  # the same prompt, a later round with new answers
            out.send(f"r{i}", slotless(cfg, answer(i + 3)))
            await trio.testing.wait_all_tasks_blocked()
    assert registry.counters["arrival_new_rounds"] == 1
    assert registry.counters["cohorts_opened"] == 2
    assert all(isinstance(out.results[f"r{i}"][1], Rewarded) for i in range(3))


async def test_judge_present_for_a_prompt_keyed_cohort(autojump_clock: trio.abc.Clock) -> None:
    cfg = cfg_for(4, incomplete_cohort_policy="judge_present")
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as n:
        out = Outcomes(registry, n)
        for i in range(3):  # the fourth episode was cancelled by the dispatcher
            out.send(f"m{i}", slotless(cfg, answer(i)))
        await trio.sleep(DEADLINE_S + 1)
        assert trio.current_time() >= DEADLINE_S
        out.send("late", slotless(cfg, answer(3)))
        await trio.testing.wait_all_tasks_blocked()
        late = out.failure("late")
        assert (late.status, late.kind) == (409, "cohort_closed")
        retry = slotless(cfg, answer(1))
        out.send("retry", retry)
        await trio.testing.wait_all_tasks_blocked()
    expected = reference_rewards(cfg, [answer(i) for i in range(3)])
    assert [out.reward(f"m{i}") for i in range(3)] == pytest.approx(expected)
    assert out.reward("retry") == out.reward("m1")
    assert registry.counters["cohorts_opened"] == 1
    for i in range(3):
        outcome = out.results[f"m{i}"][1]
        assert isinstance(outcome, Rewarded) and outcome.cohort_scored == 3


async def test_required_mode_keeps_legacy_cohorts_unjudged_partially(
        autojump_clock: trio.abc.Clock) -> None:
    cfg = Config(num_rollouts_per_prompt=4, incomplete_cohort_policy="judge_present",
                 cohort_collection_timeout_s=DEADLINE_S)
    async with open_registry(cfg, ScriptedJudge()) as registry, trio.open_nursery() as n:
        out = Outcomes(registry, n)
        for i in range(3):
            raw = msgspec.json.encode(body(i, group=None, attempt=None))
            out.send(f"m{i}", wire.decode_verify(raw, 4))
    assert out.failure("m0").kind == "cohort_incomplete"


# --------------------------------------------------------------------------- /get_reward


def test_get_reward_bounds() -> None:
    ok = wire.decode_get_reward(b'{"query": ["pa"], "prompts": ["p"], "labels": ["x"]}')
    assert ok.query == ["pa"]
    for raw, where in [
        (b'{"query": ["a", "b"], "prompts": ["p"]}', "$.prompts"),
        (b'{"query": ["a"], "prompts": ["p"], "labels": []}', "$.labels"),
        (b'{"query": "a", "prompts": ["p"]}', "$.query"),
        (b'{"prompts": ["p"]}', "query"),
        (msgspec.json.encode({"query": ["a"] * (wire.MAX_GET_REWARD_SAMPLES + 1),
                              "prompts": ["p"] * (wire.MAX_GET_REWARD_SAMPLES + 1)}), "$.query"),
        (msgspec.json.encode({"query": ["a"], "prompts": ["p"],
                              "labels": ["x" * wire.MAX_LABEL_CHARS]}), "$.labels[0]"),
    ]:
        with pytest.raises(BadRequest, match=where.replace("$", r"\$").replace("[", r"\[")):
            wire.decode_get_reward(raw)


def orlhf_samples(prompt: str, k: int, label: str = "ref") -> list[dict[str, list[Any]]]:
    return [{"query": [prompt + answer(i)], "prompts": [prompt], "labels": [label]}
            for i in range(k)]


async def test_get_reward_per_sample_batch_empty_and_prefixed() -> None:
    cfg = Config(num_rollouts_per_prompt=4, cohort_collection_timeout_s=30.0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url,
                                                              timeout=60) as client:
        answers: dict[str, Any] = {}

        async def post(name: str, payload: dict[str, Any], path: str = "/get_reward") -> None:
            answers[name] = (await client.post(path, json=payload)).json()

        async with trio.open_nursery() as n:
            for p in ("Why is the sky blue? ", "Why is grass green? "):
                for i, payload in enumerate(orlhf_samples(p, 4)):
                    n.start_soon(post, f"{p}{i}", payload,
                                 "/ng-rollout/r1/get_reward" if i == 0 else "/get_reward")
        assert len(answers) == 8
        for a in answers.values():
            assert len(a["rewards"]) == 1 and a["scores"] == a["rewards"]
            assert a["extra_logs"]["genrm_masked"] == [0.0]
            assert a["extra_logs"]["genrm_cohort_scored"] == [4.0]
        # The legacy whole batch (OpenRLHF <= 0.9.0): each prompt's samples contiguous.
        batch = {"query": [], "prompts": [], "labels": []}
        for p in ("Batch prompt one. ", "Batch prompt two. "):
            for s in orlhf_samples(p, 4):
                for k in batch:
                    batch[k] += s[k]
        got = (await client.post("/get_reward", json=batch)).json()
        assert len(got["rewards"]) == 8 and got["extra_logs"]["genrm_masked"] == [0.0] * 8
        empty = (await client.post("/get_reward",
                                   json={"query": [], "prompts": [], "labels": []})).json()
        assert empty["rewards"] == [] and empty["scores"] == []
        bad = await client.post("/get_reward", json={"query": ["a"], "prompts": []})
        assert bad.status_code == 400 and "$.prompts" in bad.json()["detail"]
        status = (await client.get("/status")).json()
        assert status["cohorts"]["active_cohorts"] == 0


async def test_get_reward_incomplete_cohort_is_masked_uniformly() -> None:
    cfg = Config(num_rollouts_per_prompt=4, cohort_collection_timeout_s=0.3)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url,
                                                              timeout=60) as client:
        answers: list[Any] = []

        async def post(payload: dict[str, Any]) -> None:
            answers.append((await client.post("/get_reward", json=payload)).json())

        async with trio.open_nursery() as n:
            for payload in orlhf_samples("Only three came. ", 3):
                n.start_soon(post, payload)
    assert [a["rewards"] for a in answers] == [[0.0]] * 3
    for a in answers:
        assert a["extra_logs"]["genrm_masked"] == [1.0]
        assert a["extra_logs"]["genrm_failure_code"] == [2.0]
        assert a["genrm_failure_reason"][0].startswith("cohort_incomplete")


async def test_get_reward_response_is_the_query_without_the_prompt() -> None:
    from genrm_trio.server.app import get_reward_member

    member, prefix = get_reward_member("Q: hi\n", "Q: hi\nA: hello", "lab")
    assert prefix and member.fields().response["output"][0]["content"][0]["text"] == "A: hello"
    member, prefix = get_reward_member("Q: hi there\n", "Q: hi\nA: x", None)
    assert not prefix  # the longest common prefix is removed instead
    assert member.fields().response["output"][0]["content"][0]["text"] == "\nA: x"
    other, _ = get_reward_member("Q: hi\n", "Q: hi\nA: hello", "other label")
    assert other.key_scope != get_reward_member("Q: hi\n", "Q: hi\nA: b", "lab")[0].key_scope


async def test_verify_rows_without_index_over_http_under_arrival() -> None:
    """verifiers' shape: every rollout of a group sends the same row plus its response, no
    ``_ng_`` key; 2 prompts x 4 at once: 8 rewards, 2 cohorts, slots 0..3 each."""
    cfg = Config(num_rollouts_per_prompt=4, legacy_slots="arrival",
                 cohort_collection_timeout_s=30.0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url,
                                                              timeout=60) as client:
        got: list[Any] = []

        async def post(p: int, i: int) -> None:
            row = body(None, group=None, attempt=None, prompt=f"Prompt {p}?", text=answer(i))
            got.append((p, (await client.post("/verify", json=row)).json()))

        async with trio.open_nursery() as n:
            for p in range(2):
                for i in range(4):
                    n.start_soon(post, p, i)
        refused = await client.post("/verify", json={"responses_create_params": {"input": "x"},
                                                     "response": {}, "_ng_group_id": "g"})
        assert refused.status_code == 422
    assert len(got) == 8 and all(a["mask_sample"] is False for _, a in got)
    for p in range(2):
        assert sorted(a["_ng_rollout_index"] for q, a in got if q == p) == [0, 1, 2, 3]
