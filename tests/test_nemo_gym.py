"""Opt-in: NeMo Gym 0.7.0's own servers and collector against genrm-trio, both ways into NeMo Gym.

`gym env start` launches NeMo Gym's simple agent (with the environment server it generates for
it), an `openai_model` policy server in front of our mock policy, and the genrm-trio block; then
`gym eval run --no-serve` (NeMo Gym's collector) collects one task 8 times. Every rollout must
come back rewarded by genrm-trio (the one completed cohort of 8 in genrm-trio's log carries the
rewards of NeMo Gym's rows, slot by slot), with `observability_enabled` off and on:

* external: `genrm-trio serve` started by the test (mock judge), the block naming its host and
  port, `entrypoint: external.py` (NeMo Gym only lets an agent reference a block that has an
  entrypoint);
* launched: `entrypoint: app.py`, NeMo Gym builds the folder's venv itself (with uv, from
  resources_servers/genrm_trio/requirements.txt) and starts `genrm-trio serve
  --from-nemo-gym-env` on the port it picked; the judge is the block's `genrm_model_server`, a
  second `openai_model` server in front of our mock judge.

Not part of the default run (``addopts`` deselects the ``nemo_gym`` marker) nor of CI. Needs
nemo-gym 0.7.0 and uv in the venv `genrm_trio.bench.nemo_gym.default_nemo_venv()` names (the one
the benchmark uses; README, "Use it from NeMo Gym"), or instead of uv
``GENRM_NEMO_SERVER_VENV``, a Python 3.13 venv with genrm-trio installed (used as
genrm-trio's server venv instead of one built with uv); skipped, saying so, without them. Run::

    python3 -m pytest -m nemo_gym tests/test_nemo_gym.py

NeMo Gym's own servers run from that venv (linked in as their prebuilt venvs, with
``skip_venv_if_present``); only genrm-trio's folder gets a venv built by NeMo Gym, once per run
(a cold uv cache downloads Ray: minutes). Every process binds 127.0.0.1 on a free port, every
wait is bounded, and everything started is stopped by PID (NeMo Gym: SIGINT, its own shutdown;
what is left of its process group afterwards, such as Ray's daemons, is killed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from genrm_trio.bench.nemo_gym import default_nemo_venv, ensure_nemo_venv

pytestmark = pytest.mark.nemo_gym

REPO = Path(__file__).resolve().parent.parent
N = 8
READY_TIMEOUT_S = 900.0  # the first launch builds genrm-trio's venv (Ray and all)
COLLECT_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
# NeMo Gym's own servers the test launches, by folder: they run from the nemo-gym venv.
NEMO_SERVERS = ("responses_api_agents/simple_agent", "responses_api_models/openai_model",
                "environment_servers/legacy_agent")


@dataclass(frozen=True)
class NemoGym:
    """Where NeMo Gym is and how to run it."""

    gym: Path
    env: dict[str, str]
    server_venvs: Path
    uv_cache: Path


def _base_python_dir(venv: Path) -> str:
    """The ``home`` of the venv's ``pyvenv.cfg``: uv must find that Python 3.13 for the venv it
    builds (``gym env start`` asks for the version it runs on), not download one."""
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            return value.strip()
    pytest.skip(f"{venv}/pyvenv.cfg names no home interpreter")


@pytest.fixture(scope="module")
def nemo(tmp_path_factory: pytest.TempPathFactory) -> NemoGym:
    venv = default_nemo_venv()
    gym = venv / "bin" / "gym"
    if not gym.exists():
        pytest.skip(f"nemo-gym 0.7.0 is not installed in {venv} ($GENRM_NEMO_VENV): "
                    "see the README, 'Use it from NeMo Gym'")
    found = ensure_nemo_venv(venv)  # never installs here: the venv's python exists
    if isinstance(found, str):
        pytest.skip(found)
    # A prebuilt Python 3.13 venv with genrm-trio installed (pip install -e .) stands in for
    # the one gym env start would build for genrm-trio's folder with uv.
    genrm_venv = os.environ.get("GENRM_NEMO_SERVER_VENV")
    uv = venv / "bin" / "uv"
    if not genrm_venv and not uv.exists() and shutil.which("uv") is None:
        pytest.skip(f"uv is missing (gym env start builds server venvs with it): "
                    f"{venv}/bin/python -m pip install uv, or set GENRM_NEMO_SERVER_VENV")
    server_venvs = tmp_path_factory.mktemp("nemo-server-venvs")
    for folder in NEMO_SERVERS:
        (server_venvs / folder).mkdir(parents=True)
        (server_venvs / folder / ".venv").symlink_to(venv, target_is_directory=True)
    if genrm_venv:
        (server_venvs / "resources_servers/genrm_trio").mkdir(parents=True)
        (server_venvs / "resources_servers/genrm_trio/.venv").symlink_to(
            Path(genrm_venv), target_is_directory=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NEMO_GYM_", "GENRM_TRIO_", "UV_"))}
    env["PATH"] = os.pathsep.join([_base_python_dir(venv), str(venv / "bin"), env["PATH"]])
    env["UV_PYTHON_DOWNLOADS"] = "never"
    return NemoGym(gym=gym, env=env, server_venvs=server_venvs,
                   uv_cache=venv.parent / "uv-cache")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stop(proc: subprocess.Popen[bytes], signum: int = signal.SIGTERM) -> None:
    """Stop ``proc`` by its PID with ``signum``; SIGKILL if it is still there after 30 s."""
    try:
        if proc.poll() is None:
            proc.send_signal(signum)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass
class Started:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


def _start_ours(command: list[str], log: Path) -> Started:
    """Start a genrm-trio command that prints ``... listening on URL`` on stdout."""
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "genrm_trio.cli", *command],
                                stdout=subprocess.PIPE, stderr=err, cwd=REPO)
    assert proc.stdout is not None
    found: list[str] = []

    def reader() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            if "listening on http://" in line:
                found.append(line.split("listening on ", 1)[1].split()[0])
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(30)
    if not found:
        _stop(proc)
        pytest.fail(f"{command[0]} did not start: {log.read_text(errors='replace')[-2000:]}")
    return Started(proc, found[0], log)


@pytest.fixture(scope="module")
def mock_policy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started = _start_ours(["mock-policy", "--port", "0"],
                          tmp_path_factory.mktemp("policy") / "policy.log")
    try:
        yield started.url
    finally:
        _stop(started.proc)


@pytest.fixture(scope="module")
def mock_judge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started = _start_ours(["mock-judge", "--port", "0"],
                          tmp_path_factory.mktemp("judge") / "judge.log")
    try:
        yield started.url
    finally:
        _stop(started.proc)


def _openai_model(url: str, model: str) -> dict[str, Any]:
    return {"responses_api_models": {"openai_model": {
        "entrypoint": "app.py", "openai_base_url": f"{url}/v1", "openai_api_key": "unused",
        "openai_model": model}}}


def _gym_config(nemo: NemoGym, tmp: Path, policy_url: str, genrm_block: dict[str, Any],
                observability: bool, **blocks: Any) -> tuple[Path, int]:
    """The test's NeMo Gym config file and its head server's port."""
    head_port = _free_port()
    config = {
        "head_server": {"host": "127.0.0.1", "port": head_port},
        "observability_enabled": observability,
        # NeMo Gym's model servers require it with observability on.
        "model_call_capture_dir": str(tmp / "model-calls"),
        "skip_venv_if_present": True,
        "uv_venv_dir": str(nemo.server_venvs),
        "uv_cache_dir": str(nemo.uv_cache),
        "cache_dir": str(tmp / "cache"),
        "results_dir": str(tmp / "results"),
        "genrm_resources_server": {"resources_servers": {"genrm_trio": genrm_block}},
        "policy_model": _openai_model(policy_url, "mock-policy"),
        "genrm_simple_agent": {"responses_api_agents": {"simple_agent": {
            "entrypoint": "app.py",
            "resources_server": {"type": "resources_servers", "name": "genrm_resources_server"},
            "model_server": {"type": "responses_api_models", "name": "policy_model"}}}},
        "genrm_environment_server": {"environment_servers": {"legacy_agent": {
            "entrypoint": "app.py",
            "agent_server": {"type": "responses_api_agents", "name": "genrm_simple_agent"}}}},
        **blocks,
    }
    path = tmp / "gym.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, head_port


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class GymEnv:
    """`gym env start` in its own process group, ready once its head server's /readyz is 200."""

    def __init__(self, nemo: NemoGym, config: Path, head_port: int, tmp: Path) -> None:
        self.out, self.err = tmp / "gym-env.out", tmp / "gym-env.err"
        self.head = f"http://127.0.0.1:{head_port}"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [str(nemo.gym), "env", "start", "--config", str(config), "--search-dir",
                 str(REPO)], stdout=out, stderr=err, cwd=tmp, env=nemo.env,
                start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"gym env start exited {self.proc.returncode}: {_tail(self.err)}"
                            f"\n{_tail(self.out)}")
            if _get(f"{self.head}/readyz")[0] == 200:
                return
            time.sleep(0.5)  # a poll interval, bounded by the deadline
        pytest.fail(f"gym env start not ready within {READY_TIMEOUT_S} s: {_tail(self.out)}")

    def server_url(self, config_path: str) -> str:
        status, raw = _get(f"{self.head}/server_instances")
        assert status == 200, raw[:300]
        [url] = [i["url"] for i in json.loads(raw) if i["config_path"] == config_path]
        assert isinstance(url, str)
        return url

    def stop(self) -> None:
        """SIGINT, NeMo Gym's own stop (Ctrl-C): it stops its servers and its Ray cluster."""
        try:
            _stop(self.proc, signal.SIGINT)
        finally:
            try:  # whatever NeMo Gym left behind in the group it leads (Ray's daemons)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _collect(nemo: NemoGym, config: Path, tmp: Path) -> list[dict[str, Any]]:
    """NeMo Gym's collector against the running servers: one task, N repeats."""
    tasks = tmp / "tasks.jsonl"
    tasks.write_text(json.dumps({"responses_create_params": {"input": [
        {"role": "user", "content": "What is the capital of France? Explain briefly."}]}}) + "\n")
    out = tmp / "out.jsonl"
    done = subprocess.run(
        [str(nemo.gym), "eval", "run", "--no-serve", "--config", str(config), "--agent",
         "genrm_simple_agent", "--input", str(tasks), "--output", str(out), "--num-repeats",
         str(N)], capture_output=True, text=True, timeout=COLLECT_TIMEOUT_S, cwd=tmp,
        env=nemo.env)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    failures = tmp / "out_failures.jsonl"
    assert not failures.exists() or not failures.read_text().strip(), failures.read_text()[:2000]
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


