"""Smoke run of the benchmark harness: the tiny ``smoke`` preset against our server only.

Real processes (mock judge, ``genrm-trio serve``) on loopback port 0, a few seconds. It checks
the harness, not the server's speed: every member is rewarded, the numbers are sane, and the
JSON and markdown outputs are written.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from genrm_trio.tools import bench
from genrm_trio.tools.loadgen import BodyFactory, percentile


async def test_smoke_preset_runs_against_our_server(tmp_path: Path) -> None:
    results = await bench.run_bench(
        ["smoke"], out_dir=tmp_path, kinds=("ours",), repeats=1, echo=lambda _: None
    )

    assert [(r.preset, r.label) for r in results] == [("smoke", "n4-k2-judge0ms")]
    (run,) = results[0].runs["ours"]
    assert "error" not in run.notes, run.notes
    metrics = run.metrics
    assert metrics["cohorts"] == 6.0
    assert metrics["failed_members"] == 0.0
    assert metrics["verifies_per_s"] > 0
    assert metrics["cpu_ms_per_cohort"] > 0
    assert metrics["peak_rss_mb"] > 1
    assert len(run.samples["latency_ms"]) == 6
    assert 0 < metrics["latency_p50_ms"] <= metrics["latency_max_ms"]
    assert results[0].median["ours"]["verifies_per_s"] == metrics["verifies_per_s"]

    saved = msgspec.json.decode((tmp_path / "results.json").read_bytes())
    assert saved[0]["runs"]["ours"][0]["metrics"]["cohorts"] == 6.0
    summary = (tmp_path / "summary.md").read_text()
    assert "| n4-k2-judge0ms | verifies_per_s |" in summary


def test_bodies_are_realistic_and_keyed_by_mode() -> None:
    explicit = msgspec.json.decode(BodyFactory(seed=1, run_tag="t").member(3, 2))
    assert explicit["_ng_group_id"] == "t-g3"
    assert explicit["_ng_group_attempt"] == 0
    assert explicit["_ng_rollout_index"] == 2
    prompt = explicit["responses_create_params"]["input"][0]["content"]
    assert 450 <= len(prompt) <= 560
    text = explicit["response"]["output"][-1]["content"][0]["text"]
    assert 1024 <= len(text) <= 2100

    legacy = msgspec.json.decode(BodyFactory(seed=1, id_mode="legacy", reasoning=True).member(3, 2))
    assert "_ng_group_id" not in legacy
    assert legacy["_ng_task_index"] == 3
    assert legacy["response"]["output"][0]["type"] == "reasoning"


def test_summary_ratios_are_per_pair_medians() -> None:
    def rec(v: float) -> bench.RunRecord:
        return bench.RunRecord({"verifies_per_s": v})

    result = bench.CaseResult(
        "throughput", "x", {}, {"ours": [rec(10), rec(30)], "nemo": [rec(5), rec(10)]}
    )
    bench.summarize(result)
    assert result.median["ours"]["verifies_per_s"] == 20
    assert result.pair_ratios["verifies_per_s"] == [2.0, 3.0]
    assert result.median_ratio["verifies_per_s"] == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
