"""`genrm-trio demo` is the README's first command: it must run end to end and say so."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_every_scenario_and_a_collection() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "genrm_trio.cli", "demo"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("reward ") >= 8  # 'complete' and 'judge flaky' rows
    assert out.count("HTTP 503 cohort_incomplete") == 3
    assert out.count("masked (judge_failed)") == 4
    assert "judge flaky: first 2 judge calls answer 503, retried; judge calls: 6" in out
    assert "collection: 8 tasks x 4 rollouts from the mock policy: 32 rewarded" in out
    assert "mean/reward" in out
