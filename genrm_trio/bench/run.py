"""Running the presets: every case, A B A B, one record per run; then the outputs
(``results.json``, ``summary.md``, the plots)."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from genrm_trio.bench.cases import step
from genrm_trio.bench.cases.economy import EconomyParams, economy_cases
from genrm_trio.bench.cases.step import step_cases
from genrm_trio.bench.nemo_gym import default_nemo_venv, ensure_nemo_venv
from genrm_trio.bench.plots import plot
from genrm_trio.bench.presets import NOT_IN_ALL, PRESETS, soak_preset
from genrm_trio.bench.records import KINDS, BenchContext, CaseResult, RunRecord
from genrm_trio.bench.report import render_markdown, summarize


async def run_bench(
    presets: Sequence[str],
    *,
    out_dir: Path,
    kinds: Sequence[str] = KINDS,
    repeats: int = 2,
    nemo_venv: Path | None = None,
    echo: Callable[[str], None] = print,
    duration_s: float | None = None,
    step_params: step.StepParams | None = None,
    economy_params: EconomyParams | None = None,
    soak_overrides: Mapping[str, Any] | None = None,
) -> list[CaseResult]:
    """Run the presets' cases, alternating the servers A B A B ``repeats`` times per case, and
    write ``results.json``, ``summary.md`` and the plots into ``out_dir``.

    Blocks for as long as the runs take (minutes for ``all``). Every process started is ended
    before this returns, also on cancellation. A run that fails is recorded with its error and
    the bench goes on. Raises ``KeyError`` for an unknown preset name. ``step_params`` shapes
    the ``step`` preset (default :class:`~genrm_trio.bench.cases.step.StepParams`),
    ``economy_params`` the ``economy`` preset (default
    :class:`~genrm_trio.bench.cases.economy.EconomyParams`); ``soak_overrides`` are keyword
    arguments of :func:`~genrm_trio.bench.cases.soak.soak_case`.
    """
    names = ([p for p in PRESETS if p not in NOT_IN_ALL] if list(presets) == ["all"]
             else list(presets))
    cases = [
        case
        for name in names
        for case in (step_cases(step_params) if name == "step" and step_params
                     else economy_cases(economy_params) if name == "economy" and economy_params
                     else [soak_preset(**soak_overrides)] if name == "soak" and soak_overrides
                     else PRESETS[name]())
    ]
    if duration_s is not None:
        cases = [case.resize(duration_s) if case.resize else case for case in cases]
    await trio.to_thread.run_sync(functools.partial(out_dir.mkdir, parents=True, exist_ok=True))
    skip_nemo: str | None = None
    nemo_dir: Path | None = None
    if "nemo" in kinds and any("nemo" in case.kinds for case in cases):
        found = await trio.to_thread.run_sync(ensure_nemo_venv, nemo_venv or default_nemo_venv())
        if isinstance(found, Path):
            nemo_dir = found
        else:
            skip_nemo = found
            echo(found)
    ctx = BenchContext(out_dir, nemo_dir)
    results: list[CaseResult] = []
    for case in cases:
        result = CaseResult(case.preset, case.label, case.params, {k: [] for k in kinds})
        for rep in range(repeats):
            for kind in kinds:
                if kind not in case.kinds:
                    result.skipped[kind] = f"{kind} skipped: this case measures ours only"
                    continue
                if kind == "nemo" and skip_nemo:
                    result.skipped[kind] = skip_nemo
                    continue
                tag = f"{case.preset}-{case.label}-{rep}"
                started = time.perf_counter()
                try:
                    record = await case.run(ctx, kind, tag)
                except Exception as exc:  # one run's failure is a result; the bench goes on
                    why = _describe(exc)
                    record = RunRecord({}, notes={"error": why})
                    echo(f"  {tag} {kind}: FAILED {why}")
                else:
                    shown = ", ".join(f"{k}={v:.4g}" for k, v in list(record.metrics.items())[:5])
                    echo(f"  {tag} {kind} ({time.perf_counter() - started:.1f}s): {shown}")
                result.runs[kind].append(record)
        summarize(result)
        results.append(result)
        await trio.to_thread.run_sync(write_outputs, results, out_dir)
    return results


def gate_failures(results: Sequence[CaseResult]) -> list[str]:
    """One line per failed check (or error) of a gating case's runs; empty when all passed.

    A case gates when its params say ``gate: True`` (the soak): a run with ``failed_checks``
    in its notes, or one that raised, then makes ``genrm-trio bench`` exit 1."""
    out: list[str] = []
    for result in results:
        if not result.params.get("gate"):
            continue
        for kind, runs in result.runs.items():
            for run in runs:
                name = f"{result.preset}/{result.label} {kind}"
                if "error" in run.notes:
                    out.append(f"{name}: {run.notes['error']}")
                out.extend(f"{name}: {check}" for check in run.notes.get("failed_checks", []))
    return out


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:500]


def write_outputs(results: Sequence[CaseResult], out_dir: Path) -> list[Path]:
    """Write ``results.json``, ``summary.md`` and (when matplotlib is installed) the plots."""
    written = [out_dir / "results.json", out_dir / "summary.md"]
    written[0].write_bytes(msgspec.json.format(msgspec.json.encode(list(results)), indent=1))
    written[1].write_text(render_markdown(results), encoding="utf-8")
    try:
        written += plot(results, out_dir)
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
    return written