_REWARDS = re.compile(r"rewards \[([^\]]*)\]")


def _check_rewarded(rows: list[dict[str, Any]], log: Path, observability: bool) -> None:
    """Every row rewarded, by the one completed cohort of N in genrm-trio's log."""
    assert len(rows) == N
    assert sorted(r["_ng_rollout_index"] for r in rows) == list(range(N))
    for row in rows:
        assert isinstance(row["reward"], float), row
        assert row["mask_sample"] is False and row["failure_kind"] is None, row
    cohorts = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event":"cohort"' in line:
            cohorts.append(json.loads(line))
    assert [(c["kind"], c["members"], c["size"]) for c in cohorts] == [("completed", N, N)], \
        cohorts
    [cohort] = cohorts
    match = _REWARDS.search(cohort["msg"])
    assert match is not None, cohort
    by_slot = [float(x) for x in match.group(1).split(",")]
    assert [r["reward"] for r in sorted(rows, key=lambda r: r["_ng_rollout_index"])] == by_slot
    # With observability on, NeMo Gym sends every call under /ng-rollout/<rollout_id>/.
    ids = cohort.get("rollout_ids")
    if observability:
        assert ids is not None and "-" not in ids.split(","), cohort
    else:
        assert ids is None, cohort


def _run(nemo: NemoGym, config: Path, head_port: int, tmp: Path) -> tuple[GymEnv, list[Any]]:
    gym = GymEnv(nemo, config, head_port, tmp)
    try:
        gym.wait_ready()
        return gym, _collect(nemo, config, tmp)
    except BaseException:
        gym.stop()
        raise


