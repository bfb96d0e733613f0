"""``genrm-trio demo``: the whole loop on one machine in a few seconds.

Starts the fault-injecting mock judge (same heuristic verdicts as the built-in judge, but faults
can be switched on), a genrm-trio server pointed at it, and sends four scripted cohorts of four
rollouts each: one completes, one misses a member (collection deadline), one meets two judge
faults and recovers within the retry budget, one meets a judge outage and is masked. Prints each
member's outcome as a table. Then runs a real collection (8 tasks x 4 rollouts from the mock
policy, through ``/verify``) and prints its metrics. Everything binds 127.0.0.1 on free ports,
writes only to a temporary directory and stops by itself.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import click
import httpx2
import trio

from genrm_trio.caller.collect import CollectOptions, collect_main
from genrm_trio.config import Config, JudgeConfig
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.serve import run_server

N = 4
PROMPT = "In two sentences, why does ice float on water?"
ANSWERS = [
    "Ice is less dense than liquid water because hydrogen bonds hold its molecules in an open "
    "lattice. Being lighter per volume, it floats.",
    "Water expands when it freezes, so ice weighs less than the same volume of water and floats.",
    "Because it is cold.",
    "Ice floats since its crystal structure spaces molecules farther apart than in the liquid, "
    "lowering density below that of water; buoyancy then pushes it up.",
]


def _member(group: str, slot: int) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": PROMPT}]},
        "response": {"output": [{"type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": ANSWERS[slot]}]}]},
        "_ng_group_id": group,
        "_ng_group_attempt": 0,
        "_ng_rollout_index": slot,
    }


async def _send_group(client: httpx2.AsyncClient, group: str, slots: range
                      ) -> list[tuple[int, float, dict[str, Any]]]:
    rows: list[tuple[int, float, dict[str, Any]]] = []
    start = trio.current_time()

    async def one(slot: int) -> None:
        answer = await client.post("/verify", json=_member(group, slot))
        data = answer.json() | {"_status": answer.status_code}
        rows.append((slot, trio.current_time() - start, data))

    async with trio.open_nursery() as nursery:
        for slot in slots:
            nursery.start_soon(one, slot)
    return sorted(rows, key=lambda row: row[0])


def _outcome(data: dict[str, Any]) -> str:
    if data["_status"] == 200 and not data.get("mask_sample"):
        return f"reward {data['reward']:.3f}"
    if data["_status"] == 200:
        return "masked (judge_failed)"
    return f"HTTP {data['_status']} {data.get('failure_kind')}"


async def run_demo(out: TextIO) -> int:
    """Run the scripted cohorts; returns the number of scenarios whose outcome was unexpected."""
    state = MockJudgeState()
    problems = 0
    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(
            partial(run_mock_judge, MockJudgeSettings(port=0, retry_after_s=0.1), state=state))
        cfg = Config(
            num_rollouts_per_prompt=N, port=0, cohort_collection_timeout_s=1.0,
            cohort_evaluation_timeout_s=10.0, genrm_parse_retries=3,
            genrm_parse_retry_sleep_s=0.05, judge_retry_backoff_max_s=0.5,
            judge=JudgeConfig(base_urls=(judge_url,), endpoint_cooldown_s=0.2),
        )
        stop = trio.Event()
        server_url = await nursery.start(partial(run_server, cfg, shutdown=stop))
        print(f"server {server_url}, mock judge {judge_url}, {N} rollouts per cohort\n", file=out)
        scenarios = [
            ("complete", "every member arrives; judged once", Fault.NONE, None, range(N),
             "reward"),
            ("missing member", "slot 3 never arrives (1 s deadline)", Fault.NONE, None,
             range(N - 1), "cohort_incomplete"),
            ("judge flaky", "first 2 judge calls answer 503, retried", Fault.HTTP_503, 2,
             range(N), "reward"),
            ("judge down", "every judge call answers 503", Fault.HTTP_503, None, range(N),
             "masked"),
        ]
        header = f"{'cohort':<15} {'slot':>4} {'after':>7}  outcome"
        async with httpx2.AsyncClient(base_url=server_url, timeout=30) as client:
            for name, story, fault, count, slots, expect in scenarios:
                state.reset()
                state.set_fault(fault, count)
                rows = await _send_group(client, f"demo-{name.replace(' ', '-')}", slots)
                print(f"{name}: {story}; judge calls: {state.calls}", file=out)
                print(header, file=out)
                for slot, elapsed, data in rows:
                    print(f"{name:<15} {slot:>4} {elapsed:>6.2f}s  {_outcome(data)}", file=out)
                print(file=out)
                if not all(expect in _outcome(data) for _s, _e, data in rows):
                    problems += 1
        state.reset()
        if not await _collection(server_url, out):
            problems += 1
        stop.set()
        nursery.cancel_scope.cancel()
    return problems


TASKS = [
    "Why does ice float on water?",
    "Name three prime numbers greater than 50.",
    "What causes the seasons on Earth?",
    "Explain recursion to a ten-year-old.",
    "Why is the sky blue?",
    "What is the difference between weather and climate?",
    "How does a vaccine train the immune system?",
    "Why do we have leap years?",
]


async def _collection(server_url: str, out: TextIO) -> bool:
    """8 tasks x N rollouts through ``genrm-trio collect`` (embedded mock policy); prints the
    artifacts and the headline metrics. Returns whether every rollout was rewarded."""
    with tempfile.TemporaryDirectory(prefix="genrm-trio-demo-") as tmp:
        tasks = Path(tmp) / "tasks.jsonl"
        tasks.write_text("".join(
            json.dumps({"responses_create_params": {"input": prompt}, "prompt_id": f"demo-{i}"})
            + "\n" for i, prompt in enumerate(TASKS)))
        output = Path(tmp) / "rollouts.jsonl"
        result = await collect_main(
            CollectOptions(input_path=str(tasks), output_path=str(output),
                           server_url=server_url, num_repeats=N, max_concurrent_groups=4,
                           progress_interval_s=60.0),
            progress_stream=io.StringIO(),  # the table below is the demo's report
        )
        print(f"collection: {len(TASKS)} tasks x {N} rollouts from the mock policy: "
              f"{result.successes} rewarded, {result.masked} masked, {result.failed} failed",
              file=out)
        metrics = result.metrics or {}
        agent = metrics.get("agent_metrics", {})
        for name in ("mean/reward", "std/reward", "min/reward", "max/reward", "median/reward"):
            if name in agent:
                print(f"  {name:<14} {agent[name]:.4f}", file=out)
        print(f"  artifacts: {output.name}, {output.stem}_failures.jsonl, "
              f"{output.stem}_aggregate_metrics.json (in a temporary directory, now removed)",
              file=out)
        return result.successes == len(TASKS) * N


@click.command("demo")
def demo_cli() -> None:
    """Run server, mock judge and scripted cohorts end to end; print each member's outcome."""
    problems = trio.run(run_demo, sys.stdout)
    if problems:
        click.echo(f"demo: {problems} scenario(s) did not end as expected", err=True)
        sys.exit(1)
