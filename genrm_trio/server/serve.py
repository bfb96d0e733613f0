"""The process: root nursery, judge, registry, Hypercorn, signals and shutdown.

Ownership: :func:`run_server` resolves the machine-dependent config defaults (``max_active_bytes:
auto``, server/memory_limit.py), runs the journal's writer with ``state_dir`` (server/journal.py:
its worker thread commits what the registry queues; it outlives the registry, so the shutdown's
writes are committed too, and drains within the deadline's cleanup allowance), opens the judge
(its HTTP clients), then the registry (which owns
its own nursery, where every cohort task lives), then the root nursery that runs Hypercorn and,
with ``probe_port`` set, the probe listener beside it (server/probes.py). A cohort's failure stays
inside the registry; nothing a cohort meets reaches Hypercorn's nursery. Shutdown is one
cancellation from the top: the shutdown event fails every active cohort with ``shutdown`` (each
waiter answers its 503), Hypercorn stops accepting and gives open connections ``shutdown_grace_s``
to finish, then the root nursery is cancelled. One deadline (:class:`ShutdownDeadline`, fixed when
shutdown begins) bounds every send and cleanup; connections still open at it are aborted at the
socket level (server/shutdown.py says why), so the process ends on time whatever clients do. The
probe listener answers until the root nursery is cancelled: readiness 503 through the grace.
:func:`serve_main` owns SIGINT/SIGTERM (Hypercorn's programmatic ``serve`` installs no signal
handlers): both shut down gracefully; it returns which one arrived, so the CLI can exit 0 on
SIGTERM (the orchestrator's normal stop) and 130 on SIGINT (Ctrl-C, the shell's convention)."""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig

from genrm_trio.config import Config, ResolvedConfig, drain_bound_s, format_bytes
from genrm_trio.errors import ConfigError
from genrm_trio.server import connections, memory_limit
from genrm_trio.server.app import create_app, with_verify_fast_path
from genrm_trio.server.auth import OPEN_PATHS, BearerAuth, read_auth_token
from genrm_trio.server.cohort import CohortRegistry
from genrm_trio.server.drain import DrainMode
from genrm_trio.server.journal import Journal
from genrm_trio.server.judge import Judge, open_judge
from genrm_trio.server.probes import bound_url, open_probe_socket, serve_probes
from genrm_trio.server.process_memory import ProcessMemory
from genrm_trio.server.prometheus import ServerMetrics
from genrm_trio.server.shutdown import (
    CLEANUP_S,
    FORCED_EXIT_S,
    ShutdownDeadline,
    abort_client_connections,
)
from genrm_trio.server.tracing import (
    FLUSH_BOUND_S,
    NO_TRACER,
    Tracer,
    close_tracer,
    open_tracer,
)

logger = logging.getLogger(__name__)