@pytest.mark.parametrize("observability", [False, True], ids=["observability_off",
                                                              "observability_on"])
def test_external_genrm_trio_serve(nemo: NemoGym, mock_policy: str, mock_judge: str,
                                   tmp_path: Path, observability: bool) -> None:
    ours = _start_ours(["serve", "--port", "0", "--judge-url", mock_judge, "--set",
                        f"num_rollouts_per_prompt={N}", "--set", "log_format=json"],
                       tmp_path / "serve.log")
    try:
        host, port = ours.url.removeprefix("http://").rsplit(":", 1)
        block = {"entrypoint": "external.py", "domain": "rlhf", "host": host, "port": int(port)}
        config, head_port = _gym_config(nemo, tmp_path, mock_policy, block, observability)
        gym, rows = _run(nemo, config, head_port, tmp_path)
        try:
            assert gym.server_url("genrm_resources_server") == ours.url
        finally:
            gym.stop()
        assert "serves nothing and waits to be stopped" in _tail(gym.err, 10**6)
        _check_rewarded(rows, ours.log, observability)
    finally:
        _stop(ours.proc)


@pytest.mark.parametrize("observability", [False, True], ids=["observability_off",
                                                              "observability_on"])
def test_launched_by_gym_env_start(nemo: NemoGym, mock_policy: str, mock_judge: str,
                                   tmp_path: Path, observability: bool) -> None:
    block = {"entrypoint": "app.py", "domain": "rlhf", "description": "genrm-trio",
             "num_rollouts_per_prompt": "${genrm_rollouts}", "log_format": "json",
             "cohort_collection_timeout_s": 300,
             "genrm_model_server": {"type": "responses_api_models", "name": "genrm_judge"}}
    config, head_port = _gym_config(nemo, tmp_path, mock_policy, block, observability,
                                    genrm_rollouts=N,
                                    genrm_judge=_openai_model(mock_judge, "genrm-mock"))
    gym, rows = _run(nemo, config, head_port, tmp_path)
    try:
        url = gym.server_url("genrm_resources_server")
        status, raw = _get(f"{url}/status")
        assert status == 200
        judge_url = gym.server_url("genrm_judge")
        assert json.loads(raw)["config"]["judge"]["base_urls"] == [judge_url]
    finally:
        gym.stop()
    log = gym.err.read_text(errors="replace")
    assert f"config from NeMo Gym block genrm_resources_server.resources_servers.genrm_trio " \
           f"at {url}; judge: NeMo Gym model server genrm_judge" in log
    _check_rewarded(rows, gym.err, observability)


