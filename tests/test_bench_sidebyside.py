"""The side-by-side regression guard (``genrm-trio bench --baseline COMMIT``,
genrm_trio/bench/sidebyside.py): its table and ratios, its inputs, and one short real run of
this checkout against HEAD unpacked by ``git archive`` (real processes on loopback port 0, a
few seconds; it checks the harness, not the server's speed).
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from genrm_trio.bench import sidebyside
from genrm_trio.bench.cli import bench_cli
from genrm_trio.bench.sidebyside import Arm, ArmResult, SideBySide

REPO = Path(__file__).resolve().parents[1]


def _row(verifies: float, p99: float) -> dict[str, float]:
    return {"verifies_per_s": verifies, "cpu_ms_per_cohort": 2.0, "p50_ms": p99 / 2,
            "p99_ms": p99, "failed_members": 0.0}


def _cells(table: str, label: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_table_gives_each_arm_its_medians_and_its_ratio_to_the_first_arm() -> None:
    ref = ArmResult(Arm("ref"), [_row(100, 10), _row(300, 30), _row(200, 20)])
    # a round that measured nothing (NaN) is left out of the median, not counted as zero
    other = ArmResult(Arm("other"), [_row(100, 40), _row(200, 40), _row(math.nan, math.nan)])
    table = sidebyside.render([ref, other], SideBySide(rounds=3))
    assert _cells(table, "ref")[1:3] == ["200", "1.000"]
    assert _cells(table, "ref")[5:7] == ["20.0", "1.000"]
    label, verifies, ratio, _cpu, _p50, p99, p99_ratio, failed = _cells(table, "other")
    assert (verifies, ratio, p99, p99_ratio, failed) == ("150", "0.750", "40.0", "2.000", "0")
    doc = msgspec.json.decode(sidebyside.to_json([ref, other], SideBySide(rounds=3)))
    assert [a["median"]["verifies_per_s"] for a in doc["arms"]] == [200.0, 150.0]


@pytest.mark.parametrize("items", [["n=1"], ["k=x"], ["rounds=0"], ["colour=red"], ["n"],
                                   ["steps=yes"]])
def test_bad_side_items_raise_naming_the_item(items: list[str]) -> None:
    with pytest.raises(ValueError, match="n|k|rounds|colour|steps"):
        sidebyside.parse_side(items)


def test_arms_parse_their_label_and_sets_and_a_baseline_runs_from_its_own_code(
    tmp_path: Path,
) -> None:
    arm = sidebyside.parse_arm("ll:judge.routing=least_loaded,judge.engine=vllm")
    assert arm == Arm("ll", None, (("judge.routing", "least_loaded"), ("judge.engine", "vllm")))
    with pytest.raises(ValueError):
        sidebyside.parse_arm(":x=1")
    code = tmp_path / "code"
    assert sidebyside.arm_env(Arm("b", code))["PYTHONPATH"] == str(code)
    assert "--set" in sidebyside.serve_command(arm, "http://127.0.0.1:1", 4)


def test_an_unknown_baseline_commit_is_a_usage_error() -> None:
    result = CliRunner().invoke(bench_cli, ["--baseline", "no-such-commit-anywhere"])
    assert result.exit_code == 2
    assert "unknown commit" in result.output


def _head() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


async def test_a_short_run_against_head_measures_both_arms_and_prints_their_ratio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = sidebyside.export_commit(REPO, "HEAD", tmp_path)
    head = _head()
    assert code.name == f"genrm-baseline-{head[:12]}"
    assert (code / "genrm_trio" / "bench" / "sidebyside.py").is_file()
    assert sidebyside.export_commit(REPO, "HEAD", tmp_path) == code  # unpacked once
    # The unpacked copy (only it) says where it was imported from: the baseline arm's server
    # must run that code, not this checkout's.
    mark = tmp_path / "imported-from"
    monkeypatch.setenv("SBS_TEST_MARK", str(mark))
    with (code / "genrm_trio" / "__init__.py").open("a") as init:
        init.write("\nimport os as _os\nif 'SBS_TEST_MARK' in _os.environ:\n"
                   "    open(_os.environ['SBS_TEST_MARK'], 'w').write(__file__)\n")
    cfg = SideBySide(n=2, k=2, judge_ms=0.0, duration_s=0.5, rounds=2, steps=True)
    arms = [Arm("current"), Arm("head", code, (("judge.routing", "least_loaded"),))]
    lines: list[str] = []
    results = await sidebyside.run_side_by_side(arms, cfg, tmp_path / "logs", echo=lines.append)
    for res in results:
        assert len(res.rounds) == cfg.rounds
        assert all(r["verifies_per_s"] > 0 and r["failed_members"] == 0 for r in res.rounds)
        # Both servers counted their trio task steps (the earlier commit's through the
        # sitecustomize copy): a verify takes a few, never none.
        assert all(1 < r["steps_per_verify"] < 100 for r in res.rounds), res.rounds
    assert len(lines) == cfg.rounds * len(arms)
    table = sidebyside.render(results, cfg)
    assert _cells(table, "current")[2] == "1.000"
    ratio = float(_cells(table, "head")[2])
    expected = results[1].median("verifies_per_s") / results[0].median("verifies_per_s")
    assert ratio == pytest.approx(expected, abs=1e-3)
    steps = results[1].median("steps_per_verify") / results[0].median("steps_per_verify")
    assert float(_cells(table, "head")[-1]) == pytest.approx(steps, abs=1e-3)
    assert mark.read_text() == str(code / "genrm_trio" / "__init__.py")
