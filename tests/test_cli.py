"""The command line: bad configuration stops `serve` with exit code 2 and one line naming the
key; the subcommands of contract section 8 exist."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_helpers import wait_for_line


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "genrm_trio.cli", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("setting", "key"), [
    ("cohort_collection_timeout_s=0", "cohort_collection_timeout_s"),
    ("judge_request_timeout_s=.nan", "judge_request_timeout_s"),
    ("cohort_evaluation_timeout_s=null", "cohort_evaluation_timeout_s"),
    ("no_such_key=1", "no_such_key"),
    ("judge.api=grpc", "judge.api"),
    ("min_cohort_members=1", "min_cohort_members"),
])
def test_invalid_configuration_exits_2_with_one_line(setting: str, key: str) -> None:
    result = run_cli("serve", "--port", "0", "--set", setting)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert key in lines[0]


def test_every_subcommand_is_there() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for name in ("serve", "collect", "aggregate", "mock-judge", "mock-policy", "demo", "bench",
                 "torture"):
        assert name in result.stdout
        assert run_cli(name, "--help").returncode == 0


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "genrm_trio.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})



@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_serve_drains_then_exits_130_on_ctrl_c_and_0_on_sigterm(
    signum: signal.Signals, code: int,
) -> None:
    proc = _start("serve", "--port", "0", "--set", "num_rollouts_per_prompt=2",
                  "--set", "log_format=json")
    try:
        assert proc.stdout is not None
        wait_for_line(proc.stdout, "listening on")
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "Traceback" not in err
    assert ("shutdown: all active cohorts failed" in err)  # the graceful path ran
    lines = err.strip().splitlines()
    if code == 130:
        assert lines[-1] == "genrm-trio: interrupted"
        assert lines.count("genrm-trio: interrupted") == 1
    else:
        assert "genrm-trio: interrupted" not in err
    for line in lines[:-1] if code == 130 else lines:  # everything else is JSON lines
        assert isinstance(json.loads(line), dict), line


def test_collect_exits_130_with_one_line_on_ctrl_c(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"responses_create_params": {"input": f"t{i}"}}) + "\n"
                             for i in range(4)))
    proc = _start("collect", "--input", str(tasks), "--output", str(tmp_path / "out.jsonl"),
                  "--server", "http://127.0.0.1:9", "--num-repeats", "2",
                  "--progress-interval-s", "0.2",
                  "--mock-policy-set", "latency_mean_s=60")
    try:
        assert proc.stderr is not None
        wait_for_line(proc.stderr, "collect: 0/8 rollouts")  # running, stuck in generation
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Aborted" not in err
    assert err.strip().splitlines()[-1] == "genrm-trio: interrupted"
    assert err.count("genrm-trio: interrupted") == 1


@pytest.mark.parametrize(("setting", "key"), [
    ("judge.api_key_env=GENRM_TEST_UNSET_JUDGE_KEY", "judge.api_key_env"),
    ("judge.plugin=no_such_module_here:judge", "judge.plugin"),
])
def test_start_time_configuration_errors_exit_2_with_one_line(setting: str, key: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GENRM_TEST_UNSET_JUDGE_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0", "--set", setting,
         "--set", 'judge.base_urls=["http://127.0.0.1:9"]'],
        capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], result.stderr