ROLLING_TASKS = 12  # groups of N: NeMo Gym's collector keeps them in flight together


def _collect_many(nemo: NemoGym, config: Path, tmp: Path, tasks: int,
                  first: int = 0) -> tuple[list[Any], str]:
    """NeMo Gym's collector: ``tasks`` distinct tasks (questions ``first``...), N repeats
    each, run in ``tmp``; its rows and its failures file's text."""
    tmp.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"responses_create_params": {"input": [
        {"role": "user", "content": f"Question {i}: what is {i} + {i}? Explain briefly."}]}})
        for i in range(first, first + tasks)]
    (tmp / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp / "out.jsonl"
    done = subprocess.run(
        [str(nemo.gym), "eval", "run", "--no-serve", "--config", str(config), "--agent",
         "genrm_simple_agent", "--input", str(tmp / "tasks.jsonl"), "--output", str(out),
         "--num-repeats", str(N)], capture_output=True, text=True, timeout=COLLECT_TIMEOUT_S,
        cwd=tmp, env=nemo.env)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    failures = tmp / "out_failures.jsonl"
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return rows, failures.read_text() if failures.exists() else ""


async def test_external_through_haproxy_during_a_rolling_restart(
        nemo: NemoGym, mock_judge: str, tmp_path: Path) -> None:
    """NeMo Gym's own collector through HAProxy to two replicas, one of them drained,
    restarted on its state_dir and rejoined while the collection runs (README "Rolling
    restart"): every rollout rewarded, none masked, nothing in the failures file."""
    import trio

    from genrm_trio.bench.cases.rolling import start_replicas
    from genrm_trio.bench.haproxy import ensure_haproxy, open_haproxy

    try:
        ensure_haproxy()
    except Exception as exc:  # noqa: BLE001 - a missing program skips an opt-in test
        pytest.skip(f"haproxy: {exc}")
    policy = await trio.to_thread.run_sync(lambda: _start_ours(
        ["mock-policy", "--port", "0", "--set", "latency_distribution=uniform",
         "--set", "latency_mean_s=2.0", "--set", "latency_spread_s=2.0"],
        tmp_path / "policy.log"))
    sets = {"num_rollouts_per_prompt": str(N), "cohort_collection_timeout_s": "120",
            "cohort_evaluation_timeout_s": "60", "log_level": "INFO", "log_format": "json"}
    try:
        async with start_replicas(sets, judge_url=mock_judge, work=tmp_path / "state",
                                  log_dir=tmp_path, rejoin_s=8.0) as replicas, open_haproxy(
                [r.address for r in replicas], max_request_bytes=1 << 20,
                log_path=tmp_path / "haproxy.log",
                probe_ports=[r.probe_port for r in replicas]) as proxy:
            host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
            block = {"entrypoint": "external.py", "domain": "rlhf", "host": host,
                     "port": int(port)}
            config, head_port = _gym_config(nemo, tmp_path, policy.url, block, False)
            gym = GymEnv(nemo, config, head_port, tmp_path)
            try:
                await trio.to_thread.run_sync(gym.wait_ready)
                got: list[tuple[list[Any], str]] = []
                restart: dict[str, Any] = {}

                async def collect() -> None:
                    got.append(await trio.to_thread.run_sync(
                        _collect_many, nemo, config, tmp_path / "during", ROLLING_TASKS))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(collect)
                    r1 = replicas[0]
                    with trio.fail_after(COLLECT_TIMEOUT_S):
                        while (await r1.get_json("/status"))["cohorts"]["active_cohorts"] == 0:  # noqa: ASYNC110
                            await trio.sleep(0.05)
                    started = time.monotonic()
                    restart["open_at_drain"] = (await r1.get_json("/status"))["cohorts"][
                        "active_cohorts"]
                    restart["exit_code"] = await r1.drain_and_wait(180.0)
                    restart["drain_exit_s"] = round(time.monotonic() - started, 3)
                    restart["drain_s"] = r1.drain_seconds()
                    await r1.stop()
                    await r1.start()
                    await proxy.wait_until("r1", lambda s: s.up)
                    restart["restart_ready_s"] = round(time.monotonic() - started, 3)
                    await r1.wait_rejoined(60.0)
                    status = (await r1.get_json("/status"))["drain"]
                    restart["refused_while_rejoining"] = status["refused"]
                    restart["groups_elsewhere"] = status["groups_elsewhere"]
                # Once it has rejoined, the restarted replica takes its share again.
                got.append(await trio.to_thread.run_sync(
                    _collect_many, nemo, config, tmp_path / "after", ROLLING_TASKS,
                    ROLLING_TASKS))
                restart["r1_judged_after"] = (await r1.get_json("/status"))["verdict_reuse"][
                    "judged_comparisons"]
            finally:
                await trio.to_thread.run_sync(gym.stop)
    finally:
        _stop(policy.proc)
    print(f"NeMo Gym through HAProxy during a restart: rows {[len(r) for r, _ in got]}, "
          f"restart {restart}")
    assert restart["exit_code"] == 0 and restart["open_at_drain"] > 0, restart
    for rows, failures in got:
        assert not failures.strip(), failures[:2000]
        assert len(rows) == ROLLING_TASKS * N
        for row in rows:
            assert isinstance(row["reward"], float), row
            assert row["mask_sample"] is False and row["failure_kind"] is None, row
    assert restart["r1_judged_after"] > 0, restart  # it took groups again
