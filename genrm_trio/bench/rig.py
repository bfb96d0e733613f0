"""The rig of one run: the mock judge process, then the server under test (ours or NeMo Gym),
and clients to both (:func:`_rig`); the command lines that start them.

Processes are ours to end (:func:`genrm_trio.bench.processes.launch_process`: SIGTERM, a grace
period, then SIGKILL). NeMo Gym lives in its own venv (:mod:`genrm_trio.bench.nemo_gym`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec

from genrm_trio.bench import loadgen
from genrm_trio.bench.loadgen import H11Client, read_proc_stats
from genrm_trio.bench.nemo_gym import nemo_config
from genrm_trio.bench.processes import Proc, free_port, launch_process
from genrm_trio.bench.records import BenchContext, BenchError, JudgeSettings, ServerSettings

READY_OURS = "genrm-trio serve listening on "
READY_MOCK = "genrm-trio mock-judge listening on "


def ours_command(judge_url: str, server: ServerSettings) -> list[str]:
    """``genrm-trio serve`` on a free loopback port with the case's settings (no judge URL:
    the built-in judge)."""
    exe = shutil.which("genrm-trio")
    base = [exe] if exe else [sys.executable, "-m", "genrm_trio.cli"]
    ttl = "null" if server.result_ttl_s is None else repr(server.result_ttl_s)
    sets = {
        "num_rollouts_per_prompt": str(server.n),
        "max_terminal_cohorts": str(server.max_terminal_cohorts),
        "cohort_collection_timeout_s": repr(server.collection_timeout_s),
        "cohort_result_ttl_s": ttl,
        "judge_max_concurrency": "4096",
        "log_level": "WARNING",
        **dict(server.ours_extra),
    }
    cmd = [*base, "serve", "--host", "127.0.0.1", "--port", "0"]
    if judge_url:
        cmd += ["--judge-url", judge_url]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def mock_command(judge: JudgeSettings) -> list[str]:
    """The mock judge as its own process (its CPU is never counted as the server's)."""
    cmd = [
        sys.executable,
        "-m",
        "genrm_trio.mock.cli",
        "--port",
        "0",
        "--latency-ms",
        repr(judge.latency_ms),
        "--set",
        f"latency_jitter_s={judge.jitter_ms / 1000}",
    ]
    if judge.capacity is not None:
        cmd += ["--capacity", str(judge.capacity)]
    return cmd


@dataclass
class Rig:
    """One run's processes: the mock judge and the server under test, plus a client to it."""

    kind: str
    judge: Proc
    server: Proc
    client: H11Client
    judge_client: H11Client
    run_tag: str
    server_log: Path | None = None
    """Where the server under test writes its log (stderr)."""

    def stats(self) -> loadgen.ProcStats:
        return read_proc_stats(self.server.pid)

    async def judge_calls(self) -> int:
        answer = await self.judge_client.get("/admin/stats")
        calls: int = msgspec.json.decode(answer.body)["calls"]
        return calls

    async def ping(self) -> None:
        """One ``GET /health`` round trip: everything sent before it has been read."""
        await self.client.get("/health")


@asynccontextmanager
async def _rig(
    ctx: BenchContext, kind: str, judge: JudgeSettings, server: ServerSettings, label: str
) -> AsyncIterator[Rig]:
    ctx.runs += 1
    tag = f"r{ctx.runs}-{int(time.time())}"
    logs = ctx.out_dir / "logs"
    async with launch_process(
        mock_command(judge), log_path=logs / f"{label}-{kind}-judge.log", ready_prefix=READY_MOCK
    ) as judge_proc:
        if kind == "ours":
            cmd = ours_command(judge_proc.base_url, server)
            launch = launch_process(
                cmd, log_path=logs / f"{label}-ours.log", ready_prefix=READY_OURS,
                env={**os.environ, **dict(server.ours_env)} if server.ours_env else None,
            )
        else:
            if ctx.nemo_dir is None:
                raise BenchError("NeMo Gym is not available")
            port = free_port()
            env = dict(os.environ)
            env["NEMO_GYM_CONFIG_DICT"] = nemo_config(port, judge_proc.base_url, server)
            env["NEMO_GYM_CONFIG_PATH"] = "genrm_compare_bench"
            env.pop("VIRTUAL_ENV", None)
            python = str(ctx.nemo_dir.parents[4] / "bin" / "python")
            launch = launch_process(
                [python, "app.py"],
                log_path=logs / f"{label}-nemo.log",
                base_url=f"http://127.0.0.1:{port}",
                env=env,
                cwd=str(ctx.nemo_dir),
            )
        async with launch as server_proc:
            host, port = server_proc.host_port
            jhost, jport = judge_proc.host_port
            client = H11Client(host, port)
            judge_client = H11Client(jhost, jport)
            try:
                yield Rig(kind, judge_proc, server_proc, client, judge_client, tag,
                          server_log=logs / f"{label}-{kind}.log")
            finally:
                await client.aclose()
                await judge_client.aclose()
