"""The command line: bad configuration stops `serve` with exit code 2 and one line naming the
key; the subcommands of contract section 8 exist."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "genrm_trio.cli", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("setting", "key"), [
    ("cohort_collection_timeout_s=0", "cohort_collection_timeout_s"),
    ("judge_request_timeout_s=.nan", "judge_request_timeout_s"),
    ("cohort_evaluation_timeout_s=null", "cohort_evaluation_timeout_s"),
    ("no_such_key=1", "no_such_key"),
    ("judge.api=grpc", "judge.api"),
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
