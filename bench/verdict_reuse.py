"""Judge calls of a replacement attempt, with and without verdict reuse (issue 18 item 1).

    python3 bench/verdict_reuse.py [--groups 16] [--n 8] [--latency-ms 20] [--judge-slots 16]
                                   [--order complete_group] [--outage-after 0.5]
                                   [--jitter-ms 0] [--flaky 0] [--seed 0]

One process: the mock judge (``genrm_trio.mock``, ``--latency-ms`` per call) and the server
(``run_server``, real HTTP on 127.0.0.1) each on a port of its own, the members sent over HTTP.
For each ``comparison_strategy`` and each ``verdict_reuse`` (``off``, then ``group``), on a
fresh server:

1. **Outage.** ``--groups`` groups of ``--n`` members go out at once (attempt 0), the judge
   serving ``--judge-slots`` calls at once (``judge.max_concurrency_per_endpoint``; the rest wait
   here, in ``--order``); once it has received ``--outage-after`` of their comparisons it
   answers 503 to everything (``--flaky P`` instead: each call of attempt 0 gets a 503 with
   probability P; ``genrm_parse_retries: 0``): every group still judging is masked
   (``judge_failed``). The judge recovers and the caller resends each masked group as attempt
   1, unchanged. Reported: groups masked, judge calls of the replacement attempts, the fewest
   possible (the masked groups' comparisons whose verdict never came back), the replacements'
   wall time.
2. **Changed answers.** With the judge healthy, ``--groups`` fresh groups complete, then each
   is resent as attempt 1 with ``k`` of its answers regenerated (k = 0, 1, 2): judge calls of
   attempt 1 against the comparisons that touch a changed answer.

The mock judge's verdict is a function of the pair, so rewards must come out identical with and
without reuse; the script checks that they do and exits 1 if not.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from typing import Any

import httpx2
import trio

from genrm_trio import scoring
from genrm_trio.config import Config, JudgeConfig
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.server.serve import run_server


def member(group: str, attempt: int, slot: int, text: str) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": f"Task of {group}: explain the tides."},
        "response": {"output": [{"type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": text}]}]},
        "_ng_group_id": group, "_ng_group_attempt": attempt, "_ng_rollout_index": slot,
    }


def answer(group: str, slot: int, version: int = 0) -> str:
    return f"{group} answer {slot} v{version}: the moon's pull, " + "and the sun's. " * (slot + 1)


async def send_group(client: httpx2.AsyncClient, group: str, attempt: int,
                     texts: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{}] * len(texts)

    async def one(slot: int) -> None:
        got = await client.post("/verify", json=member(group, attempt, slot, texts[slot]))
        got.raise_for_status()
        out[slot] = got.json()

    async with trio.open_nursery() as nursery:
        for slot in range(len(texts)):
            nursery.start_soon(one, slot)
    return out


async def scenario(reuse: str, strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    pairs = len(scoring.comparison_pairs(args.n, strategy, 1))
    judge = MockJudgeState()
    result: dict[str, Any] = {"reuse": reuse, "strategy": strategy, "pairs": pairs}
    async with trio.open_nursery() as nursery:
        judge_url = await nursery.start(partial(run_mock_judge, MockJudgeSettings(
            latency_s=args.latency_ms / 1000, latency_jitter_s=args.jitter_ms / 1000,
            seed=args.seed), state=judge))
        cfg = Config(
            port=0, num_rollouts_per_prompt=args.n, comparison_strategy=strategy,
            verdict_reuse=reuse, genrm_parse_retries=0, log_level="ERROR",
            cohort_collection_timeout_s=600.0, cohort_evaluation_timeout_s=600.0,
            judge_order=args.order,
            judge=JudgeConfig(base_urls=(judge_url,),
                              max_concurrency_per_endpoint=args.judge_slots or None),
        )
        stop = trio.Event()
        async with trio.open_nursery() as server_nursery:
            url = await server_nursery.start(partial(run_server, cfg, shutdown=stop))
            try:
                await run_phases(url, judge, strategy, args, pairs, result)
            finally:
                stop.set()
        nursery.cancel_scope.cancel()  # the mock judge serves until cancelled
    return result


async def run_phases(url: str, judge: MockJudgeState, strategy: str, args: argparse.Namespace,
                     pairs: int, result: dict[str, Any]) -> None:
    n, groups = args.n, args.groups
    async with httpx2.AsyncClient(base_url=url, timeout=600.0) as client:
        if True:
            # 1. outage during attempt 0, then the masked groups resent unchanged
            names = [f"{strategy}-outage-{g}" for g in range(groups)]
            texts = {g: [answer(g, s) for s in range(n)] for g in names}
            first: dict[str, list[dict[str, Any]]] = {}
            outage_at = int(args.outage_after * groups * pairs)

            async def attempt_0(group: str) -> None:
                first[group] = await send_group(client, group, 0, texts[group])

            if args.flaky > 0:
                judge.set_fault(Fault.HTTP_503, None, rate=args.flaky)
            async with trio.open_nursery() as senders:
                for g in names:
                    senders.start_soon(attempt_0, g)
                if args.flaky == 0:
                    await judge.wait_for(lambda s: s.calls >= outage_at)
                    judge.set_fault(Fault.HTTP_503, None)
            judge.set_fault(Fault.NONE, None)
            masked = [g for g in names if first[g][0]["mask_sample"]]
            status = (await client.get("/status")).json()["verdict_reuse"]
            judged = status["judged_comparisons"]  # verdicts back so far, in either mode
            completed_pairs = (groups - len(masked)) * pairs
            before = judge.calls
            started = time.perf_counter()
            second: dict[str, list[dict[str, Any]]] = {}

            async def attempt_1(group: str) -> None:
                second[group] = await send_group(client, group, 1, texts[group])

            async with trio.open_nursery() as senders:
                for g in masked:
                    senders.start_soon(attempt_1, g)
            result.update(
                masked=len(masked), replacement_calls=judge.calls - before,
                # The masked groups' comparisons whose verdict never came back: judged again
                # however clever the server (those that did come back are kept with reuse).
                fewest_calls=len(masked) * pairs - (judged - completed_pairs),
                replacement_wall_s=round(time.perf_counter() - started, 3),
                outage_rewards={g: [a["reward"] for a in second[g]] for g in masked},
                reused=[second[g][0]["genrm_reused_comparisons"] for g in masked],
            )
            # 2. changed answers, judge healthy
            for k in (0, 1, 2):
                names = [f"{strategy}-changed{k}-{g}" for g in range(groups)]
                async with trio.open_nursery() as senders:
                    for g in names:
                        senders.start_soon(send_group, client, g, 0,
                                           [answer(g, s) for s in range(n)])
                before = judge.calls
                changed_rewards: dict[str, list[float]] = {}

                async def changed(group: str, k: int = k,
                                  into: dict[str, list[float]] = changed_rewards) -> None:
                    new = [answer(group, s, 1 if s < k else 0) for s in range(n)]
                    out = await send_group(client, group, 1, new)
                    into[group] = [a["reward"] for a in out]

                async with trio.open_nursery() as senders:
                    for g in names:
                        senders.start_soon(changed, g)
                touching = sum(1 for i, j, _ in scoring.comparison_pairs(n, strategy, 1)
                               if i < k or j < k)
                result[f"changed_{k}"] = {"calls": judge.calls - before,
                                          "touching": groups * touching,
                                          "rewards": changed_rewards}


async def main(args: argparse.Namespace) -> int:
    ok = True
    failure = (f"{args.flaky:.0%} of attempt 0's calls answered 503" if args.flaky > 0 else
               f"outage after {args.outage_after:.0%} of attempt 0's comparisons")
    print(f"groups {args.groups}, N = {args.n}, judge latency {args.latency_ms:g} ms "
          f"+ up to {args.jitter_ms:g} ms, {args.judge_slots or 'unlimited'} judge slots, "
          f"judge_order {args.order}, {failure}\n")
    print("| strategy | verdict_reuse | masked groups | replacement judge calls | fewest possible "
          "| replacement wall s | k=0 changed: calls | k=1 | k=2 | calls touching k=1, k=2 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for strategy in ("circular", "all_pairs"):
        runs = [await scenario(reuse, strategy, args) for reuse in ("off", "group")]
        for r in runs:
            print(f"| {strategy} | {r['reuse']} | {r['masked']} of {args.groups} | "
                  f"{r['replacement_calls']} | {r['fewest_calls']} | {r['replacement_wall_s']} | "
                  f"{r['changed_0']['calls']} | {r['changed_1']['calls']} | "
                  f"{r['changed_2']['calls']} | {r['changed_1']['touching']}, "
                  f"{r['changed_2']['touching']} |")
        off, group = runs
        for k in (0, 1, 2):
            if off[f"changed_{k}"]["rewards"] != group[f"changed_{k}"]["rewards"]:
                print(f"rewards differ with reuse ({strategy}, k={k})", file=sys.stderr)
                ok = False
        # The masked groups differ between runs (the outage's timing); compare those in both.
        common = set(off["outage_rewards"]) & set(group["outage_rewards"])
        if any(off["outage_rewards"][g] != group["outage_rewards"][g] for g in common):
            print(f"rewards differ with reuse ({strategy}, after the outage)", file=sys.stderr)
            ok = False
    print("\nrewards with reuse equal rewards without: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--judge-slots", type=int, default=16,
                        help="judge.max_concurrency_per_endpoint: calls the judge serves at once")
    parser.add_argument("--order", default="complete_group", help="judge_order")
    parser.add_argument("--jitter-ms", type=float, default=0.0,
                        help="each judge call takes latency plus up to this much more")
    parser.add_argument("--flaky", type=float, default=0.0,
                        help="instead of an outage: this share of attempt 0's calls get 503")
    parser.add_argument("--seed", type=int, default=0, help="the mock judge's random seed")
    parser.add_argument("--outage-after", type=float, default=0.5,
                        help="share of attempt 0's comparisons answered before the outage")
    sys.exit(trio.run(main, parser.parse_args()))
