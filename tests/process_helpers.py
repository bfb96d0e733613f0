"""Real-process helpers: start ``genrm-trio serve`` as a subprocess on 127.0.0.1 port 0, talk to
it over raw sockets, stop it by PID."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import h11
import pytest
import trio

from tests.server_helpers import read_answer

REPO = Path(__file__).resolve().parent.parent

T = TypeVar("T")

ABANDON_GRACE_S = 10.0
"""How long past its own deadline an asyncio run may take to unwind before the test stops
waiting for its thread (:func:`run_asyncio`)."""


async def run_asyncio(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Run a trainer's asyncio code (``coro``) on a fresh asyncio loop in a worker thread,
    bounded by ``timeout_s``: asyncio's own deadline cancels its tasks, so a deadlock ends the
    test with ``TimeoutError`` at ``timeout_s`` and the thread finishes; should the asyncio
    code not unwind, trio's deadline :data:`ABANDON_GRACE_S` later gives the thread up
    (``abandon_on_cancel``) and fails the test with ``TooSlowError``, instead of waiting for
    whatever deadline the server has."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    with trio.fail_after(timeout_s + ABANDON_GRACE_S):
        return await trio.to_thread.run_sync(asyncio.run, bounded(), abandon_on_cancel=True)


def raise_fd_limit(needed: int) -> None:
    """Raise this process's soft open-files limit to ``needed`` (capped by the hard limit);
    child processes inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


class ServeProcess:
    """A running ``genrm-trio serve`` child: its process, base URL, host, port and log file."""

    def __init__(self, proc: trio.Process, url: str, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host = host
        self.port = int(port)
        self.log_path = log_path

    def log_tail(self, chars: int = 3000) -> str:
        return _tail(self.log_path, chars)


@asynccontextmanager
async def serve_process(
    settings: list[str], log_path: Path, *, judge_urls: tuple[str, ...] = (),
    python_path: tuple[Path, ...] = (), extra_env: dict[str, str] | None = None,
) -> AsyncIterator[ServeProcess]:
    """Start ``genrm-trio serve --port 0`` with ``--set`` items ``settings``; yield once it
    prints its ``listening on`` line. ``python_path`` is put in front of ``PYTHONPATH`` (for a
    judge plugin module); ``extra_env`` adds environment variables (a preloaded library). On
    exit the process is killed (SIGKILL) by PID if it is still running: the test decides how
    it should end."""
    args = [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0"]
    for item in settings:
        args += ["--set", item]
    for url in judge_urls:
        args += ["--judge-url", url]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, python_path), *filter(None, [env.get("PYTHONPATH")])])
    with log_path.open("ab") as log_file:  # noqa: ASYNC230 - before any task runs
        proc = await trio.lowlevel.open_process(
            args, stdout=subprocess.PIPE, stderr=log_file, cwd=REPO, env=env)
    assert proc.stdout is not None
    try:
        with trio.fail_after(30):
            seen = b""
            while b"listening on http://" not in seen or not seen.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, f"serve exited early: {_tail(log_path)}"
                seen += chunk
        url = seen.decode().split("listening on ", 1)[1].split()[0]
        yield ServeProcess(proc, url, log_path)
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
        await proc.stdout.aclose()


async def http_call(
    host: str, port: int, method: str, path: str, body: bytes = b"",
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection (raw h11): status, headers, body. Status 0 when the
    server closed the connection without an answer."""
    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        headers = [("Host", host), ("Content-Length", str(len(body))),
                   ("Content-Type", "application/json"), ("Connection", "close")]
        await stream.send_all(conn.send(h11.Request(method=method, target=path, headers=headers))
                              + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        answer = await read_answer(stream, conn)
        return answer if answer is not None else (0, {}, b"")


async def get_json(host: str, port: int, path: str) -> Any:
    status, _, raw = await http_call(host, port, "GET", path)
    assert status == 200, (status, raw[:500])
    return json.loads(raw)


def require_program(ensure: Callable[[], str], errors: type[Exception], package: str) -> str:
    """The path ``ensure()`` returns (it installs the Debian ``package`` when missing), or the
    test fails, naming the package: these tests run in CI, which installs it."""
    try:
        return ensure()
    except errors as exc:
        pytest.fail(f"{package} is needed (apt-get install -y {package}): {exc}")


def wait_for_line(stream: Any, needle: str, timeout_s: float = 30.0) -> str:
    """Read a child's text stream (in a thread, bounded) until a line contains ``needle``;
    fail the test when none does within ``timeout_s``."""
    found: list[str] = []

    def reader() -> None:
        for line in stream:
            if needle in line:
                found.append(line)
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert found, f"no line with {needle!r} within {timeout_s} s"
    return found[0]


async def mock_judge(nursery: trio.Nursery, log: Path) -> str:
    """Start ``genrm-trio mock-judge`` on 127.0.0.1 port 0 (stderr to ``log``), owned by
    ``nursery`` (killed and reaped when it is cancelled); returns its URL."""
    with log.open("ab") as err:  # noqa: ASYNC230 - before any task runs
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "genrm_trio.cli", "mock-judge", "--port", "0"],
            stdout=subprocess.PIPE, stderr=err, cwd=REPO)
    assert proc.stdout is not None
    line = b""
    with trio.fail_after(30):
        while not line.endswith(b"\n"):
            chunk = await proc.stdout.receive_some(1)
            assert chunk, "the mock judge exited before listening"
            line += chunk

    async def owner() -> None:
        try:
            await trio.sleep_forever()
        finally:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()

    nursery.start_soon(owner)
    return line.decode().strip().rsplit(" ", 1)[1]


def completed_cohort_rewards(lines: list[dict[str, Any]], n: int) -> dict[str, list[float]]:
    """Completed cohorts' rewards by slot, from the server's JSON cohort log lines, by group id;
    every completed cohort must have had all ``n`` members."""
    out = {}
    for x in lines:
        if x["kind"] == "completed":
            assert (x["members"], x["size"]) == (n, n)
            group = re.search(r"group '([^']+)'", x["key"]).group(1)  # type: ignore[union-attr]
            out[group] = json.loads(re.search(r"rewards (\[[^\]]*\])", x["msg"]).group(1))  # type: ignore[union-attr]
    return out
