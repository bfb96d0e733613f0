"""The process: root nursery, judge, registry, Hypercorn, signals and shutdown.

Ownership: :func:`run_server` opens the judge (its HTTP clients), then the registry (which owns its
own nursery, where every cohort task lives), then the root nursery that runs Hypercorn. A cohort's
failure stays inside the registry; nothing a cohort meets reaches Hypercorn's nursery. Shutdown is
one cancellation from the top: the shutdown event fails every active cohort with ``shutdown`` (each
waiter answers its 503), Hypercorn stops accepting and gives open connections ``shutdown_grace_s``
to finish, then the root nursery is cancelled. :func:`serve_main` owns SIGINT/SIGTERM (Hypercorn's
programmatic ``serve`` installs no signal handlers): both shut down gracefully; it returns which
one arrived, so the CLI can exit 0 on SIGTERM (the orchestrator's normal stop) and 130 on SIGINT
(Ctrl-C, the shell's convention)."""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from genrm_trio.config import Config
from genrm_trio.server.app import create_app, with_verify_fast_path
from genrm_trio.server.auth import BearerAuth, read_auth_token
from genrm_trio.server.cohort import CohortRegistry
from genrm_trio.server.journal import Journal
from genrm_trio.server.judge import Judge, open_judge
from genrm_trio.server.prometheus import ServerMetrics

logger = logging.getLogger(__name__)


def _hypercorn_config(cfg: Config) -> HypercornConfig:
    hconfig = HypercornConfig()
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    hconfig.bind = [f"{host}:{cfg.port}"]
    hconfig.graceful_timeout = cfg.shutdown_grace_s
    hconfig.accesslog = None
    hconfig.errorlog = logging.getLogger("hypercorn.error")
    hconfig.backlog = 2048
    hconfig.keep_alive_timeout = 75
    # Hypercorn's read timeout covers every read of a connection, including the silence while a
    # request waits for its cohort, so it is only a backstop above the longest legitimate wait;
    # slow bodies are bounded per request by request_read_timeout_s (app.py).
    hconfig.read_timeout = math.ceil(
        cfg.request_read_timeout_s + cfg.cohort_collection_timeout_s
        + cfg.cohort_evaluation_timeout_s + cfg.shutdown_grace_s + 60.0
    )
    return hconfig


async def run_server(
    cfg: Config,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``cfg`` until ``shutdown`` is set (graceful) or this task is cancelled (abrupt).

    Reports the bound base URL (``http://127.0.0.1:PORT``, so port 0 works) through
    ``task_status``. Graceful shutdown answers every waiter with a 503 ``shutdown`` JSON body
    before connections close, then returns. Raises :class:`~genrm_trio.errors.ConfigError`
    before binding when ``auth_token_env`` names a variable that is not set.
    """
    stop = shutdown if shutdown is not None else trio.Event()
    token = read_auth_token(cfg, os.environ)
    auth = BearerAuth(token) if token is not None else None
    del token
    journal = (Journal.open(cfg.state_dir, cfg.state_sync) if cfg.state_dir is not None
               else None)
    metrics = ServerMetrics()
    try:
        async with (
            open_judge(cfg, observer=metrics) as judge,
            CohortRegistry.open(cfg, judge, journal, observer=metrics) as registry,
            trio.open_nursery() as root,
        ):
            metrics.read_from(registry, judge)
            await _serve_in(cfg, judge, registry, root, stop, auth, metrics, task_status)
    finally:
        if journal is not None:
            journal.close()


async def _serve_in(
    cfg: Config, judge: Judge, registry: CohortRegistry, root: trio.Nursery, stop: trio.Event,
    auth: BearerAuth | None, metrics: ServerMetrics, task_status: trio.TaskStatus[str],
) -> None:
    """Start Hypercorn in ``root`` (the process-long nursery) in front of ``registry``."""
    app = create_app(cfg, registry, judge, metrics)

    @app.after_serving
    async def _lifespan_end() -> None:
        registry.begin_shutdown()

    async def shutdown_trigger() -> None:
        await stop.wait()
        registry.begin_shutdown()

    async def hypercorn_task(task_status: trio.TaskStatus[list[str]]) -> None:
        await hypercorn_serve(
            with_verify_fast_path(app, cfg, registry, auth=auth, metrics=metrics),
            _hypercorn_config(cfg),
            shutdown_trigger=shutdown_trigger,
            task_status=task_status,
        )
        registry.begin_shutdown()
        root.cancel_scope.cancel()

    binds: list[str] = await root.start(hypercorn_task)
    url = binds[0]
    logger.info("genrm-trio serving on %s (num_rollouts_per_prompt=%d)", url,
                cfg.num_rollouts_per_prompt)
    if auth is not None:  # the variable's name only, never its value
        logger.info("inbound auth: a bearer token from $%s is required on every endpoint but "
                    "/health, /healthz and /readyz", cfg.auth_token_env)
    task_status.started(url)


async def serve_main(cfg: Config) -> int | None:
    """``genrm-trio serve``: run until SIGINT/SIGTERM, then shut down gracefully within
    ``shutdown_grace_s`` (a second signal cancels at once). Prints one ``listening on`` line
    once bound. Returns the first signal's number (None if the server stopped by itself)."""
    stop = trio.Event()
    received: list[int] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as server:

                async def watch_signals() -> None:
                    async for signum in signals:
                        if stop.is_set():
                            server.cancel_scope.cancel()
                            continue
                        logger.info("%s received: shutting down", signal.Signals(signum).name)
                        received.append(signum)
                        stop.set()
                        # Hypercorn's grace bounds the drain; this is the backstop.
                        server.cancel_scope.deadline = (
                            trio.current_time() + cfg.shutdown_grace_s + 1.0
                        )

                outer.start_soon(watch_signals)
                url = await server.start(partial(run_server, cfg, shutdown=stop))
                print(f"genrm-trio serve listening on {url}", flush=True)
                # What exists now lives as long as the process: keep it out of the
                # collector's full passes so they stay short under load.
                gc.collect()
                gc.freeze()
                # Young collections every 10,000 allocations instead of 700: a request's objects
                # mostly die before a collection sees them, so far fewer reach the old
                # generation, and full passes over what is live (thousands of open connections
                # and waiters) stop dominating: with 4,096 idle keep-alive connections the
                # default thresholds doubled CPU per cohort (bench preset steady_state).
                gc.set_threshold(10_000, 10, 10)
            outer.cancel_scope.cancel()
    logger.info("stopped")
    return received[0] if received else None


__all__ = ["run_server", "serve_main"]
