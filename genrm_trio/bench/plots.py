"""The PNG plots of a bench run (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from genrm_trio.bench.records import CaseResult, RunRecord
from genrm_trio.bench.report import finite


def plot(results: Sequence[CaseResult], out_dir: Path) -> list[Path]:
    """PNG plots: latency CDFs, throughput vs K, release-time CDFs. Raises ``ImportError``
    without matplotlib (the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    colors = {"ours": "tab:blue", "nemo": "tab:orange"}

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def cdf_figure(cases: list[CaseResult], sample: str, title: Callable[[CaseResult], str],
                   xlabel: str, ylabel: str, name: str) -> None:
        """One panel per case: the CDF of ``sample`` for each server, log x axis."""
        if not cases:
            return
        fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
        for ax, r in zip(axes[0], cases, strict=True):
            for kind, runs in r.runs.items():
                xs = sorted(max(v, 0.01) for run in runs for v in run.samples.get(sample, []))
                if xs:
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    ax.step(xs, ys, where="post", label=kind, color=colors[kind])
            ax.set_title(title(r), fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        save(fig, name)

    cdf_figure(
        [
            r
            for r in results
            if r.preset in ("latency", "tail", "staggered", "smoke")
            or (r.preset == "throughput" and r.label.startswith("n16-k16"))
        ],
        "latency_ms", lambda r: f"{r.preset} {r.label}",
        "last send -> last reward (ms)", "fraction of cohorts", "latency_cdf.png",
    )

    tp = [r for r in results if r.preset == "throughput"]
    if tp:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, judge in zip(axes, ("judge0ms", "judge50ms"), strict=True):
            for kind in ("ours", "nemo"):
                for n, style in (("n8", "--"), ("n16", "-")):
                    pts = sorted(
                        (int(r.params["k"]), r.median.get(kind, {}).get("verifies_per_s", math.nan))
                        for r in tp
                        if r.label.startswith(n + "-") and r.label.endswith(judge)
                    )
                    pts = [(k, v) for k, v in pts if finite(v)]
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            style,
                            marker="o",
                            color=colors[kind],
                            label=f"{kind} {n.upper()}",
                        )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("cohorts in flight (K)")
            ax.set_ylabel("verifies / s (median)")
            ax.set_title(f"throughput, {judge.replace('judge', 'judge ')}")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        save(fig, "throughput_vs_k.png")

    cdf_figure(
        [r for r in results if r.preset == "release"],
        "release_ms", lambda r: f"release of 10,000 waiters: {r.label}",
        "trigger -> released (ms)", "fraction of waiters", "release_cdf.png",
    )

    step_results = [r for r in results if r.preset == "step" and r.runs.get("ours")]
    if step_results:
        keys: list[str] = list(step_results[0].params["runs"])
        palette = ["tab:orange", "tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        caps = [int(r.params["capacity"]) for r in step_results]
        for key, color in zip(keys, palette, strict=False):
            ys = [r.median.get("ours", {}).get(f"{key}:makespan_s", math.nan)
                  for r in step_results]
            ax.plot(caps, ys, marker="o", color=color, label=f"{key} makespan")
        bound = [r.median.get("ours", {}).get(f"{keys[0]}:lower_bound_s", math.nan)
                 for r in step_results]
        last = [r.median.get("ours", {}).get(f"{keys[0]}:last_arrival_s", math.nan)
                for r in step_results]
        ax.plot(caps, bound, "k--", label="lower bound")
        ax.plot(caps, [1.1 * x for x in last], "k:", label="last arrival + 10%")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("judge capacity (calls at once)")
        ax.set_ylabel("step makespan (s)")
        ax.set_title(f"step {step_results[0].params['label']}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "step_makespan.png")

        fig, axes = plt.subplots(len(step_results), 1, figsize=(7, 2.2 * len(step_results)),
                                 squeeze=False)
        for ax, r in zip(axes[:, 0], step_results, strict=True):
            cap = int(r.params["capacity"])
            first = r.runs["ours"][0].samples
            for key, color in zip(keys, palette, strict=False):
                ts = first.get(f"{key}:t", [])
                ys = [v / cap for v in first.get(f"{key}:in_flight", [])]
                ax.plot(ts, ys, color=color, lw=0.8, label=key)
            ax.set_ylim(0, 1.05)
            ax.set_ylabel(f"busy / {cap}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        axes[-1, 0].set_xlabel("seconds since the first request")
        fig.suptitle("judge utilisation over the step", fontsize=9)
        save(fig, "step_utilisation.png")

    soak_runs = [(r, run) for r in results if r.preset == "soak"
                 for run in r.runs.get("ours", []) if run.samples.get("t_s")]
    if soak_runs:
        fig, axes = plt.subplots(len(soak_runs), 1, figsize=(8, 3.6 * len(soak_runs)),
                                 squeeze=False)
        for ax, (r, run) in zip(axes[:, 0], soak_runs, strict=True):
            _plot_soak_rss(ax, r, run)
        axes[-1, 0].set_xlabel("minutes since the load started")
        save(fig, "soak_rss.png")

    economy = [r for r in results if r.preset == "economy" and r.median.get("ours")]
    if economy:
        _plot_economy(plt, economy, save)

    timelines = [run.notes["timeline"] for r in results if r.preset == "tracing"
                 for run in r.runs.get("ours", []) if run.notes.get("timeline")]
    if timelines:
        fig, ax = plt.subplots(figsize=(10, 4.2))
        trace_timeline(ax, timelines[-1])
        save(fig, "tracing_timeline.png")
    return written


_SPAN_COLORS = MappingProxyType(
    {"request": "tab:blue", "cohort": "tab:green", "judge": "tab:orange"})


def trace_timeline(ax: Any, spans: Sequence[dict[str, Any]]) -> None:
    """One cohort's exported spans on a time axis (ms from its first span): the member
    requests (SERVER), the ``genrm.cohort`` span with its events, and each judge comparison
    (CLIENT) with its attempts (failed ones hatched) and backoffs. ``spans`` as
    :func:`genrm_trio.bench.cases.tracing.decode_spans` gives them."""
    if not spans:
        return
    t0 = min(s["start_ns"] for s in spans)

    def ms(ns: int) -> float:
        return float(ns - t0) / 1e6

    def kind(s: dict[str, Any]) -> str:
        if s["name"] == "genrm.cohort":
            return "cohort"
        return "request" if s["name"].startswith(("POST ", "GET ")) else "judge"

    order = {"request": 0, "cohort": 1, "judge": 2}
    rows = sorted(spans, key=lambda s: (order[kind(s)], s["attributes"].get(
        "genrm.rollout_index", 0), s["start_ns"]))
    labels = []
    for y, s in enumerate(rows):
        k = kind(s)
        ax.barh(y, ms(s["end_ns"]) - ms(s["start_ns"]), left=ms(s["start_ns"]), height=0.6,
                color=_SPAN_COLORS[k], alpha=0.35 if k == "judge" else 0.8)
        attrs = s["attributes"]
        if k == "request":
            labels.append(f"{s['name']} slot {attrs.get('genrm.rollout_index', '?')}")
        elif k == "cohort":
            labels.append(f"genrm.cohort ({attrs.get('genrm.outcome', '?')})")
            for e in s["events"]:
                x = ms(e["time_ns"])
                ax.plot([x, x], [y - 0.4, y + 0.4], color="black", lw=1)
                ax.annotate(e["name"].removeprefix("genrm.cohort."), (x, y + 0.35),
                            fontsize=6, rotation=30)
        else:
            labels.append(f"judge #{y - len(rows) + sum(1 for r in rows if kind(r) == 'judge')}"
                          f" ({attrs.get('genrm.judge.attempts', '?')} attempts)")
            events = s["events"]
            if not events and "genrm.attempt.duration_s" in attrs:
                # One attempt: no events, the span itself is the attempt (it ends with it).
                events = [{"name": "genrm.judge.attempt", "time_ns": s["end_ns"], "attributes": {
                    "genrm.attempt.duration_s": attrs["genrm.attempt.duration_s"],
                    "genrm.attempt.outcome": "answer" if "error.type" not in attrs else "failed",
                    "error.type": attrs.get("error.type")}}]
            for e in events:
                a = e["attributes"]
                end = ms(e["time_ns"])
                if e["name"] == "genrm.judge.attempt":
                    start = end - 1000.0 * float(a.get("genrm.attempt.duration_s") or 0.0)
                    failed = a.get("genrm.attempt.outcome") != "answer"
                    ax.barh(y, end - start, left=start, height=0.6, color="tab:orange",
                            hatch="//" if failed else None, edgecolor="black", lw=0.5)
                    if failed:
                        ax.annotate(str(a.get("error.type")), (start, y - 0.45), fontsize=6)
                elif e["name"] == "genrm.judge.backoff":
                    span_ms = 1000.0 * float(a.get("genrm.backoff_s") or 0.0)
                    ax.plot([end, end + span_ms], [y, y], color="grey", lw=2, ls=":")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the cohort's first request arrived")
    ax.set_title("one cohort's trace: member requests (blue), genrm.cohort (green), judge "
                 "comparisons (orange; hatched: failed attempt, dotted: backoff)", fontsize=8)
    ax.grid(alpha=0.3, axis="x")


def _plot_soak_rss(ax: Any, result: CaseResult, run: RunRecord) -> None:
    """One soak run: RSS, malloc's heap and what is in use in it, pymalloc's share (RSS
    outside malloc's heap and mapped blocks), and the least-squares line of the last half."""
    mb = 2**20
    minutes = [t / 60 for t in run.samples["t_s"]]
    ax.plot(minutes, run.samples["rss_mb"], color="tab:blue", lw=1.2, label="RSS")
    heap = run.samples.get("memory.allocator.heap_bytes")
    used = run.samples.get("memory.allocator.in_use_bytes")
    mapped = run.samples.get("memory.allocator.mmapped_bytes")
    if heap and used and len(heap) == len(minutes):
        ax.plot(minutes, [h / mb for h in heap], color="tab:orange", lw=0.8,
                label="malloc heap")
        ax.plot(minutes, [u / mb for u in used], color="tab:green", lw=0.8,
                label="malloc in use")
    if heap and mapped and len(heap) == len(minutes):
        rest = [rss - (h + m) / mb
                for rss, h, m in zip(run.samples["rss_mb"], heap, mapped, strict=True)]
        ax.plot(minutes, rest, color="tab:purple", lw=0.8,
                label="RSS minus malloc's heap and blocks (pymalloc, code; less once trimmed)")
    m = run.metrics
    slope = m.get("rss_last_half_slope_mb_per_min", math.nan)
    start_s = m.get("rss_last_half_start_s", math.nan)
    end_s = m.get("rss_last_half_end_s", math.nan)
    at_start = m.get("rss_last_half_fit_start_mb", math.nan)
    if all(finite(x) for x in (slope, start_s, end_s, at_start)):
        xs = [start_s / 60, end_s / 60]
        ys = [at_start, at_start + slope * (end_s - start_s) / 60]
        ax.plot(xs, ys, "k--", lw=1.2, label=f"last-half fit: {slope:+.3f} MB/min")
    limit = result.params.get("rss_slope_limit_mb_per_min")
    gate = f", gate < {limit:g} MB/min" if limit is not None else ""
    ax.set_title(f"soak {result.label}: "
                 f"{m.get('offered_verifies_per_s', math.nan):.0f} verifies/s offered "
                 f"(half of {m.get('capacity_verifies_per_s', math.nan):.0f}){gate}",
                 fontsize=9)
    ax.set_ylabel("MB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


_ROUTING_COLORS = MappingProxyType({"least_loaded": "tab:orange", "cohort_affinity": "tab:blue"})


def _plot_economy(plt: Any, cases: Sequence[CaseResult], save: Callable[[Any, str], None]) -> None:
    """``economy.png``: per strategy, computed prompt tokens (and the analytic minimum), judge
    makespan and group latency p99 against cohorts in flight, per routing; and the judge calls
    of the replacement attempts against the comparisons touching a changed answer."""
    strategies = sorted({str(r.params["strategy"]) for r in cases})
    fig, axes = plt.subplots(len(strategies), 4, figsize=(17, 3.6 * len(strategies)),
                             squeeze=False)
    for row, strategy in zip(axes, strategies, strict=True):
        mine = sorted((r for r in cases if r.params["strategy"] == strategy),
                      key=lambda r: int(r.params["k"]))
        ks = [int(r.params["k"]) for r in mine]

        def series(name: str, rs: list[CaseResult] = mine) -> list[float]:
            return [r.median["ours"].get(name, math.nan) for r in rs]

        for ax, metric, ylabel in ((row[0], "computed_tokens", "computed prompt tokens"),
                                   (row[1], "makespan_s", "judge makespan (s)"),
                                   (row[2], "group_p99_s", "group latency p99 (s)")):
            for routing, color in _ROUTING_COLORS.items():
                ax.plot(ks, series(f"{routing}:{metric}"), marker="o", color=color,
                        label=routing)
            if metric == "computed_tokens":
                ax.plot(ks, series("cohort_affinity:minimum_tokens"), "k--",
                        label="analytic minimum")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("cohorts in flight (K)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{strategy}: {ylabel}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        widest = mine[-1]
        changed = [0, 1, 2]
        ax = row[3]
        for offset, (name, color, label) in enumerate((
                ("judge_calls", "tab:blue", "judge calls"),
                ("touching_calls", "tab:gray", "comparisons touching a change"))):
            ax.bar([c + 0.38 * offset for c in changed],
                   [widest.median["ours"].get(f"cohort_affinity:replace{c}:{name}", math.nan)
                    for c in changed], width=0.36, color=color, label=label)
        ax.axhline(widest.median["ours"].get("cohort_affinity:judge_calls", math.nan),
                   color="k", ls=":", label="a fresh step's calls")
        ax.set_xticks([c + 0.19 for c in changed], [str(c) for c in changed])
        ax.set_xlabel("answers of 8 changed in the replacement attempt")
        ax.set_ylabel("judge calls")
        ax.set_title(f"{strategy}, K={widest.params['k']}: replacement attempts", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    save(fig, "economy.png")
