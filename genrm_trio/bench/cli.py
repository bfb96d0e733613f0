"""``genrm-trio bench``: the command line over :func:`genrm_trio.bench.run.run_bench`."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click
import trio

from genrm_trio.bench.cases import step
from genrm_trio.bench.cases.economy import parse_economy_overrides
from genrm_trio.bench.cases.soak import parse_soak_overrides
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
    "replaced (comma list), prompt_token_s, output_token_s, latency_ms, spill_factor.",
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
) -> None:
    """Benchmark genrm-trio side by side with NeMo Gym's genrm_compare on this machine.

    Writes results.json, summary.md and PNG plots into the results folder and prints the table.
    Unknown preset: exit 2. A gating case (the soak) that failed a check or could not run: exit
    1 after the table.
    """
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


if __name__ == "__main__":
    bench_cli()
