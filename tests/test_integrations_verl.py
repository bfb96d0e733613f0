"""The veRL managers' own logic (``genrm_trio/integrations/verl.py``), without veRL.

What veRL does with the managers is tested, with veRL, in ``tests/test_verl.py`` (opt-in). Here:
the settings and the N check, the group key, the legacy batch's members (grouping by uid, slots
in the order rows appear) and their rewards back on their own rows, the reward loop's slot
search, the score and ``reward_extra_info`` of each outcome, against the real server in process
on 127.0.0.1 port 0 (the client tests' ``server``). Importing the module needs no veRL.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import msgspec
import pytest
import trio

from genrm_trio import identity
from genrm_trio.integrations import verl as gverl
from genrm_trio.integrations.client import (
    Failed,
    GenRMClient,
    Masked,
    Member,
    RequestRefused,
    Rewarded,
)
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.settings import MockJudgeState
from tests.test_integrations_client import server

N = 4


def config(n: int = 4, val_n: int = 1, test_freq: int = -1, before: bool = False) -> Any:
    return {"actor_rollout_ref": {"rollout": {"n": n, "val_kwargs": {"n": val_n}}},
            "trainer": {"test_freq": test_freq, "val_before_train": before},
            "reward": {"reward_kwargs": {"genrm_url": "http://127.0.0.1:1"}}}


# ----------------------------------------------------------------------------- settings


def test_options_come_from_the_genrm_keys_and_name_a_bad_one() -> None:
    options = gverl.GenRMOptions.from_kwargs(
        {"genrm_url": " http://genrm:8000 ", "genrm_wait_s": 90, "overlong_buffer_cfg": {}},
        "reward.reward_kwargs")
    assert (options.url, options.wait_s, options.token_env) == ("http://genrm:8000", 90.0, None)
    for kwargs, key in [({}, "genrm_url"), ({"genrm_url": ""}, "genrm_url"),
                        ({"genrm_url": "u", "genrm_wait_s": 0}, "genrm_wait_s"),
                        ({"genrm_url": "u", "genrm_slack_s": float("inf")}, "genrm_slack_s"),
                        ({"genrm_url": "u", "genrm_max_connections": 0},
                         "genrm_max_connections"),
                        ({"genrm_url": "u", "genrm_token_env": 3}, "genrm_token_env")]:
        with pytest.raises(ValueError, match=f"reward.reward_kwargs.{key}"):
            gverl.GenRMOptions.from_kwargs(kwargs, "reward.reward_kwargs")


def test_validation_must_sample_rollout_n_when_it_runs() -> None:
    assert gverl.check_rollout_n(config()) == 4  # validation off: val_kwargs.n is never used
    assert gverl.check_rollout_n(config(val_n=4, test_freq=5)) == 4
    for bad in (config(test_freq=5), config(before=True), config(val_n=8, before=True)):
        with pytest.raises(ValueError, match="val_kwargs.n"):
            gverl.check_rollout_n(bad)
    with pytest.raises(ValueError, match="rollout.n must be >= 2"):
        gverl.check_rollout_n(config(n=1))


def test_the_group_key_is_the_uid() -> None:
    assert gverl.group_id_of("3f2a-uid") == "verl:3f2a-uid"
    long = gverl.group_id_of("u" * 1000)
    assert long.startswith("verl:sha256-") and len(long) < 100
    assert long == gverl.group_id_of("u" * 1000) != gverl.group_id_of("u" * 999)


def test_a_response_id_makes_equal_texts_two_members() -> None:
    plain = gverl.response_object("same")
    assert "id" not in plain and plain["output"][0]["content"][0]["text"] == "same"
    a = gverl.response_object("same", response_id="resp_a")
    b = gverl.response_object("same", response_id="resp_b")
    assert identity.response_digest(a) != identity.response_digest(b)


def test_the_classes_need_verl_and_say_how_to_install_it() -> None:
    if importlib.util.find_spec("verl") is not None:
        pytest.skip("veRL is installed here: tests/test_verl.py loads the classes")
    for name in ("GenRMRewardLoopManager", "GenRMRewardManager"):
        with pytest.raises(ImportError, match=r"genrm-trio\[verl\]"):
            getattr(gverl, name)
    assert not hasattr(gverl, "NoSuchManager")


# ----------------------------------------------------------------------------- the legacy batch


def rows(order: list[int]) -> tuple[list[str], list[Any], list[str]]:
    """Two prompts x N rows in veRL's interleaved layout, then reordered by ``order`` (as
    ``_balance_batch`` reorders a batch)."""
    uids = [u for u in ("uid-a", "uid-b") for _ in range(N)]
    prompts = [[{"role": "user", "content": f"question {u}"}] for u in uids]
    texts = [f"{u} answer {k} " + "more " * k for u in ("a", "b") for k in range(N)]
    return [uids[i] for i in order], [prompts[i] for i in order], [texts[i] for i in order]


def test_legacy_members_group_by_uid_with_slots_in_row_order() -> None:
    order = [5, 0, 7, 2, 3, 6, 1, 4]
    uids, prompts, texts = rows(order)
    members = gverl.batch_members(uids, prompts, texts, n=N)
    assert [m.group_id for m in members] == [f"verl:{u}" for u in uids]
    assert [m.slot for m in members] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [m.response["output"][0]["content"][0]["text"] for m in members] == texts
    assert members[0].responses_create_params == {
        "input": [{"type": "message", "role": "user", "content": "question uid-b"}]}


def test_legacy_members_refuse_groups_that_do_not_fit() -> None:
    uids, prompts, texts = rows(list(range(8)))
    with pytest.raises(ValueError, match="every uid must have 8 samples"):
        gverl.batch_members(uids, prompts, texts, n=8)
    with pytest.raises(ValueError, match="the same number of"):
        gverl.batch_members(uids[:7], prompts[:7], texts[:7])
    with pytest.raises(ValueError, match="different prompts"):
        gverl.batch_members(uids, [prompts[0]] * 4 + [[{"role": "user", "content": "x"}]]
                            + prompts[5:], texts, n=N)
    with pytest.raises(ValueError, match="7 prompts"):
        gverl.batch_members(uids, prompts[:7], texts, n=N)


async def test_a_reordered_batch_gets_each_rows_own_reward() -> None:
    """The legacy manager's path: members of a reordered batch, one ``verify_groups``, each
    outcome put on its row; every row's score is the server's reward for its own slot and
    answer, whatever the order (the same answers in batch order give the same rewards)."""
    scores: dict[str, dict[str, float]] = {}
    async with server() as url, GenRMClient(url) as client:
        for name, order in (("straight", list(range(8))), ("balanced", [6, 1, 4, 3, 0, 7, 2, 5])):
            uids, prompts, texts = rows(order)
            uids = [f"{name}-{u}" for u in uids]
            members = gverl.batch_members(uids, prompts, texts, n=N)
            outcomes = await client.verify_groups(members)
            entries = [gverl.outcome_entry(o, m) for o, m in zip(outcomes, members, strict=True)]
            for (score, info), member_, outcome, text in zip(entries, members, outcomes, texts,
                                                              strict=True):
                assert isinstance(outcome, Rewarded)
                assert outcome.answer["_ng_group_id"] == member_.group_id
                assert outcome.answer["_ng_rollout_index"] == member_.slot
                assert outcome.answer["response"]["output"][0]["content"][0]["text"] == text
                assert score == outcome.reward
                assert info == {"genrm_masked": 0.0, "genrm_failure_kind": "",
                                "genrm_failure_reason": "",
                                "genrm_member": f"{member_.group_id}#{member_.slot}"}
            scores[name] = {t: s for t, (s, _) in zip(texts, entries, strict=True)}
    # Slots differ between the two orders; with this judge (the built-in heuristic) a
    # response's reward depends on its text and its neighbours', so only compare within runs.
    assert len(set(scores["balanced"].values())) > 1


# ----------------------------------------------------------------------------- the reward loop


def sample(uid: str, text: str, start: int) -> Member:
    return Member(group_id=gverl.group_id_of(uid), slot=start,
                  responses_create_params={"input": [{"role": "user", "content": "q " + uid}]},
                  response=gverl.response_object(text, response_id=f"resp_{random.random()}"))


async def test_samples_find_free_slots_in_any_order() -> None:
    """Four samples of a group, all starting at slot 0, at once, and a group whose samples
    share one text: each gets a slot of its own (409 conflict moves it on) and that slot's
    reward."""
    async with server() as url, GenRMClient(url) as client:
        results: dict[str, list[tuple[Any, Member]]] = {"spread": [], "same": []}

        async def one(name: str, text: str, start: int) -> None:
            results[name].append(await gverl.verify_with_free_slot(
                client, sample(name, text, start), N))

        async with trio.open_nursery() as nursery:
            for k in range(N):
                nursery.start_soon(one, "spread", f"answer {k} " + "more " * k, 0)
                nursery.start_soon(one, "same", "the same answer", k % 2)
    for name, placed in results.items():
        assert sorted(m.slot for _, m in placed) == list(range(N)), name
        for outcome, member_ in placed:
            assert isinstance(outcome, Rewarded)
            assert outcome.answer["_ng_rollout_index"] == member_.slot
            assert outcome.answer["response"] == member_.response


async def test_a_sample_beyond_n_and_a_wrong_prompt_are_refused() -> None:
    async with server() as url, GenRMClient(url) as client:
        async with trio.open_nursery() as nursery:
            for k in range(N):
                nursery.start_soon(gverl.verify_with_free_slot, client,
                                   sample("full", f"answer {k}", k), N)
        with pytest.raises(ValueError, match="more samples share this uid"):
            await gverl.verify_with_free_slot(client, sample("full", "a fifth", 0), N)
        stranger = msgspec.structs.replace(sample("full", "answer 0", 0),
                                           responses_create_params={"input": "other"})
        with pytest.raises(RequestRefused) as refused:
            await gverl.verify_with_free_slot(client, stranger, N)
        assert refused.value.kind == "prompt_mismatch"


async def test_a_masked_cohort_gives_every_sample_the_masked_score() -> None:
    judge = MockJudgeState(fault=Fault.HTTP_503)
    async with server(judge=judge) as url, GenRMClient(url) as client:
        placed = []

        async def one(k: int) -> None:
            placed.append(await gverl.verify_with_free_slot(
                client, sample("masked", f"answer {k}", k), N))

        async with trio.open_nursery() as nursery:
            for k in range(N):
                nursery.start_soon(one, k)
    for outcome, member_ in placed:
        assert isinstance(outcome, Masked)
        score, info = gverl.outcome_entry(outcome, member_)
        assert score == gverl.MASKED_SCORE == 0.0
        assert info["genrm_masked"] == 1.0 and info["genrm_failure_kind"] == "judge_failed"
        assert "503" in info["genrm_failure_reason"]


def test_every_outcome_has_the_same_extra_keys() -> None:
    member_ = sample("u", "t", 2)
    for outcome in (Rewarded(1.5, {}), Masked("judge down " * 100, {}),
                    Failed(503, "cohort_incomplete", "only 3 of 4 members")):
        score, info = gverl.outcome_entry(outcome, member_)
        assert tuple(info) == gverl.EXTRA_KEYS
        assert info["genrm_member"] == "verl:u#2"
        assert len(info["genrm_failure_reason"]) <= 200
        assert score == (1.5 if isinstance(outcome, Rewarded) else 0.0)
    assert gverl.outcome_entry(Failed(503, "cohort_incomplete", "x"), member_)[1][
        "genrm_failure_kind"] == "cohort_incomplete"


async def test_the_reward_loop_keeps_one_client_per_loop() -> None:
    """``run_single`` runs once per sample: the manager's client is opened once on the loop
    and kept (a client per sample would be a connection pool and a /status read per sample)."""
    manager = object.__new__(gverl._RewardLoopManager)  # veRL's base class is not here
    async with server() as url:
        manager.options = gverl.GenRMOptions(url)
        manager.n = N
        manager._client = None
        first = await manager.client()
        assert await manager.client() is first
        await manager.aclose()
        assert manager._client is None
        manager.n = 8
        with pytest.raises(ValueError, match="rollout.n is 8"):
            await manager.client()
        await manager.aclose()
