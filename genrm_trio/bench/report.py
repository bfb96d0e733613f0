"""From runs to the report: medians and per-pair ratios (:func:`summarize`), the goals table and
the markdown summary. Pure: no I/O."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

from genrm_trio.bench import loadgen
from genrm_trio.bench.cases import step
from genrm_trio.bench.presets import SHOWN
from genrm_trio.bench.records import CaseResult


def finite(x: float) -> bool:
    return isinstance(x, float | int) and math.isfinite(x)


def summarize(result: CaseResult) -> None:
    """Fill ``median``, ``pair_ratios`` (ours / nemo, pair by pair) and ``median_ratio``."""
    for kind, runs in result.runs.items():
        names = sorted({m for r in runs for m in r.metrics})
        result.median[kind] = {
            name: loadgen.median(
                [r.metrics[name] for r in runs if name in r.metrics and finite(r.metrics[name])]
            )
            for name in names
        }
    ours, nemo = result.runs.get("ours", []), result.runs.get("nemo", [])
    for name in sorted({m for r in ours for m in r.metrics}):
        ratios = []
        for a, b in zip(ours, nemo, strict=False):
            x, y = a.metrics.get(name, math.nan), b.metrics.get(name, math.nan)
            if finite(x) and finite(y) and y != 0:
                ratios.append(x / y)
        if ratios:
            result.pair_ratios[name] = ratios
            result.median_ratio[name] = loadgen.median(ratios)


def _fmt(x: float | None) -> str:
    if x is None or not finite(x):
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _goal_rows(results: Sequence[CaseResult]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) for the issue's bar, from the medians."""
    by = {(r.preset, r.label): r for r in results}
    rows: list[tuple[str, str, str]] = []

    def med(preset: str, label: str, kind: str, metric: str) -> float:
        r = by.get((preset, label))
        return r.median.get(kind, {}).get(metric, math.nan) if r else math.nan

    def ratio(preset: str, label: str, metric: str) -> float:
        r = by.get((preset, label))
        return r.median_ratio.get(metric, math.nan) if r else math.nan

    def shown(value: float) -> str:
        # Three decimals below 10: a ratio of 1.597 must not read as a 1.6 that was missed.
        return f"{value:.3f}" if abs(value) < 10 else _fmt(value)

    def add(goal: str, value: float, ok: Callable[[float], bool], unit: str) -> None:
        if finite(value):
            rows.append((goal, f"{shown(value)}{unit}", "met" if ok(value) else "MISSED"))

    so = ("scaleout", "n8-k32-2replicas-canned")
    for prefix, cpu in (("", ""), ("the same, CPU-bound on an idle machine (from CPU per verify): ",
                                   "_by_cpu")):
        add(f"{prefix}2 replicas behind HAProxy >= 1.6x one replica's verifies/s",
            med(*so, "ours", f"two_over_one{cpu}"), lambda v: v >= 1.6, "x")
        add(f"{prefix}one replica >= 80% of the bare Hypercorn app's verifies/s",
            med(*so, "ours", f"one_over_bare{cpu}"), lambda v: v >= 0.8, "x")
    add("the same, with the built-in judge: 2 replicas behind HAProxy >= 1.6x one replica's "
        "verifies/s", med("scaleout", "n8-k32-2replicas-builtin", "ours", "two_over_one"),
        lambda v: v >= 1.6, "x")
    pair = med(*so, "ours", "pair_over_one")
    if finite(pair):  # context for the 1.6x goal, not a goal of its own
        rows.append(("this machine's own limit: 2 replicas, each driven directly (no HAProxy), "
                     "over one replica's verifies/s", f"{shown(pair)}x",
                     "can show 1.6x" if pair >= 1.6 else "cannot show 1.6x"))
    t = ("throughput", "n16-k16-judge50ms")
    add(
        "verifies/s at N=16,K=16,judge 50 ms >= 2.0x NeMo",
        ratio(*t, "verifies_per_s"),
        lambda v: v >= 2.0,
        "x",
    )
    add(
        "CPU per cohort at N=16,K=16,judge 50 ms <= 0.5x NeMo",
        ratio(*t, "cpu_ms_per_cohort"),
        lambda v: v <= 0.5,
        "x",
    )
    add(
        "K=1 last arrival -> rewards p50 <= judge + 5 ms",
        med("latency", "k1-n16-judge50ms", "ours", "over_judge_p50_ms"),
        lambda v: v <= 5,
        " ms",
    )
    for trig in ("deadline", "sigterm", "disconnect"):
        add(
            f"release of 10,000 waiters ({trig}) p99 <= 10 ms",
            med("release", trig, "ours", "release_p99_ms"),
            lambda v: v <= 10,
            " ms",
        )
    rss = [
        med("release", t2, "ours", "rss_waiting_mb") for t2 in ("deadline", "sigterm", "disconnect")
    ]
    rss = [x for x in rss if finite(x)]
    if rss:
        add("RSS with 10,000 waiting members <= 250 MB", max(rss), lambda v: v <= 250, " MB")
    add(
        "judge client CPU per call at 1,024 in flight <= 0.5 ms",
        med("judge_client", "1024-in-flight-judge1000ms", "ours", "cpu_ms_per_judge_call"),
        lambda v: v <= 0.5,
        " ms",
    )
    add(
        "steady state (4,096 retained) within 10% of fresh throughput",
        med("steady_state", "n16-k16-retained4096", "ours", "steady_over_fresh_throughput"),
        lambda v: v >= 0.9,
        "x fresh",
    )
    add(
        "p99 at K=1,N=16,judge 50 ms <= judge + 20 ms",
        med("tail", "k1-n16-judge50ms", "ours", "over_judge_p99_ms"),
        lambda v: v <= 20,
        " ms",
    )
    return rows


