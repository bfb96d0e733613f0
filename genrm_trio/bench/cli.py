"""``genrm-trio bench``: the command line over :func:`genrm_trio.bench.run.run_bench`."""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import click
import trio

from genrm_trio.bench import sidebyside
from genrm_trio.bench.cases import step
from genrm_trio.bench.cases.economy import parse_economy_overrides
from genrm_trio.bench.cases.soak import parse_soak_overrides
from genrm_trio.bench.nemo_gym import NEMO_VERSION, ensure_nemo_venv
from genrm_trio.bench.presets import PRESETS
from genrm_trio.bench.records import KINDS
from genrm_trio.bench.report import render_markdown
from genrm_trio.bench.run import gate_failures, run_bench


def _default_out_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "bench"
    return (here if here.is_dir() else Path.cwd() / "bench") / "results"


@click.command("bench")
@click.option(
    "--preset",
    "presets",
    multiple=True,
    default=("all",),
    show_default=True,
    help="Preset to run (repeatable): all, " + ", ".join(PRESETS) + ".",
)
@click.option(
    "--repeats",
    type=int,
    default=2,
    show_default=True,
    help="A B pairs per case (runs alternate ours, NeMo Gym, ours, ...).",
)
@click.option(
    "--servers",
    type=click.Choice(["both", "ours", "nemo"]),
    default="both",
    show_default=True,
    help="Which servers to measure.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Results folder (default bench/results).",
)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=1.0),
    default=None,
    help="Length of the cases that take one (the soak: default 600 s).",
)
@click.option(
    "--step",
    "step_overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Shape the step preset (repeatable): n, k, strategy, median_gen_s, sigma, judge_ms, "
    "capacities (comma list), orders (comma list), seed, collection_timeout_s.",
)
@click.option(
    "--economy",
    "economy_overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Shape the economy preset (repeatable): cache (off, small, large or a token count per "
    "mock judge), endpoints, cohorts (comma list), strategies (comma list), n, capacity, "
    "replaced (comma list), prompt_token_s, output_token_s, latency_ms, spill_factor, engine "
    "(the mock's per_call or batched), step_tokens, judge_engine (the server's judge.engine), "
    "cache_report (the mock's: usage, timings, both, none).",
)
@click.option(
    "--soak",
    "soak_items",
    multiple=True,
    metavar="KEY=VALUE",
    help="Shape the soak preset (repeatable): load_fraction, tracemalloc_frames, trace_s, "
    "env=NAME=VALUE (for the server), sample_s, fault_rate, ... (bench/README.md).",
)
@click.option(
    "--nemo-venv",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="NeMo Gym venv (default $GENRM_NEMO_VENV or ~/.cache/genrm-trio/...).",
)
@click.option(
    "--baseline",
    default=None,
    metavar="COMMIT",
    help="Side by side instead of presets: this checkout and COMMIT (git archive under /tmp) "
    "in alternating rounds, with the ratio (bench/README.md, the regression guard).",
)
@click.option(
    "--arm",
    "arm_specs",
    multiple=True,
    metavar="LABEL[:KEY=VALUE,...]",
    help="Side by side: an arm of this checkout with these --set values (repeatable; the "
    "first is the reference). Default: one arm 'current'.",
)
@click.option(
    "--baseline-set",
    "baseline_sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Side by side: a --set value for the --baseline server only (repeatable).",
)
@click.option(
    "--side",
    "side_items",
    multiple=True,
    metavar="KEY=VALUE",
    help="Side by side: the load (n, k, judge_ms, duration_s, rounds), mock=KEY=VALUE for the "
    "mock judge, py_spy=DIR to sample each server with py-spy, nemo=VENV for a NeMo Gym arm.",
)
def bench_cli(
    presets: tuple[str, ...],
    repeats: int,
    servers: str,
    out_dir: Path | None,
    duration_s: float | None,
    step_overrides: tuple[str, ...],
    economy_overrides: tuple[str, ...],
    soak_items: tuple[str, ...],
    nemo_venv: Path | None,
    baseline: str | None,
    arm_specs: tuple[str, ...],
    baseline_sets: tuple[str, ...],
    side_items: tuple[str, ...],
) -> None:
    """Benchmark genrm-trio side by side with NeMo Gym's genrm_compare on this machine.

    Writes results.json, summary.md and PNG plots into the results folder and prints the table.
    Unknown preset: exit 2. A gating case (the soak) that failed a check or could not run: exit
    1 after the table.
    """
    if baseline is not None or arm_specs:
        _side_by_side(baseline, arm_specs, baseline_sets, side_items, out_dir)
        return
    for p in presets:
        if p != "all" and p not in PRESETS:
            raise click.BadParameter(f"unknown preset {p!r}", param_hint="--preset")
    try:
        step_params = step.parse_overrides(step_overrides) if step_overrides else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--step") from None
    try:
        economy_params = (parse_economy_overrides(economy_overrides) if economy_overrides
                          else None)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--economy") from None
    try:
        soak_overrides = parse_soak_overrides(soak_items) if soak_items else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--soak") from None
    kinds = KINDS if servers == "both" else (servers,)
    out = out_dir or _default_out_dir()
    results = trio.run(
        functools.partial(
            run_bench,
            list(presets),
            out_dir=out,
            kinds=kinds,
            repeats=repeats,
            nemo_venv=nemo_venv,
            echo=lambda s: click.echo(s, err=True),
            duration_s=duration_s,
            step_params=step_params,
            economy_params=economy_params,
            soak_overrides=soak_overrides,
        )
    )
    click.echo(render_markdown(results))
    click.echo(f"results in {out}", err=True)
    failed = gate_failures(results)
    for line in failed:
        click.echo(f"FAILED {line}", err=True)
    if failed:
        sys.exit(1)


def _side_by_side(baseline: str | None, arm_specs: tuple[str, ...],
                  baseline_sets: tuple[str, ...], side_items: tuple[str, ...],
                  out_dir: Path | None) -> None:
    """``--baseline`` / ``--arm``: :mod:`genrm_trio.bench.sidebyside`."""
    try:
        arms = [sidebyside.parse_arm(a) for a in arm_specs] or [sidebyside.Arm("current")]
        cfg = sidebyside.parse_side(side_items)
        extra = sidebyside.parse_sets(baseline_sets)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--arm/--side/--baseline-set") from None
    if baseline is not None:
        repo = Path(__file__).resolve().parents[2]
        try:
            code = sidebyside.export_commit(repo, baseline, Path(tempfile.gettempdir()))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--baseline") from None
        arms.append(sidebyside.Arm(f"baseline-{baseline[:12]}", code, extra))
    if cfg.nemo is not None:
        found = ensure_nemo_venv(cfg.nemo)
        if isinstance(found, str):
            raise click.BadParameter(found, param_hint="--side nemo")
        arms.append(sidebyside.Arm(f"nemo-gym-{NEMO_VERSION}", nemo=found))
    out = (out_dir or _default_out_dir()) / "side_by_side"
    results = trio.run(functools.partial(
        sidebyside.run_side_by_side, arms, cfg, out / "logs",
        echo=lambda s: click.echo(s, err=True)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(sidebyside.to_json(results, cfg))
    click.echo(sidebyside.render(results, cfg))
    click.echo(f"results in {out}", err=True)


if __name__ == "__main__":
    bench_cli()
