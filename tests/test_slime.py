"""slime's group reward call made against genrm-trio (opt-in: ``-m slime``; not in CI).

slime (THUDM/slime) is not on PyPI (the ``slime`` package there, 0.0.0, is a linear mixed
effects library), so its code does not run here. This test makes the exact call its code makes,
read from its source: with ``--group-rm --custom-rm-path genrm_trio.integrations.slime.group_rm``,
``generate_and_rm_group`` (``slime/rollout/sglang_rollout.py``) awaits
``batched_async_rm(args, group)`` once the whole group has generated, which loads the function
by its dotted path (``slime/utils/misc.py`` ``load_function``: import the module part, take
the attribute) and returns ``await fn(args, samples)``; the rewards are then set on the samples
in order (``sample.reward = reward``). slime runs many groups at once on its rollout loop, an
asyncio loop in a thread of its own: here three groups at once on an asyncio loop in a worker
thread. The samples are instances of a dataclass with the fields of slime's ``Sample``
(``slime/utils/types.py``) that the call reads and sets.

``genrm-trio mock-judge`` and ``genrm-trio serve`` (``num_rollouts_per_prompt: 4``, JSON logs)
run as subprocesses on 127.0.0.1 port 0. With ``genrm_route: cohort``, checked against the
server's own log: 12 rewards from 3 cohorts of 4, each sample's reward its slot's; the same
groups through the default route (one ``/compare`` each) get the same rewards; then a garbage
verdict masks a group on each route: 0.0 for every sample, each marked ``remove_sample``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio

from tests.process_helpers import completed_cohort_rewards, mock_judge, run_asyncio, serve_process

pytestmark = pytest.mark.slime

N = 4
SETTINGS = ["num_rollouts_per_prompt=4", "log_format=json", "unparseable_verdict_policy=mask",
            "genrm_parse_retries=0", "cohort_collection_timeout_s=120",
            "cohort_evaluation_timeout_s=120"]


@dataclasses.dataclass
class Sample:
    """slime's ``Sample`` fields that the group reward path reads or sets."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    response: str = ""
    label: str | None = None
    reward: float | None = None
    remove_sample: bool = False
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def groups(first: int, count: int) -> list[list[Sample]]:
    return [[Sample(group_index=g, index=g * N + k,
                    prompt=[{"role": "user", "content": f"question number {g}"}],
                    response=f"answer {k} to {g} " + "more " * k) for k in range(N)]
            for g in range(first, first + count)]


async def slime_rollout(args: argparse.Namespace, batch: list[list[Sample]]) -> None:
    """On a fresh asyncio loop in a worker thread (:func:`run_asyncio`, bounded), every group
    at once: the group reward call of ``generate_and_rm_group`` with ``--group-rm``, then the
    rewards zipped onto the samples."""

    async def group_reward(group: list[Sample]) -> None:
        module, _, name = args.custom_rm_path.rpartition(".")
        rm_function = getattr(importlib.import_module(module), name)
        rewards = await rm_function(args, group)
        for sample, reward in zip(group, rewards, strict=False):
            sample.reward = reward

    async def rollout() -> None:
        await asyncio.gather(*(group_reward(g) for g in batch))

    await run_asyncio(rollout(), 300)


async def test_slimes_group_reward_call_gets_cohort_rewards(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        judge = await mock_judge(nursery, tmp_path / "judge.log")
        async with serve_process(SETTINGS, tmp_path / "serve.log",
                                 judge_urls=(judge,)) as server:
            args = argparse.Namespace(
                group_rm=True, custom_rm_path="genrm_trio.integrations.slime.group_rm",
                n_samples_per_prompt=N, genrm_url=server.url, genrm_route="cohort",
                rm_type=None, reward_key=None)
            batch = groups(0, 3)
            await slime_rollout(args, batch)
            # The default route, /compare, on the same groups: the same pairs, the same rewards.
            compared = groups(0, 3)
            await slime_rollout(argparse.Namespace(
                **{**vars(args), "genrm_route": "compare"}), compared)
            async with httpx2.AsyncClient() as http:
                answer = await http.post(judge + "/admin/fault",
                                         json={"fault": "garbage", "count": None})
                assert answer.status_code == 200
            masked, masked_compared = groups(3, 1), groups(4, 1)
            await slime_rollout(args, masked)
            await slime_rollout(argparse.Namespace(
                **{**vars(args), "genrm_route": "compare"}), masked_compared)
            server_log = server.log_path.read_text()
        nursery.cancel_scope.cancel()
    lines = [json.loads(line) for line in server_log.splitlines() if '"event":"cohort"' in line]
    assert [x["kind"] for x in lines].count("completed") == 3
    rewards = completed_cohort_rewards(lines, N)
    assert all(isinstance(s.reward, float) and not s.remove_sample for g in batch for s in g)
    # Each group is one cohort named by its group_index; its samples carry its slots' rewards.
    for group in batch:
        (name,) = [k for k in rewards if k.endswith(f":g{group[0].group_index}")]
        assert [s.reward for s in group] == pytest.approx(rewards[name], abs=1e-4)
        assert len(set(rewards[name])) > 1
    (failed,) = [x for x in lines if x["kind"] == "judge_failed"]
    assert failed["members"] == N and failed["key"].endswith(":g3' attempt 0")
    assert [[s.reward for s in g] for g in compared] == [[s.reward for s in g] for g in batch]
    for group in (masked[0], masked_compared[0]):
        assert [s.reward for s in group] == [0.0] * N
        assert all(s.remove_sample and s.metadata["genrm_masked"] for s in group)
        assert all("no parseable verdict" in s.metadata["genrm_failure"] for s in group)
