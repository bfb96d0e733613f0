"""How evenly configs/haproxy.cfg spreads groups over two replicas, and what the alternatives do.

    PYTHONPATH=$PWD python3 bench/haproxy_balance.py [--groups 100] [--keys 5000]

For each HAProxy variant (the shipped file, and the shipped file edited: weight 1 = HAProxy's
default ring, bounded-load hashing with hash-balance-factor 125 and 150) it starts two
``genrm-trio serve`` replicas (built-in judge, N=8) and HAProxy on loopback, then

- ring share: ``--keys`` random group ids, one ``POST /seed_session`` each (answered at once,
  routed like ``/verify`` by the body's ``_ng_group_id``): the share of keys per replica;
- under load: ``--groups`` groups of 8 members, 25 groups in flight, every member sent at once:
  groups per replica, groups whose members were served by more than one replica (such a cohort
  can never complete there: its members wait out the collection deadline, 10 s here), and CPU
  seconds per replica.

Prints one markdown table. Every process is ended by pid before the next variant starts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import trio

from genrm_trio.bench.haproxy import REPLICA_HEADER, open_haproxy, shipped_config
from genrm_trio.bench.loadgen import read_proc_stats
from genrm_trio.bench.processes import launch_process

N = 8
READY = "genrm-trio serve listening on "
REPO = Path(__file__).resolve().parents[1]


def variants(text: str) -> dict[str, str]:
    bounded = "    hash-type consistent\n    hash-balance-factor {}\n"
    return {
        "shipped (weight 256)": text,
        "weight 1 (HAProxy default)": text.replace("weight 256", "weight 1"),
        "bounded load 125": text.replace("    hash-type consistent\n", bounded.format(125)),
        "bounded load 150": text.replace("    hash-type consistent\n", bounded.format(150)),
    }


def body(gid: str, slot: int) -> bytes:
    return msgspec.json.encode({
        "responses_create_params": {"input": f"prompt {gid}"},
        "response": {"output": [{"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": f"answer {slot} " * 40}]}]},
        "_ng_group_id": gid, "_ng_group_attempt": 0, "_ng_rollout_index": slot,
    })


async def measure(name: str, cfg_text: str, groups: int, keys: int, tmp: Path) -> dict[str, Any]:
    cfg = tmp / f"{abs(hash(name))}.cfg"
    cfg.write_text(cfg_text, encoding="utf-8")
    cmd = [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
           "--set", f"num_rollouts_per_prompt={N}", "--set", "cohort_collection_timeout_s=10",
           "--set", "log_level=WARNING"]
    async with launch_process(cmd, log_path=tmp / "r1.log", ready_prefix=READY,
                              cwd=str(REPO)) as r1, \
            launch_process(cmd, log_path=tmp / "r2.log", ready_prefix=READY,
                           cwd=str(REPO)) as r2, \
            open_haproxy([r1.base_url[7:], r2.base_url[7:]], max_request_bytes=16 * 2**20,
                         config=cfg, log_path=tmp / "haproxy.log") as proxy:
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx2.AsyncClient(base_url=proxy.url, timeout=60, limits=limits,
                                      trust_env=False) as client:
            ring: Counter[str] = Counter()
            for _ in range(keys):
                key = msgspec.json.encode({"_ng_group_id": uuid.uuid4().hex})
                answer = await client.post("/seed_session", content=key)
                ring[answer.headers[REPLICA_HEADER]] += 1
            cpu0 = {p.pid: read_proc_stats(p.pid).cpu_s for p in (r1, r2)}
            placed: Counter[str] = Counter()
            split = failed = 0
            limiter = trio.CapacityLimiter(25)

            async def group(i: int) -> None:
                nonlocal split, failed
                gid = uuid.uuid4().hex
                served: list[str] = []
                ok: list[bool] = []

                async def member(slot: int) -> None:
                    answer = await client.post("/verify", content=body(gid, slot))
                    served.append(answer.headers.get(REPLICA_HEADER, "?"))
                    ok.append(answer.status_code == 200)

                async with limiter, trio.open_nursery() as nursery:
                    for slot in range(N):
                        nursery.start_soon(member, slot)
                if len(set(served)) > 1:
                    split += 1
                if not all(ok):
                    failed += 1
                placed[Counter(served).most_common(1)[0][0]] += 1

            async with trio.open_nursery() as nursery:
                for i in range(groups):
                    nursery.start_soon(group, i)
            cpu = {name_: round(read_proc_stats(p.pid).cpu_s - cpu0[p.pid], 2)
                   for name_, p in (("r1", r1), ("r2", r2))}
    total = sum(ring.values())
    return {
        "variant": name,
        "ring share r1/r2 (%)": f"{100 * ring['r1'] / total:.1f} / {100 * ring['r2'] / total:.1f}",
        "groups r1/r2": f"{placed['r1']} / {placed['r2']}",
        "split groups": split,
        "failed groups": failed,
        "CPU s r1/r2": f"{cpu['r1']} / {cpu['r2']}",
    }


async def main(groups: int, keys: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in variants(shipped_config().read_text(encoding="utf-8")).items():
            rows.append(await measure(name, text, groups, keys, Path(tmp)))
            print(rows[-1], file=sys.stderr, flush=True)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--keys", type=int, default=5000)
    args = parser.parse_args()
    trio.run(main, args.groups, args.keys)