def render_markdown(results: Sequence[CaseResult]) -> str:
    """The summary table: per case and metric, the median for each server and the median of
    the per-pair ratios (ours / NeMo Gym)."""
    lines = [
        "# genrm-trio vs NeMo Gym 0.7.0 genrm_compare",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} on {os.cpu_count()} CPUs. "
        "Medians over runs; ratio = median of per-pair ours/NeMo ratios (runs alternate "
        "A B A B).",
        "",
    ]
    current = None
    for r in results:
        if r.preset == "step":
            continue  # its own table below: schedules side by side, not servers
        if r.preset != current:
            current = r.preset
            lines += [
                "",
                f"## {r.preset}",
                "",
                "| case | metric | ours | NeMo Gym | ours/NeMo |",
                "| --- | --- | ---: | ---: | ---: |",
            ]
        metrics = SHOWN.get(r.preset) or tuple(sorted(r.median.get("ours", {})))
        for m in metrics:
            ours = r.median.get("ours", {}).get(m)
            nemo = r.median.get("nemo", {}).get(m)
            if ours is None and nemo is None:
                continue
            lines.append(
                f"| {r.label} | {m} | {_fmt(ours)} | {_fmt(nemo)} | {_fmt(r.median_ratio.get(m))} |"
            )
        for kind, why in r.skipped.items():
            lines.append(f"| {r.label} | ({kind} skipped) | {why} | | |")
        for kind, runs in r.runs.items():
            for i, run in enumerate(runs):
                if "error" in run.notes:
                    lines.append(
                        f"| {r.label} | ({kind} run {i} failed) | {run.notes['error'][:120]} | | |"
                    )
                elif run.notes.get("failures"):
                    lines.append(
                        f"| {r.label} | ({kind} run {i} failures) | {run.notes['failures']} | | |"
                    )
                elif "answers" in run.notes:
                    lines.append(
                        f"| {r.label} | ({kind} run {i} answers) | {run.notes['answers']} | | |"
                    )
    sweep = step.render_sweep(results)
    if sweep:
        lines += ["", "## step", "", sweep]
    goals = _goal_rows(results)
    if goals:
        lines += [
            "",
            "## Goals (ours)",
            "",
            "| goal | measured | verdict |",
            "| --- | ---: | --- |",
        ]
        lines += [f"| {g} | {v} | {ok} |" for g, v, ok in goals]
    return "\n".join(lines) + "\n"
