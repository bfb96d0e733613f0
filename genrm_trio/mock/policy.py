"""``genrm-trio mock-policy``: the embedded mock policy (:mod:`genrm_trio.caller.mock_policy`) as
a process of its own, until SIGTERM (exit 0) or Ctrl-C (exit 130)."""

from __future__ import annotations

import signal
from functools import partial

import click
import trio

from genrm_trio.caller.mock_policy import (
    MockPolicySettings,
    load_mock_policy_settings,
    run_mock_policy,
)


async def _serve_until_signal(settings: MockPolicySettings) -> int:
    """Serve until SIGINT or SIGTERM; returns which one arrived."""
    received: int = signal.SIGTERM
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(run_mock_policy, settings))
            click.echo(f"genrm-trio mock-policy listening on {url}")
            async for signum in signals:
                received = signum
                break
            nursery.cancel_scope.cancel()
    return received


@click.command("mock-policy")
@click.option("--host", default=None, help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to bind; 0 picks a free port.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a setting.")
def mock_policy_cli(
    host: str | None, port: int | None, config_path: str | None, overrides: tuple[str, ...]
) -> None:
    """Run the deterministic OpenAI-compatible mock policy until SIGTERM (exit 0) or Ctrl-C
    (exit 130)."""
    try:
        settings = load_mock_policy_settings(config_path, overrides, host=host, port=port)
    except click.BadParameter as exc:
        click.echo(f"genrm-trio mock-policy: {exc.message}", err=True)
        raise SystemExit(2) from exc
    if trio.run(_serve_until_signal, settings) == signal.SIGINT:
        from genrm_trio.cli import exit_interrupted

        exit_interrupted()
