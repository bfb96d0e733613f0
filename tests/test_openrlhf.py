"""OpenRLHF 0.11.2's own remote reward client against ``genrm-trio serve`` (issue 30; opt-in).

Run: ``python3 -m pytest -m openrlhf tests/test_openrlhf.py``. Needs aiohttp and the OpenRLHF
0.11.2 wheel (``pip download --no-deps openrlhf==0.11.2 -d /opt/wheels``; or set
``GENRM_OPENRLHF_WHEEL``). The package pins flash-attn and deepspeed and its ``__init__`` imports
them, so its ``openrlhf/utils/agent.py`` (which needs only aiohttp and the package's
``logging_utils``) is loaded by path from the wheel, without the package's ``__init__``.
``SingleTurnAgentExecutor._fetch_rewards_via_http`` is what 0.11.2's rollout calls for
``--reward.remote_url``: one call per sample, a new aiohttp session per try, 5 tries 1 s apart.
The asyncio client runs in a worker thread of the trio test (asyncio.run there).
"""

from __future__ import annotations

import asyncio
import glob
import importlib.util
import json
import os
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.process_helpers import run_asyncio, serve_process

pytestmark = pytest.mark.openrlhf

INSTALL = ("pip download --no-deps openrlhf==0.11.2 -d /opt/wheels (and pip install aiohttp), "
           "or set GENRM_OPENRLHF_WHEEL")


def _load_agent(tmp: Path) -> Any:
    pytest.importorskip("aiohttp", reason=INSTALL)
    wheels = [os.environ.get("GENRM_OPENRLHF_WHEEL", "")] + sorted(
        glob.glob("/opt/wheels/openrlhf-0.11.2-*.whl"))
    wheel = next((w for w in wheels if w and Path(w).is_file()), None)
    if wheel is None:
        pytest.skip(INSTALL)
    root = tmp / "orlhf"
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith(("openrlhf/utils/agent.py", "openrlhf/utils/logging_utils.py")):
                target = root / Path(name).name
                root.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(name))
    # Package stubs, so `from openrlhf.utils.logging_utils import init_logger` finds the real
    # module file without running openrlhf/__init__.py.
    for pkg in ("openrlhf", "openrlhf.utils"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg))
    for mod, fname in (("openrlhf.utils.logging_utils", "logging_utils.py"),
                       ("openrlhf.utils.agent", "agent.py")):
        spec = importlib.util.spec_from_file_location(mod, root / fname)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod] = module
        spec.loader.exec_module(module)
    return sys.modules["openrlhf.utils.agent"]


def _answer(p: int, i: int) -> str:
    return f"Answer {i} to prompt {p}: " + "because of physics. " * (i + 1)


class ResetFirst:
    """A loopback TCP proxy that forwards everything, except that the first connection whose
    request holds ``marker`` is forwarded and then cut (client and server side) after
    ``hold_s``: a transport failure of one try, after the server registered the member."""

    def __init__(self, upstream_port: int, marker: bytes, hold_s: float = 0.8) -> None:
        self.upstream_port = upstream_port
        self.marker = marker
        self.hold_s = hold_s
        self.cut = 0
        self.port = 0

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
        cutting = False
        async with client, upstream, trio.open_nursery() as nursery:
            async def down() -> None:
                while data := await upstream.receive_some(65536):
                    if not cutting:  # the cut connection never gets its answer
                        await client.send_all(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(down)
            seen = b""
            while data := await client.receive_some(65536):
                seen += data
                if self.cut == 0 and self.marker in seen:
                    self.cut += 1
                    cutting = True
                    await upstream.send_all(data)
                    await trio.sleep(self.hold_s)
                    break
                await upstream.send_all(data)
            nursery.cancel_scope.cancel()


def _cohort_lines(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("event") == "cohort":
            out.append(row)
    return out


async def test_openrlhf_per_sample_with_a_retry_and_a_legacy_batch(tmp_path: Path) -> None:
    agent = _load_agent(tmp_path)
    log = tmp_path / "serve.log"
    settings = ["num_rollouts_per_prompt=4", "log_format=json", "log_level=INFO",
                "cohort_collection_timeout_s=120"]
    async with serve_process(settings, log) as server, trio.open_nursery() as nursery:
        retried = f"Prompt 0?{_answer(0, 2)}".encode()
        proxy = ResetFirst(server.port, retried)
        await nursery.start(proxy.serve)
        url = f"http://127.0.0.1:{proxy.port}/get_reward"

        async def per_sample() -> list[Any]:
            ex = agent.SingleTurnAgentExecutor(remote_rm_url=url)

            async def one(p: int, i: int) -> Any:
                if (p, i) == (0, 3):  # the group's last sample comes after the retry
                    await asyncio.sleep(3.0)
                return await ex._fetch_rewards_via_http(
                    [f"Prompt {p}?" + _answer(p, i)], [f"Prompt {p}?"], [f"label {p}"])

            return list(await asyncio.gather(*(one(p, i) for p in range(2) for i in range(4))))

        results = await run_asyncio(per_sample(), 120)
        assert proxy.cut == 1  # one try was cut at transport level, then re-sent
        rewards = [r[0]["rewards"] for r in results]
        assert len(rewards) == 8 and all(len(r) == 1 for r in rewards)
        assert all(r[0]["extra_logs"]["genrm_masked"] == [0.0] for r in results)

        async def batch() -> list[Any]:
            ex = agent.SingleTurnAgentExecutor(remote_rm_url=url)
            prompts = [f"Batch {p}?" for p in range(2) for _ in range(4)]
            queries = [f"Batch {p}?" + _answer(p, i) for p in range(2) for i in range(4)]
            return list(await ex._fetch_rewards_via_http(queries, prompts, [None] * 8))

        batch_answers = await run_asyncio(batch(), 120)
        assert len(batch_answers) == 1 and len(batch_answers[0]["rewards"]) == 8
        nursery.cancel_scope.cancel()
    cohorts = _cohort_lines(log)
    assert len(cohorts) == 4, cohorts  # 2 per-sample cohorts, 2 of the batch
    assert all(c["kind"] == "completed" and c["members"] == 4 for c in cohorts), cohorts


async def test_openrlhf_64_samples_at_once_finish(tmp_path: Path) -> None:
    """Its pool bound: every sample of a rollout batch in flight at once (a session per try,
    aiohttp's connector cap of 100 per session), 64 members in 8 cohorts of 8 waiting together
    on a server with one event loop thread."""
    agent = _load_agent(tmp_path)
    log = tmp_path / "serve.log"
    settings = ["num_rollouts_per_prompt=8", "log_format=json", "log_level=INFO",
                "cohort_collection_timeout_s=120"]
    async with serve_process(settings, log) as server:
        url = f"{server.url}/get_reward"

        async def run() -> list[Any]:
            ex = agent.SingleTurnAgentExecutor(remote_rm_url=url)
            calls = [ex._fetch_rewards_via_http([f"P{p}?" + _answer(p, i)], [f"P{p}?"], [""])
                     for i in range(8) for p in range(8)]  # interleaved: no group first
            return list(await asyncio.gather(*calls))

        # Below the collection deadline: a deadlock fails here, not as masked rewards later.
        results = await run_asyncio(run(), 60)
    assert len(results) == 64
    assert all(r[0]["extra_logs"]["genrm_masked"] == [0.0] for r in results)
    cohorts = _cohort_lines(log)
    assert len(cohorts) == 8 and all(c["members"] == 8 for c in cohorts)
