"""TRL's own ``GRPOTrainer.train()`` rewarded by genrm-trio (opt-in: ``-m trl``; needs torch and the
``[trl]`` extra, not in CI).

``genrm-trio mock-judge`` and ``genrm-trio serve`` (``num_rollouts_per_prompt: 4``, JSON logs)
run as subprocesses on 127.0.0.1 port 0; ``tests/trl_tiny_grpo.py`` trains a tiny random Llama
with a tokenizer built in the test for two steps on CPU, ``num_generations=4``, as one process
and as two (``torch.distributed.run --nproc_per_node 2``: gloo on CPU, the batch split in two
slices of 6 rows, so one group straddles the processes). Checked: every completion rewarded,
every cohort exactly 4 members, and the trainer's logged reward mean per step equal to the mean
of the rewards the server answered (and logged) for that step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.process_helpers import REPO, mock_judge, serve_process

# Looked up, not imported: TRL runs only in the training subprocess, and importing torch here
# would load it into every pytest session that collects this file.
MISSING = [name for name in ("torch", "trl", "accelerate")
           if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.trl, pytest.mark.skipif(
    bool(MISSING), reason=f"needs {', '.join(MISSING)}: python3 -m pip install torch "
    "'genrm-trio[trl]'")]

N = 4
SCRIPT = REPO / "tests" / "trl_tiny_grpo.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("processes", [1, 2])
async def test_grpo_trainer_gets_every_reward_from_four_member_cohorts(
        tmp_path: Path, processes: int) -> None:
    out = tmp_path / "run"
    async with trio.open_nursery() as nursery:
        judge = await mock_judge(nursery, tmp_path / "judge.log")
        async with serve_process(["num_rollouts_per_prompt=4", "log_format=json"],
                                 tmp_path / "serve.log", judge_urls=(judge,)) as server:
            if processes == 1:
                command = [sys.executable, str(SCRIPT), "--per-device", "8", "--prompts", "8"]
            else:
                command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--master_addr", "127.0.0.1", "--master_port",
                           str(free_port()), str(SCRIPT), "--per-device", "6", "--prompts", "6"]
            command += ["--url", server.url, "--out", str(out), "--steps", "2"]
            with trio.fail_after(600):
                done = await trio.run_process(
                    command, cwd=REPO, check=False, capture_stdout=True, capture_stderr=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
            server_log = server.log_path.read_text()
        nursery.cancel_scope.cancel()

    records = [json.loads((out / f"process{p}.json").read_text()) for p in range(processes)]
    assert [r["num_processes"] for r in records] == [processes] * processes
    assert len({r["run_id"] for r in records}) == 1  # process 0's id, broadcast
    rows = 8 if processes == 1 else 6

    # Every completion rewarded: what the hook returned to TRL, per call, on every process.
    for record in records:
        assert len(record["returned"]) == 2
        assert all(len(call) == rows and all(isinstance(r, float) for r in call)
                   for call in record["returned"])
        assert all(a["status"] == 200 and a["mask_sample"] is False for a in record["answers"])

    # The server's answers, by call (= step) and group; each group's slots 0..3 exactly once.
    answers = [a for r in records for a in r["answers"]]
    by_group: dict[str, list[int]] = defaultdict(list)
    by_call: dict[int, list[float]] = defaultdict(list)
    for a in answers:
        by_group[a["_ng_group_id"]].append(a["_ng_rollout_index"])
        by_call[int(a["_ng_group_id"].split(":")[4].removeprefix("c"))].append(a["reward"])
    groups_per_step = rows * processes // N
    assert len(by_group) == 2 * groups_per_step
    assert all(sorted(slots) == list(range(N)) for slots in by_group.values())
    if processes == 2:  # group 1 of each step: slots 0-1 on process 0, 2-3 on process 1
        for call in range(2):
            halves = [sorted(a["_ng_rollout_index"] for a in r["answers"]
                             if f":c{call}:g1:" in a["_ng_group_id"]) for r in records]
            assert halves == [[0, 1], [2, 3]]

    # The server's own log: one completed 4-member cohort per group, the same rewards.
    lines = [json.loads(line) for line in server_log.splitlines() if '"event":"cohort"' in line]
    assert len(lines) == len(by_group)
    assert {(x["kind"], x["members"], x["size"]) for x in lines} == {("completed", N, N)}
    for x in lines:
        group = re.search(r"group '([^']+)'", x["key"]).group(1)  # type: ignore[union-attr]
        logged = json.loads(re.search(r"rewards (\[[^\]]*\])", x["msg"]).group(1))  # type: ignore[union-attr]
        answered = {a["_ng_rollout_index"]: a["reward"] for a in answers
                    if a["_ng_group_id"] == group}
        assert logged == pytest.approx([answered[s] for s in range(N)], abs=1e-4)

    # The trainer's logged reward mean per step is the mean of the server's rewards.
    history: list[dict[str, Any]] = records[0]["log_history"]
    logged_means = [h["reward"] for h in history if "reward" in h]
    assert len(logged_means) == 2
    for call in range(2):
        rewards = by_call[call]
        assert len(rewards) == rows * processes
        assert logged_means[call] == pytest.approx(sum(rewards) / len(rewards), abs=1e-5)
