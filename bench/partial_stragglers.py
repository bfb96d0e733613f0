"""One straggler per group, dropped: partial cohorts end to end (issue 19).

    python3 bench/partial_stragglers.py [--groups 4] [--n 4] [--deadline-s 1] [--late-s 2]

Starts a server (``incomplete_cohort_policy: judge_present``, the built-in judge, collection
deadline ``--deadline-s``) and runs ``genrm-trio collect``'s collector against it with the
embedded mock policy, whose every N-th generation for a prompt comes ``--late-s`` late
(``straggler_every: N``): one straggler per group. Prints, per group, the N-1 rewards with
``genrm_cohort_expected`` / ``genrm_cohort_scored`` from ``out.jsonl``, and the straggler's answer
from the failure sidecar (409 ``cohort_closed``). The same run from the command line::

    genrm-trio serve --port 8000 --set num_rollouts_per_prompt=4 \\
        --set incomplete_cohort_policy=judge_present --set cohort_collection_timeout_s=1 &
    genrm-trio collect --input tasks.jsonl --output out.jsonl --server http://127.0.0.1:8000 \\
        --num-repeats 4 --route-failures-to-sidecar \\
        --mock-policy-set straggler_every=4 --mock-policy-set straggler_delay_s=2
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from functools import partial
from pathlib import Path

import trio

from genrm_trio.caller.aggregate import failures_path_for, read_jsonl
from genrm_trio.caller.collect import CollectOptions, run_collection
from genrm_trio.caller.mock_policy import MockPolicySettings, run_mock_policy
from genrm_trio.config import load_config
from genrm_trio.server.serve import run_server


async def main(groups: int, n: int, deadline_s: float, late_s: float, tmp: Path) -> None:
    tasks = tmp / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"responses_create_params": {"input": [
        {"role": "user", "content": f"Task {t}: why is the sky blue? Explain briefly."}]}})
        + "\n" for t in range(groups)))
    cfg = load_config(None, [
        "port=0", f"num_rollouts_per_prompt={n}", "incomplete_cohort_policy=judge_present",
        f"cohort_collection_timeout_s={deadline_s}", "log_level=WARNING"], {})
    async with trio.open_nursery() as nursery:
        server = await nursery.start(run_server, cfg)
        policy = await nursery.start(partial(run_mock_policy, MockPolicySettings(
            straggler_every=n, straggler_delay_s=late_s)))
        result = await run_collection(CollectOptions(
            input_path=str(tasks), output_path=str(tmp / "out.jsonl"), server_url=server,
            policy_url=policy, num_repeats=n, route_failures_to_sidecar=True,
            max_concurrent_groups=groups), progress_stream=io.StringIO())
        nursery.cancel_scope.cancel()
    rows = read_jsonl(tmp / "out.jsonl")
    sidecar = read_jsonl(failures_path_for(tmp / "out.jsonl"))
    print(f"N={n}, {groups} groups, collection deadline {deadline_s:g} s, one straggler per "
          f"group {late_s:g} s late; {len(rows)} rewarded rows, {len(sidecar)} sidecar rows")
    for task in range(groups):
        print(f"task {task}:")
        for row in sorted((r for r in rows if r["_ng_task_index"] == task),
                          key=lambda r: r["_ng_rollout_index"]):
            print(f"  slot {row['_ng_rollout_index']}: reward {row['reward']:.4f}  "
                  f"genrm_cohort_expected {row['genrm_cohort_expected']}, "
                  f"genrm_cohort_scored {row['genrm_cohort_scored']}")
        for row in (r for r in sidecar if r["_ng_task_index"] == task):
            answer = json.loads(row["_ng_failure_response_body"])
            print(f"  slot {row['_ng_rollout_index']}: HTTP {row['_ng_failure_http_status']} "
                  f"{answer['failure_kind']}: {answer['detail']}")
    assert result.metrics is not None
    agent = result.metrics["agent_metrics"]
    print("agent_metrics: " + ", ".join(
        f"{k} {agent[k]:g}" for k in ("rollouts/scored", "mean/reward",
                                     "mean/genrm_cohort_scored", "mean/genrm_cohort_expected")))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--deadline-s", type=float, default=1.0)
    parser.add_argument("--late-s", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(main, args.groups, args.n, args.deadline_s, args.late_s, Path(tmp))
