"""``genrm-trio mock-judge`` (also ``python -m genrm_trio.mock.cli``): settings from a file,
``--set`` items and flags; serve until SIGTERM or Ctrl-C."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
import trio
import yaml

from genrm_trio.errors import ConfigError
from genrm_trio.mock.faults import Fault
from genrm_trio.mock.judge import run_mock_judge
from genrm_trio.mock.prefix_cache import PREFIX_CACHE_SIZES, parse_capacity
from genrm_trio.mock.settings import MockJudgeSettings, settings_from_mapping

log = logging.getLogger(__name__)


def _load_yaml_settings(path: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        problem = str(exc).replace("\n", " ")
        raise ConfigError("config", f"{path} is not valid YAML: {problem}") from exc
    if not isinstance(loaded, dict) or loaded.get("mock_judge") is None:
        return {}
    section = loaded["mock_judge"]
    if not isinstance(section, dict):
        raise ConfigError("mock_judge", "must be a mapping")
    return {str(k): v for k, v in section.items()}


def _parse_set(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(key or item, "--set needs KEY=VALUE")
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"value is not valid YAML: {raw!r}") from exc


def _settings_from_cli(
    *,
    host: str | None,
    port: int | None,
    config_path: str | None,
    overrides: tuple[str, ...],
    latency_ms: float | None,
    capacity: int | None,
    fault: str | None,
    fault_count: int | None,
    prefix_cache: str | None = None,
) -> MockJudgeSettings:
    """File, then ``--set`` items, then the explicit flags, the later winning."""
    values = _load_yaml_settings(config_path) if config_path else {}
    for item in overrides:
        key, value = _parse_set(item)
        values[key] = value
    flags: dict[str, Any] = {
        "host": host,
        "port": port,
        "latency_s": None if latency_ms is None else latency_ms / 1000.0,
        "capacity": capacity,
        "fault": fault,
        "fault_count": fault_count,
        "prefix_cache_tokens": _prefix_cache_size(prefix_cache),
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    return settings_from_mapping(values)


def _prefix_cache_size(value: str | None) -> int | None:
    """``--prefix-cache``: ``off``, ``small``, ``large`` or a number of tokens."""
    if value is None:
        return None
    try:
        return parse_capacity(value)
    except ValueError as exc:
        raise ConfigError("prefix_cache_tokens", f"--prefix-cache {exc}") from None


async def _serve_until_signal(settings: MockJudgeSettings) -> int:
    """Serve until SIGINT or SIGTERM; returns which one arrived."""
    received: int = signal.SIGTERM
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            base_url = await nursery.start(run_mock_judge, settings)
            print(f"genrm-trio mock-judge listening on {base_url}", flush=True)
            async for signum in signals:
                log.info("mock judge stopping on signal %d", signum)
                received = signum
                nursery.cancel_scope.cancel()
                break
    return received


def _fail(code: int, message: str) -> NoReturn:
    click.echo(f"genrm-trio mock-judge: {message}", err=True)
    sys.exit(code)


@click.command("mock-judge")
@click.option("--host", default=None, help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to bind; 0 = any free port.")
@click.option("--config", "config_path", default=None, help="YAML file; its mock_judge: mapping.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Any setting.")
@click.option("--latency-ms", type=float, default=None, help="Latency of every judge call.")
@click.option("--capacity", type=int, default=None, help="At most this many calls at once.")
@click.option("--fault", default=None, help="Fault: " + ", ".join(f.value for f in Fault) + ".")
@click.option("--fault-count", type=int, default=None, help="Fault only the first N calls.")
@click.option("--prefix-cache", default=None, metavar="SIZE",
              help=f"Prefix cache model: off, small ({PREFIX_CACHE_SIZES['small']:,} tokens), "
              f"large ({PREFIX_CACHE_SIZES['large']:,}) or a token count.")
def mock_judge_cli(
    host: str | None,
    port: int | None,
    config_path: str | None,
    overrides: tuple[str, ...],
    latency_ms: float | None,
    capacity: int | None,
    fault: str | None,
    fault_count: int | None,
    prefix_cache: str | None,
) -> None:
    """Run the fault-injecting mock GenRM judge until SIGTERM (exit 0) or Ctrl-C (exit 130).

    Prints one line, ``genrm-trio mock-judge listening on http://HOST:PORT``, once bound.
    Invalid settings: exit 2 with one line naming the key.
    """
    try:
        settings = _settings_from_cli(
            host=host,
            port=port,
            config_path=config_path,
            overrides=overrides,
            latency_ms=latency_ms,
            capacity=capacity,
            fault=fault,
            fault_count=fault_count,
            prefix_cache=prefix_cache,
        )
    except ConfigError as exc:
        _fail(2, str(exc))
    try:
        received = trio.run(_serve_until_signal, settings)
    except OSError as exc:
        _fail(1, f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}")
    if received == signal.SIGINT:
        from genrm_trio.cli import exit_interrupted

        exit_interrupted()


if __name__ == "__main__":
    mock_judge_cli()
