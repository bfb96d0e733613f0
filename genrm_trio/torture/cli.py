"""``genrm-trio torture``: the command line over the local and HTTP drivers."""

from __future__ import annotations

import functools
import logging
import os
import sys

import click
import trio
import trio.testing

from genrm_trio.torture.fuzz import run_http_fuzz
from genrm_trio.torture.http import run_http_torture
from genrm_trio.torture.local import LocalSummary, run_local


def print_local_summary(summary: LocalSummary, seed: int) -> None:
    """The ``--local`` report: counts, outcomes, and a failing schedule shrunk, with the seed
    that reproduces it."""
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(summary.outcomes.items()))
    click.echo(f"torture --local: {summary.schedules} schedules, {summary.requests} requests, "
               f"{summary.judge_calls} judge calls in {summary.wall_s:.1f} s (seed {seed})")
    click.echo(f"  outcomes: {kinds}")
    if summary.shrunk is None:
        click.echo("  violations: 0")
        return
    click.echo(f"  VIOLATION in schedule seed {summary.failing_seed}; shrunk to "
               f"{len(summary.shrunk.ops)} ops:")
    click.echo(summary.shrunk.describe())
    for v in summary.violations:
        click.echo(f"  - {v}")
    click.echo(f"  reproduce: genrm-trio torture --local --seed {summary.failing_seed} "
               "--schedules 1")


@click.command("torture")
@click.option("--local", is_flag=True, help="Run schedules against an in-process registry "
              "with a scripted judge and a virtual clock.")
@click.option("--schedules", type=click.IntRange(min=1), default=2000, show_default=True,
              help="--local: number of random schedules.")
@click.option("--max-ops", type=click.IntRange(min=1), default=24, show_default=True,
              help="--local: operations per schedule, at most.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed; --local schedule i uses seed+i.")
@click.option("--partial", is_flag=True, help="--local: schedules with incomplete_cohort_policy: "
              "judge_present (cohorts of 3-4, groups missing a straggler); partial rewards "
              "are checked against the reference over the members scored.")
@click.option("--url", help="Base URL of a live /verify server to torture over HTTP.")
@click.option("--judge-url", help="Base URL of the genrm-trio mock judge the server uses "
              "(its /admin/fault API injects the faults).")
@click.option("--num-rollouts", type=int, default=None,
              help="The server's num_rollouts_per_prompt (default: read from GET /status).")
@click.option("--requests", "max_requests", type=click.IntRange(min=1), default=300,
              show_default=True, help="--url: stop after about this many requests.")
@click.option("--time-limit-s", type=float, default=120.0, show_default=True,
              help="--url: stop starting rounds after this many seconds.")
@click.option("--hang-after-s", type=float, default=60.0, show_default=True,
              help="--url: a request unanswered this long counts as hung (set above the "
                   "server's collection + evaluation deadlines).")
@click.option("--settle-s", type=float, default=0.0, show_default=True,
              help="--url: then wait this long and check GET /status for left-behind cohorts "
                   "and waiters (set past the server's deadlines; 0 skips).")
@click.option("--fuzz", "fuzz_bodies", type=click.IntRange(min=0), default=0, show_default=True,
              help="--url: first send this many malformed /verify and /compare bodies "
                   "(expects a quiet server: its /status must not change).")
@click.option("--no-reward-check", is_flag=True,
              help="--url: do not compare rewards with the heuristic judge's reference.")
@click.option("--server-token-env", default=None, metavar="ENV",
              help="--url: environment variable holding the server's bearer token (default: "
                   "GENRM_AUTH_TOKEN, sent only when set).")
def torture_cli(local: bool, schedules: int, max_ops: int, seed: int, partial: bool,
                url: str | None,
                judge_url: str | None, num_rollouts: int | None, max_requests: int,
                time_limit_s: float, hang_after_s: float, settle_s: float, fuzz_bodies: int,
                no_reward_check: bool, server_token_env: str | None) -> None:
    """Torture the cohort lifecycle: random schedules of arrivals, duplicates, conflicts,
    disconnects, attempts, deadlines, judge faults and shutdown, checked against the contract.

    Exit 0 when no violation was found, 1 otherwise (the failing schedule is printed shrunk,
    with the seed that reproduces it).

    \b
    genrm-trio torture --local --schedules 10000
    genrm-trio torture --local --partial --schedules 10000
    genrm-trio torture --url http://127.0.0.1:8000 --judge-url http://127.0.0.1:9000
    """
    if local == (url is not None):
        raise click.UsageError("pass exactly one of --local and --url")
    if local:
        # The scripted judge's crashes are logged with tracebacks by the registry: expected here.
        logging.getLogger("genrm_trio").setLevel(logging.CRITICAL)
        summary = run_local(schedules, seed, max_ops,
                            progress=lambda k: click.echo(f"  ... {k} schedules", err=True),
                            partial=partial)
        print_local_summary(summary, seed)
        sys.exit(1 if summary.shrunk is not None else 0)
    assert url is not None
    token = os.environ.get(server_token_env or "GENRM_AUTH_TOKEN", "").strip() or None
    if server_token_env is not None and token is None:
        raise click.UsageError(f"--server-token-env: environment variable {server_token_env!r} "
                               "is not set")
    violations = 0
    if fuzz_bodies:
        fuzzed = trio.run(functools.partial(run_http_fuzz, url, bodies=fuzz_bodies, seed=seed,
                                            token=token))
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(fuzzed.statuses.items()))
        click.echo(f"fuzz {url}: {fuzzed.bodies} malformed bodies, "
                   f"{len(fuzzed.violations)} violations (statuses {codes})")
        for v in fuzzed.violations[:50]:
            click.echo(f"  - {v}")
        violations += len(fuzzed.violations)
    result = trio.run(functools.partial(
        run_http_torture, url, judge_url=judge_url, num_rollouts=num_rollouts,
        max_requests=max_requests, time_limit_s=time_limit_s, hang_after_s=hang_after_s,
        seed=seed, check_rewards=not no_reward_check, settle_s=settle_s, token=token))
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(result.statuses.items()))
    click.echo(f"torture --url {url}: {result.rounds} rounds, {result.requests} requests, "
               f"{result.disconnects} disconnects, {result.hung} hung, "
               f"{len(result.violations)} violations in {result.wall_s:.1f} s")
    click.echo(f"  answers: {statuses}")
    for v in result.violations[:50]:
        click.echo(f"  - {v}")
    violations += len(result.violations)
    sys.exit(1 if violations else 0)
