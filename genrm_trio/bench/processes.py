"""Child processes the tools start (servers, judges, HAProxy, wrk): how a process is launched and
known to be ready (:func:`launch_process`), how the programs are found (installed from Debian
packages when missing) and how the processes are stopped."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import trio

from genrm_trio.bench import loadgen
from genrm_trio.bench.loadgen import H11Client
from genrm_trio.bench.records import BenchError


class MissingProgram(Exception):
    """A program the tool needs is missing and could not be installed."""


def ensure_program(program: str, package: str) -> str:
    """The path of ``program``; when missing, install the Debian ``package`` (``apt-get``,
    which needs root). Also looks in ``/usr/sbin`` and ``/usr/local/sbin``, where Debian puts
    daemons and which not every user's PATH has.

    Blocks (minutes on a fresh machine; run it in a thread from async code). Raises
    :class:`MissingProgram` with the installer's last line when that fails (no root, no apt).
    """
    found = _which(program)
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None:
        raise MissingProgram(f"{program} is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for step in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", package]):
        done = subprocess.run(step, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise MissingProgram(f"{' '.join(step[:2])} failed: {' '.join(tail)}")
    found = _which(program)
    if found is None:
        raise MissingProgram(
            f"apt-get install {package} succeeded but no {program} executable found")
    return found


def _which(program: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/usr/local/sbin"])
    return shutil.which(program, path=path)


async def stop_process(process: trio.Process, grace_s: float) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL and wait again (each wait shielded, so a
    cancelled caller still never leaves a process behind). Returns once it has exited, or
    after the second wait ran out."""
    with trio.move_on_after(grace_s, shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await process.wait()
    if process.returncode is None:
        process.kill()
        with trio.move_on_after(grace_s, shield=True):
            await process.wait()


STARTUP_S = 90.0
STOP_GRACE_S = 10.0


@dataclass
class Proc:
    """A process we started: its pid, base URL once ready, and the trio handle."""

    process: trio.Process
    base_url: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def host_port(self) -> tuple[str, int]:
        hostport = self.base_url.split("://", 1)[1]
        host, _, port = hostport.rpartition(":")
        return host.strip("[]"), int(port)


def free_port() -> int:
    """A free loopback port, for a program that must be told its port before it starts (NeMo
    Gym, llama.cpp servers); the tiny race until it binds is acceptable here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _drain(stream: trio.abc.ReceiveStream, log: Any, ready: Callable[[str], None]) -> None:
    buffer = b""
    async for chunk in stream:
        log.write(chunk)
        log.flush()
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            ready(line.decode(errors="replace"))


async def _wait_healthy(proc: Proc) -> None:
    host, port = proc.host_port
    client = H11Client(host, port)
    try:
        while True:
            if proc.process.returncode is not None:
                raise BenchError(f"process exited with {proc.process.returncode} during startup")
            try:
                answer = await client.get("/health")
                if answer.status == 200:
                    return
            except loadgen.LoadgenError:
                pass
            await trio.sleep(0.05)
    finally:
        await client.aclose()


@asynccontextmanager
async def launch_process(
    cmd: Sequence[str],
    *,
    log_path: Path,
    ready_prefix: str | None = None,
    base_url: str = "",
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> AsyncIterator[Proc]:
    """Start ``cmd``, wait until it is ready, yield it, then SIGTERM it (SIGKILL after a grace).

    Ready means a stdout line starting with ``ready_prefix`` (the URL follows it) or, without a
    prefix, ``GET base_url/health`` answering 200. Blocks up to ``STARTUP_S`` for readiness,
    then raises :class:`BenchError`. The stdout-draining task lives in this context's nursery.
    """
    log = await trio.to_thread.run_sync(_open_log, log_path)
    with log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        process = await trio.lowlevel.open_process(
            list(cmd), stdout=subprocess.PIPE, stderr=log, env=env, cwd=cwd
        )
        proc = Proc(process, base_url)
        ready_event = trio.Event()

        def on_line(line: str) -> None:
            if ready_prefix and not ready_event.is_set() and line.startswith(ready_prefix):
                proc.base_url = line[len(ready_prefix) :].strip()
                ready_event.set()

        try:
            async with trio.open_nursery() as nursery:
                assert process.stdout is not None
                nursery.start_soon(_drain, process.stdout, log, on_line)
                with trio.move_on_after(STARTUP_S) as startup:
                    if ready_prefix:
                        async with trio.open_nursery() as watch:

                            async def exited() -> None:
                                await process.wait()
                                watch.cancel_scope.cancel()

                            watch.start_soon(exited)
                            await ready_event.wait()
                            watch.cancel_scope.cancel()
                    else:
                        await _wait_healthy(proc)
                if startup.cancelled_caught or not proc.base_url or process.returncode is not None:
                    raise BenchError(
                        f"{cmd[0]} did not become ready (exit {process.returncode}); see {log_path}"
                    )
                try:
                    yield proc
                finally:
                    await stop_process(process, STOP_GRACE_S)
                    nursery.cancel_scope.cancel()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.move_on_after(STOP_GRACE_S, shield=True):
                    await process.wait()


def _open_log(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "ab")  # noqa: SIM115 - closed by the caller's with-block