JOURNAL_FLUSH_S = 2.0
"""The journal's drain bound when the server stops without a graceful shutdown."""


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
    deadline: ShutdownDeadline | None = None,
    tracer: Tracer | None = None,
    drain_mode: DrainMode | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``cfg`` until ``shutdown`` is set (graceful) or this task is cancelled (abrupt).

    Reports the bound base URL (``http://127.0.0.1:PORT``, so port 0 works) through
    ``task_status``. Graceful shutdown answers every waiter with a 503 ``shutdown`` JSON body
    before connections close; at the shutdown deadline (``deadline``, begun when ``shutdown``
    is set if the caller has not begun it already; by default one of ``shutdown_grace_s``)
    every client connection still open is aborted, so this returns shortly after it whatever
    the clients do. Raises :class:`~genrm_trio.errors.ConfigError` before binding when
    ``auth_token_env`` names a variable that is not set, or ``tracing.enabled`` without the
    ``[otel]`` extra or with a span export process that cannot start. ``tracer`` (tests: one
    with an in-memory exporter) replaces the one ``tracing`` asks for; it is closed here
    either way (its export process with it). ``drain_mode`` (``serve_main`` maps SIGUSR1 to
    it; else one of this server's own, reached through ``POST /admin/drain``) drains the server:
    new cohorts refused with 425, the open ones finished, then ``shutdown`` is set
    (server/drain.py).
    """
    stop = shutdown if shutdown is not None else trio.Event()
    mode = drain_mode if drain_mode is not None else DrainMode(drain_bound_s(cfg))
    drain = deadline if deadline is not None else ShutdownDeadline(cfg.shutdown_grace_s)
    cfg = memory_limit.resolved(cfg)
    token = read_auth_token(cfg, os.environ)
    auth = BearerAuth(token) if token is not None else None
    del token
    metrics = ServerMetrics()
    if tracer is None:
        # Before anything opens: a missing extra, or an export process that cannot start,
        # stops the start. In a thread: the export process takes a moment to be ready.
        # Nothing between this and the try below can fail, so the tracer is always closed.
        tracer = (await trio.to_thread.run_sync(open_tracer, cfg) if cfg.tracing.enabled
                  else NO_TRACER)
    journal = None
    try:
        journal = (Journal.open(cfg.state_dir, cfg.state_sync) if cfg.state_dir is not None
                   else None)
        async with (
            _journal_writer(journal, drain),
            open_judge(cfg, observer=metrics) as judge,
            CohortRegistry.open(cfg, judge, journal, observer=metrics,
                                tracer=tracer) as registry,
            trio.open_nursery() as root,
        ):
            metrics.read_from(registry, judge, tracer)
            root.start_soon(mode.run, registry, stop)
            await _serve_in(cfg, judge, registry, root, stop, drain, auth, metrics, tracer,
                            mode, task_status)
    finally:
        if journal is not None:
            journal.close()
        # Last, so the cohort spans that shutdown ended go out too; within the deadline's
        # cleanup allowance (or FLUSH_BOUND_S when the server stopped early).
        await close_tracer(tracer, min(FLUSH_BOUND_S, drain.remaining_s() + CLEANUP_S / 2))


@asynccontextmanager
async def _journal_writer(journal: Journal | None, drain: ShutdownDeadline,
                          ) -> AsyncIterator[None]:
    """The journal's writer (server/journal.py) for the server's lifetime, outside the
    registry, so records the shutdown writes are committed too. On leaving, it drains the
    queue and closes the file within the deadline's first share of the cleanup allowance (at
    most ``JOURNAL_FLUSH_S`` when the server stops without a shutdown): a stalled disk then
    loses the records not yet committed, never the deadline."""
    if journal is None:
        yield
        return
    async with journal.writing(
            lambda: min(JOURNAL_FLUSH_S, drain.remaining_s() + CLEANUP_S / 4), close=True):
        yield


async def _serve_in(
    cfg: ResolvedConfig, judge: Judge, registry: CohortRegistry, root: trio.Nursery,
    stop: trio.Event, drain: ShutdownDeadline, auth: BearerAuth | None, metrics: ServerMetrics,
    tracer: Tracer, mode: DrainMode, task_status: trio.TaskStatus[str],
) -> None:
    """Start Hypercorn in ``root`` (the process-long nursery) in front of ``registry``, and
    the probe listener beside it when ``probe_port`` is set. The probe port is bound first,
    so a port in use stops the start before anything serves; its bound port replaces
    ``probe_port`` in the config ``/status`` shows (port 0 works)."""
    main_serving = trio.Event()
    probe_url = None
    if cfg.probe_port is not None:
        try:
            probe_socket = await open_probe_socket(cfg.host, cfg.probe_port)
        except OSError as exc:
            raise ConfigError("probe_port", f"cannot listen on {cfg.host}:{cfg.probe_port}: "
                              f"{exc.strerror or exc}") from exc
        probe_url = bound_url(probe_socket)
        cfg = msgspec.structs.replace(cfg, probe_port=int(probe_url.rsplit(":", 1)[1]))
        # The socket is the probe task's from here on; it accepts once the main port serves
        # (probes meanwhile wait in its backlog). Liveness and readiness go on answering
        # through the shutdown grace (readiness 503), until Hypercorn is done and `root` is
        # cancelled.
        def agent_line() -> bytes:  # HAProxy's agent check (server/probes.py)
            # Never "drain": a draining replica stays on the ring (server/drain.py). Never
            # "ready" either: it would cancel a DRAIN or MAINT an operator set in HAProxy.
            return b"down\n" if registry.shutting_down else b"up\n"

        await root.start(partial(serve_probes, probe_socket, lambda: not registry.shutting_down,
                                 after=main_serving, agent=agent_line))
    process_memory = ProcessMemory.open(cfg.malloc_trim_interval_s,
                                        cfg.malloc_mmap_threshold_bytes)
    app = create_app(cfg, registry, judge, metrics, process_memory, mode)

    def begin_shutdown() -> None:
        drain.begin()
        registry.begin_shutdown()

    @app.after_serving
    async def _lifespan_end() -> None:
        begin_shutdown()

    async def shutdown_trigger() -> None:
        # Hypercorn then stops accepting and moves its connections' deadline to now + grace:
        # the same moment as `drain.deadline`, give or take this task's wake-up.
        await stop.wait()
        begin_shutdown()

    async def hypercorn_task(task_status: trio.TaskStatus[list[str]]) -> None:
        await connections.serve(  # Hypercorn's serve, with leaner connections
            with_verify_fast_path(app, cfg, registry, drain, auth=auth, metrics=metrics,
                                  tracer=tracer),
            _hypercorn_config(cfg),
            shutdown_trigger=shutdown_trigger,
            send_timeout_s=cfg.send_timeout_s,
            on_send_timeout=registry.send_timed_out,
            task_status=task_status,
        )
        begin_shutdown()
        root.cancel_scope.cancel()

    binds: list[str] = await root.start(hypercorn_task)
    url = binds[0]
    root.start_soon(_abort_connections_at_deadline, drain, int(url.rsplit(":", 1)[1]))
    root.start_soon(process_memory.trim_periodically)  # malloc's freed memory back to the OS
    logger.info("genrm-trio serving on %s (num_rollouts_per_prompt=%d)", url,
                cfg.num_rollouts_per_prompt)
    logger.info("max_active_bytes: %s (%s)",
                "unlimited" if cfg.max_active_bytes is None
                else format_bytes(cfg.max_active_bytes), cfg.max_active_bytes_source)
    main_serving.set()
    if probe_url is not None:
        logger.info("probes on %s (GET /, /health, /healthz, /livez, /readyz)", probe_url)
    if auth is not None:  # the variable's name only, never its value
        logger.info("inbound auth: a bearer token from $%s is required on every endpoint but "
                    "the probes (%s)", cfg.auth_token_env, ", ".join(sorted(OPEN_PATHS)))
    task_status.started(url)


async def _abort_connections_at_deadline(drain: ShutdownDeadline, port: int) -> None:
    """At the shutdown deadline, abort every client connection still open. Hypercorn cancels
    its connection tasks then too, but a task writing a response to a client that stopped
    reading sits in Hypercorn's own unbounded shield, out of reach of any cancellation: only a
    broken socket ends it. Cancelled with ``root`` when Hypercorn ends before the deadline."""
    with drain.scope():  # no bound of its own: ends at the deadline
        await trio.sleep_forever()
    aborted = abort_client_connections(port)
    if aborted:
        logger.warning("shutdown grace of %g s over: %d client connections still open aborted",
                       drain.grace_s, aborted)


async def _cancel_after_cleanup(drain: ShutdownDeadline, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` (the server) ``CLEANUP_S`` after the deadline: the backstop for
    anything unshielded still running then."""
    with drain.scope(after_s=CLEANUP_S):
        await trio.sleep_forever()
    scope.cancel()


async def _exit_if_overrun(drain: ShutdownDeadline, received: list[int]) -> None:
    """The last resort of ``genrm-trio serve``: if the process is still shutting down
    ``FORCED_EXIT_S`` after the deadline (something ignored its cancellation), log it and exit
    at once, with the code a clean stop would have had (0 after SIGTERM, the CLI's 130 after
    SIGINT). Only the CLI process arms this; a server run in-process never exits its host."""
    with drain.scope(after_s=FORCED_EXIT_S):
        await trio.sleep_forever()
    logger.error("shutdown still not over %.2f s after its deadline: exiting now", FORCED_EXIT_S)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(130 if received[:1] == [signal.SIGINT] else 0)


async def serve_main(cfg: Config) -> int | None:
    """``genrm-trio serve``: run until SIGINT/SIGTERM, then shut down gracefully; the process
    ends within ``shutdown_grace_s`` plus well under a second whatever clients and judges do
    (a second signal ends the grace at once). Prints one ``listening on`` line once bound.
    Returns the first signal's number (None if the server stopped by itself).

    One :class:`ShutdownDeadline`, begun at the first signal, is shared by everything: the
    server's sends and its connection abort at the deadline, the cancellation of whatever is
    left ``CLEANUP_S`` later, and the forced exit ``FORCED_EXIT_S`` after it."""
    stop = trio.Event()
    received: list[int] = []
    drain = ShutdownDeadline(cfg.shutdown_grace_s)
    mode = DrainMode(drain_bound_s(cfg))
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as signals:
        async with trio.open_nursery() as outer:
            outer.start_soon(_exit_if_overrun, drain, received)
            async with trio.open_nursery() as server:

                async def watch_signals() -> None:
                    async for signum in signals:
                        if signum == signal.SIGUSR1:  # drain (server/drain.py); exits 0
                            logger.info("SIGUSR1 received: draining")
                            mode.request()
                            continue
                        if stop.is_set():
                            drain.expire_now()
                            server.cancel_scope.cancel()
                            continue
                        logger.info("%s received: shutting down", signal.Signals(signum).name)
                        received.append(signum)
                        drain.begin()
                        stop.set()

                outer.start_soon(watch_signals)
                outer.start_soon(_cancel_after_cleanup, drain, server.cancel_scope)
                url = await server.start(partial(run_server, cfg, shutdown=stop, deadline=drain,
                                                 drain_mode=mode))
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
                # A full pass after 100 middle ones instead of 10: with thousands of members
                # waiting, one walks every live object (0.7 s with 10,000 waiting) and finds
                # next to nothing (connections leave no cycles, server/connections.py); at 10,
                # one landed inside the release of 10,000 waiters (bench preset release) and
                # every answer waited for it.
                gc.set_threshold(10_000, 10, 100)
            outer.cancel_scope.cancel()
    logger.info("stopped")
    return received[0] if received else None


__all__ = ["run_server", "serve_main"]
