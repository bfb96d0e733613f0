"""The slime group reward's own logic (``genrm_trio/integrations/slime.py``), without slime.

The members of a group (slot = position, one fresh group id per call), the ``/compare``
request, the settings and the route, and what each outcome does to a sample, on both routes
against the real server in process on 127.0.0.1 port 0 (the client tests' ``server``). The
call slime makes is tested in ``tests/test_slime.py`` (opt-in).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
from typing import Any

import pytest

from genrm_trio.integrations import slime as gslime
from genrm_trio.integrations.client import Failed, Masked, Rewarded
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.settings import MockJudgeState
from tests.test_integrations_client import dispositions, server

N = 4


@dataclasses.dataclass
class Sample:
    """The fields of slime's ``Sample`` (``slime/utils/types.py``) that group_rm reads or
    sets; slime's own class is not installed here."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    response: str = ""
    reward: float | None = None
    remove_sample: bool = False
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def group(index: int, n: int = N) -> list[Sample]:
    return [Sample(group_index=index, index=index * n + k, prompt=f"question {index}",
                   response=f"answer {k} " + "more " * k) for k in range(n)]


def test_members_are_slotted_by_position_under_a_fresh_group_id() -> None:
    samples = group(7)
    members = gslime.group_members(samples, n=N)
    assert [m.slot for m in members] == list(range(N))
    assert len({m.group_id for m in members}) == 1
    assert members[0].group_id.startswith("slime:") and members[0].group_id.endswith(":g7")
    assert members[0].group_id != gslime.group_members(samples, n=N)[0].group_id
    assert [m.response["output"][0]["content"][0]["text"] for m in members] == [
        s.response for s in samples]
    chat = [Sample(prompt=[{"role": "user", "content": "hi"}], response="r")] * 2
    assert gslime.group_members(chat, n=2)[0].responses_create_params == {
        "input": [{"type": "message", "role": "user", "content": "hi"}]}


def test_groups_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="3 samples, but n_samples_per_prompt is 4"):
        gslime.group_members(group(0, 3), n=N)
    with pytest.raises(TypeError, match="fans a rollout out"):
        gslime.group_members([[s] for s in group(0)], n=N)
    mixed = group(0)
    mixed[2].prompt = "another question"
    with pytest.raises(ValueError, match="different prompts"):
        gslime.group_members(mixed, n=N)


def test_settings_come_from_args_then_the_environment() -> None:
    args = argparse.Namespace(genrm_url="http://a:1", genrm_wait_s=30)
    assert gslime.slime_options(args, env={"GENRM_URL": "http://b:2"}).url == "http://a:1"
    assert gslime.slime_options(argparse.Namespace(), env={"GENRM_URL": "http://b:2"}).url == (
        "http://b:2")
    with pytest.raises(ValueError, match="genrm_url"):
        gslime.slime_options(argparse.Namespace(), env={})


async def test_rewards_come_back_in_the_groups_order(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="genrm_trio.server"):
        async with server() as url:
            args = argparse.Namespace(genrm_url=url, n_samples_per_prompt=N,
                                      genrm_route="cohort")
            samples = group(3)
            rewards = await gslime.group_rm(args, samples)
            # The default route, one /compare: the same pairs and judge, the same rewards.
            compared = await gslime.group_rm(argparse.Namespace(
                genrm_url=url, n_samples_per_prompt=N), group(3))
    (line,) = dispositions(caplog)
    assert line.kind == "completed" and line.members == N  # type: ignore[attr-defined]
    logged = json.loads(re.search(r"rewards (\[[^\]]*\])", line.getMessage()).group(1))  # type: ignore[union-attr]
    assert len(set(logged)) > 1
    assert rewards == pytest.approx(logged, abs=1e-4)  # slot k's reward on sample k
    assert compared == rewards
    assert not any(s.remove_sample for s in samples)


@pytest.mark.parametrize("route", gslime.ROUTES)
async def test_a_masked_group_removes_its_samples(route: str) -> None:
    judge = MockJudgeState(fault=Fault.HTTP_503)
    async with server(judge=judge) as url:
        samples = group(5)
        rewards = await gslime.group_rm(argparse.Namespace(
            genrm_url=url, n_samples_per_prompt=N, genrm_route=route), samples)
    assert rewards == [gslime.MASKED_SCORE] * N == [0.0] * N
    assert all(s.remove_sample and s.metadata["genrm_masked"] for s in samples)
    assert all("503" in s.metadata["genrm_failure"] for s in samples)


def test_the_route_is_compare_unless_cohort_is_asked_for() -> None:
    assert gslime.slime_route(argparse.Namespace()) == "compare"
    assert gslime.slime_route(argparse.Namespace(genrm_route="cohort")) == "cohort"
    with pytest.raises(ValueError, match="genrm_route must be one of compare, cohort"):
        gslime.slime_route(argparse.Namespace(genrm_route="verify"))
    history, responses = gslime.compare_request(group(2))
    assert history == [{"role": "user", "content": "question 2"}]
    assert [r["output"][0]["content"][0]["text"] for r in responses] == [
        s.response for s in group(2)]
    chat = [Sample(prompt=[{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "hi"}], response="r")]
    assert gslime.compare_request(chat)[0] == [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}]


async def test_n_must_match_the_server_for_cohorts() -> None:
    async with server(n=8) as url:
        with pytest.raises(ValueError, match="num_rollouts_per_prompt is 8"):
            await gslime.group_rm(argparse.Namespace(genrm_url=url, n_samples_per_prompt=N,
                                                     genrm_route="cohort"), group(0))
        # /compare judges any group size: the server's N is not involved.
        assert len(await gslime.group_rm(argparse.Namespace(
            genrm_url=url, n_samples_per_prompt=N), group(0))) == N


def test_each_outcome_on_a_sample() -> None:
    rewarded, masked, failed = Sample(), Sample(), Sample()
    assert gslime._apply(Rewarded(2.5, {}), rewarded) == 2.5 and not rewarded.remove_sample
    assert gslime._apply(Masked("judge down", {}), masked) == 0.0 and masked.remove_sample
    assert masked.metadata == {"genrm_masked": True, "genrm_failure": "judge down"}
    assert gslime._apply(Failed(503, "shutdown", "bye"), failed) == 0.0
    assert failed.remove_sample and failed.metadata["genrm_failure"] == "shutdown: bye"
