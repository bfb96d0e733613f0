"""The ``genrm-trio`` command line: one entry point, one subcommand per job.

Subcommands whose code lives in other modules are imported on first use, so ``genrm-trio
serve`` starts without loading the collector or the benchmark tools.

Ctrl-C: every subcommand exits 130 with one line, ``genrm-trio: interrupted`` (the group catches
the ``KeyboardInterrupt``, bare or inside a trio exception group, before click turns it into
``Aborted!`` and exit 1). ``serve`` handles SIGINT itself: it shuts down gracefully like on
SIGTERM (every waiter gets its 503 ``shutdown`` answer), then exits 130, while SIGTERM exits 0.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn

import click

from genrm_trio.errors import ConfigError

if TYPE_CHECKING:
    from genrm_trio.config import Config
    from genrm_trio.nemo_env import NemoServerBlock

DEFAULT_CONFIG = os.path.join("configs", "default.yaml")

_LAZY_COMMANDS = MappingProxyType({
    "mock-judge": ("genrm_trio.mock.cli", "mock_judge_cli"),
    "mock-policy": ("genrm_trio.mock.policy", "mock_policy_cli"),
    "collect": ("genrm_trio.caller.collect", "collect_cli"),
    "aggregate": ("genrm_trio.caller.aggregate", "aggregate_cli"),
    "bench": ("genrm_trio.bench.cli", "bench_cli"),
    "torture": ("genrm_trio.torture.cli", "torture_cli"),
    "demo": ("genrm_trio.demo", "demo_cli"),
})


INTERRUPTED_EXIT = 130
INTERRUPTED_LINE = "genrm-trio: interrupted"


def _is_interrupt(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, BaseExceptionGroup) and exc.subgroup(KeyboardInterrupt) is not None


def exit_interrupted() -> NoReturn:
    """Print the one interrupt line and exit 130."""
    click.echo(INTERRUPTED_LINE, err=True)
    sys.exit(INTERRUPTED_EXIT)


class _LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BaseException as exc:
            if _is_interrupt(exc):
                exit_interrupted()
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _LAZY_COMMANDS:
            module_name, attr = _LAZY_COMMANDS[cmd_name]
            command = getattr(importlib.import_module(module_name), attr)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)


def setup_logging(level: str, log_format: str = "auto") -> None:
    """Root logging to stderr: JSON lines off a terminal, key=value on one (genrm_trio/logs.py)."""
    from genrm_trio.logs import setup_logging as setup

    setup(level, log_format, sys.stderr)


def load_cli_config(config_path: str | None, sets: Sequence[str], extra: Sequence[str] = ()) -> Any:
    """Load the server config for a subcommand; exit 2 with one line naming the key on error."""
    from genrm_trio.config import load_config

    path = config_path
    if path is None and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    try:
        return load_config(path, [*extra, *sets], os.environ)
    except ConfigError as exc:
        click.echo(f"genrm-trio: invalid configuration: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:
        click.echo(f"genrm-trio: cannot read config file {path!r}: {exc.strerror}", err=True)
        sys.exit(2)


def server_options(func: Any) -> Any:
    """--host, --port, --config and repeatable --set, as every server-starting command has."""
    func = click.option(
        "--set", "sets", multiple=True, metavar="KEY=VALUE",
        help="Override any config key (dotted for nested keys; value is YAML).",
    )(func)
    func = click.option("--config", "config_path", type=click.Path(dir_okay=False),
                        help=f"YAML config file (default: {DEFAULT_CONFIG} if present).")(func)
    func = click.option("--port", type=int, help="Port to bind (0 = any free port).")(func)
    func = click.option("--host", help="Address to bind (default 127.0.0.1).")(func)
    return func


def host_port_overrides(host: str | None, port: int | None) -> list[str]:
    out = []
    if host is not None:
        out.append(f"host={host}")
    if port is not None:
        out.append(f"port={port}")
    return out


@click.group(cls=_LazyGroup)
@click.version_option(package_name="genrm-trio")
def main() -> None:
    """genrm-trio: a GenRM cohort judging server on Trio, wire-compatible with NeMo Gym's
    genrm_compare, with its collector, mock judge, benchmarks and torture tests."""


def exit_config_error(exc: ConfigError) -> NoReturn:
    """Print the one configuration error line and exit 2."""
    click.echo(f"genrm-trio: invalid configuration: {exc}", err=True)
    sys.exit(2)


def load_nemo_block() -> NemoServerBlock:
    """The NeMo Gym block this process was launched for (genrm_trio/nemo_env.py); exit 2 with
    one line when the variables are missing or the block is not a resources server."""
    from genrm_trio.nemo_env import read_nemo_env

    try:
        return read_nemo_env(os.environ)
    except ConfigError as exc:
        exit_config_error(exc)


def _from_nemo_config(
    sets: Sequence[str], extra: Sequence[str]
) -> tuple[NemoServerBlock, Config]:
    """The server config from NeMo Gym's block, then the environment and ``--set``; exit 2 with
    one line on any problem, also when an override moves the server off the block's address."""
    from genrm_trio.config import load_config_block
    from genrm_trio.nemo_env import check_served_address

    found = load_nemo_block()
    try:
        cfg = load_config_block(found.config_block(), found.where, [*extra, *sets], os.environ)
        check_served_address(found, cfg.host, cfg.port)
    except ConfigError as exc:
        exit_config_error(exc)
    return found, cfg


@main.command()
@server_options
@click.option("--judge-url", "judge_urls", multiple=True, metavar="URL",
              help="Judge base URL without /v1 (repeatable). None: the built-in judge.")
@click.option("--from-nemo-gym-env", "from_nemo", is_flag=True,
              help="Take host, port and the genrm_compare keys from the block NeMo Gym's "
                   "`gym env start` launched this process for (NEMO_GYM_CONFIG_DICT, "
                   "NEMO_GYM_CONFIG_PATH) instead of a config file; see "
                   "resources_servers/genrm_trio/.")
def serve(host: str | None, port: int | None, config_path: str | None, sets: tuple[str, ...],
          judge_urls: tuple[str, ...], from_nemo: bool) -> None:
    """Run the /verify and /compare server until SIGINT or SIGTERM."""
    import trio

    from genrm_trio.server.serve import serve_main

    extra = host_port_overrides(host, port)
    if judge_urls:
        extra.append("judge.base_urls=[" + ", ".join(f'"{u}"' for u in judge_urls) + "]")
    if from_nemo:
        clash = [flag for flag, value in (("--config", config_path), ("--host", host),
                                          ("--port", port)) if value is not None]
        if clash:
            click.echo(f"genrm-trio: {clash[0]} cannot be combined with --from-nemo-gym-env "
                       "(NeMo Gym's block sets the config, host and port)", err=True)
            sys.exit(2)
        nemo, cfg = _from_nemo_config(sets, extra)
        setup_logging(cfg.log_level, cfg.log_format)
        judge = "" if nemo.judge_server is None else (
            f"; judge: NeMo Gym model server {nemo.judge_server} (genrm_model_server)")
        logging.getLogger(__name__).info(
            "config from NeMo Gym block %s at %s%s", nemo.where, nemo.url, judge)
    else:
        cfg = load_cli_config(config_path, sets, extra)
        setup_logging(cfg.log_level, cfg.log_format)
    from genrm_trio.server.auth import read_auth_token
    from genrm_trio.server.tracing import check_available

    try:  # fail fast, with one line, before anything is bound
        read_auth_token(cfg, os.environ)
        check_available(cfg)  # tracing.enabled without the [otel] extra
    except ConfigError as exc:
        exit_config_error(exc)
    if cfg.state_dir is not None:
        from genrm_trio.server.journal import Journal, JournalError

        try:  # fail fast, with one line, before anything is bound
            Journal.open(cfg.state_dir).close()
        except JournalError as exc:
            click.echo(f"genrm-trio: invalid configuration: config key 'state_dir': {exc}",
                       err=True)
            sys.exit(2)
    try:
        received = trio.run(serve_main, cfg)
    except BaseException as exc:
        # A problem only the server's start can find (a judge api key variable that is not
        # set, a plugin that cannot be imported) arrives inside trio's exception groups.
        found = _config_error(exc)
        if found is None:
            raise
        click.echo(f"genrm-trio: invalid configuration: {found}", err=True)
        sys.exit(2)
    if received == signal.SIGINT:
        exit_interrupted()


@main.command("nemo-gym-external")
def nemo_gym_external() -> None:
    """Stand in, under NeMo Gym's `gym env start`, for a genrm-trio that runs elsewhere.

    NeMo Gym 0.7.0 only lets an agent reference a resources-server block that has an
    entrypoint, and it launches every such block. This entry (resources_servers/genrm_trio/
    external.py) is what it launches when the block's host and port name a genrm-trio started
    outside NeMo Gym: it checks the block, serves nothing, and waits for NeMo Gym's stop signal
    (SIGINT, or SIGTERM: exit 0). NeMo Gym's own readiness check calls the block's address,
    i.e. the external server.
    """
    import trio

    from genrm_trio.nemo_env import check_external_block

    found = load_nemo_block()
    try:
        check_external_block(found)
    except ConfigError as exc:
        exit_config_error(exc)
    line = (f"genrm-trio: NeMo Gym block {found.where} uses the genrm-trio at {found.url}, "
            "started outside NeMo Gym; this process serves nothing and waits to be stopped")
    if trio.run(_wait_for_stop_signal, line) == signal.SIGINT:
        exit_interrupted()


async def _wait_for_stop_signal(ready_line: str) -> int:
    """Print ``ready_line`` once SIGINT and SIGTERM are caught, then block until one of them
    arrives; return its number."""
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        click.echo(ready_line, err=True)
        async for signum in signals:
            return int(signum)
    raise AssertionError("the signal receiver never ends")  # pragma: no cover


def _config_error(exc: BaseException) -> ConfigError | None:
    """The ConfigError ``exc`` is or holds (through exception groups), if any."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _config_error(inner)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    main()
