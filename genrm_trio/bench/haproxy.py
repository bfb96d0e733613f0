"""HAProxy in front of genrm-trio replicas, on loopback: the shipped ``configs/haproxy.cfg``.

Used by the ``scaleout`` bench preset and ``tests/test_haproxy.py``; an operator runs the
shipped file directly (README, "Running N replicas"). Nothing here imports the server: HAProxy
and the replicas are processes spoken to over HTTP.

::

    open_haproxy(replicas, max_request_bytes=...)   async context manager
      +-- derive_config(shipped text, n)           one "server" line per replica
      +-- a listening socket on 127.0.0.1:0        handed to HAProxy as "fd@N" (no port race)
      +-- haproxy -dMglobal -db -f derived.cfg     until the context exits: SIGTERM by pid,
                                                   SIGKILL after a grace period

The shipped file takes its addresses, agent ports and buffer size from environment variables
with defaults (``"${NAME-default}"``, expanded by HAProxy itself), so the derived file differs
from it only in the number of ``server`` lines, in a ``stats socket`` (HAProxy's runtime API,
read by :meth:`Haproxy.servers`: the rolling restart waits on it) and, when the replicas have
no probe port, in ``no-agent-check`` on each server line.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import trio

from genrm_trio.bench.processes import MissingProgram, ensure_program, stop_process

__all__ = [
    "REPLICA_HEADER",
    "GLOBAL_POOL_ARGS",
    "BACKEND",
    "ServerState",
    "HaproxyError",
    "Haproxy",
    "bufsize_for",
    "derive_config",
    "ensure_haproxy",
    "open_haproxy",
    "shipped_config",
]

REPLICA_HEADER = "x-genrm-replica"
"""The response header the shipped config sets to the name of the replica that answered."""

GLOBAL_POOL_ARGS = ("-dMglobal",)
"""HAProxy's process-wide cache of freed memory objects (HAProxy 2.6 and later). The shipped
config's buffers are ``max_request_bytes`` large (16 MiB by default) and HAProxy takes several
per request. Its per-thread caches are smaller than one such buffer, and Debian's build has the
shared cache off (``haproxy -dMhelp`` lists ``no-global`` as set), so every freed buffer went
back to glibc, which unmapped it and mapped and zeroed fresh pages for the next one: 15 to 25 %
of HAProxy's CPU per ``/verify`` (``bench/haproxy_pools.py``). With the shared cache, freed
buffers are reused; the memory kept is what the largest burst of uploads touched."""
_HEADER_ROOM_BYTES = 64 * 1024
_STOP_GRACE_S = 5.0
_READY_S = 30.0
_SERVER_LINE = re.compile(r'^(\s*)server r\d+ "\$\{GENRM_REPLICA_\d+-[^}]*\}"(.*)$', re.M)
_PROBE_PORT = re.compile(r'"\$\{GENRM_PROBE_PORT_\d+-[^}]*\}"')


BACKEND = "genrm_replicas"
"""The shipped config's backend."""

_DRAIN_ADMIN_BITS = 0x08 | 0x10  # SRV_ADMF_FDRAIN, SRV_ADMF_IDRAIN (the agent sets FDRAIN)
_MAINT_ADMIN_BITS = 0x01 | 0x02 | 0x04 | 0x20 | 0x40


class HaproxyError(Exception):
    """HAProxy is missing and could not be installed, or did not start."""


@dataclass(frozen=True)
class ServerState:
    """One server line as HAProxy's runtime API shows it (``show servers state``)."""

    name: str
    operational: int  # srv_op_state: 0 stopped (down), 1 starting, 2 running, 3 stopping
    admin: int  # srv_admin_state bits (drain: 0x08 or 0x10)
    weight: int  # srv_uweight, the current weight (0 while in DRAIN)

    @property
    def up(self) -> bool:
        return self.operational == 2

    @property
    def draining(self) -> bool:
        return bool(self.admin & _DRAIN_ADMIN_BITS)

    @property
    def ready(self) -> bool:
        """Up and taking new groups: neither in DRAIN nor in maintenance."""
        return self.up and not self.admin & (_DRAIN_ADMIN_BITS | _MAINT_ADMIN_BITS)


@dataclass(frozen=True)
class Haproxy:
    """A running HAProxy: its base URL, the replica names in order (``r1``, ``r2``, ...), the
    process (ended by :func:`open_haproxy`, never by its user) and its runtime API socket."""

    url: str
    names: tuple[str, ...]
    process: trio.Process
    admin_socket: Path | None = None

    async def command(self, line: str) -> str:
        """One command on HAProxy's runtime API (``show servers state``, ``show table ...``);
        its whole answer. Raises :class:`HaproxyError` without a socket."""
        if self.admin_socket is None:
            raise HaproxyError("this HAProxy has no stats socket")
        stream = await trio.open_unix_socket(str(self.admin_socket))
        async with stream:
            await stream.send_all(line.encode() + b"\n")
            chunks = []
            while chunk := await stream.receive_some(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    async def servers(self) -> dict[str, ServerState]:
        """Each server's state in the shipped backend, by name."""
        return parse_servers_state(await self.command(f"show servers state {BACKEND}"))

    async def wait_until(self, name: str, check: Callable[[ServerState], bool],
                         limit_s: float = 30.0) -> ServerState:
        """Poll the runtime API until server ``name`` passes ``check``; raises
        :class:`HaproxyError` after ``limit_s`` (a hang guard)."""
        with trio.move_on_after(limit_s):
            while True:
                state = (await self.servers())[name]
                if check(state):
                    return state
                await trio.sleep(0.05)
        raise HaproxyError(f"server {name} did not reach the state waited for in {limit_s} s: "
                           f"{(await self.servers())[name]}")


def parse_servers_state(text: str) -> dict[str, ServerState]:
    """``show servers state``'s answer: a version line, a ``#`` header naming the fields, then
    one line per server."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = next((line for line in lines if line.startswith("#")), None)
    if header is None:
        raise HaproxyError(f"unexpected answer to show servers state: {text[:200]!r}")
    fields = header.lstrip("# ").split()
    out: dict[str, ServerState] = {}
    for line in lines:
        if line.startswith("#") or len(line.split()) < 8:
            continue
        row = dict(zip(fields, line.split(), strict=False))
        out[row["srv_name"]] = ServerState(row["srv_name"], int(row["srv_op_state"]),
                                           int(row["srv_admin_state"]), int(row["srv_uweight"]))
    return out


def shipped_config() -> Path:
    """``configs/haproxy.cfg`` of this checkout (or of the current directory)."""
    here = Path(__file__).resolve().parents[2] / "configs" / "haproxy.cfg"
    return here if here.exists() else Path.cwd() / "configs" / "haproxy.cfg"


def ensure_haproxy() -> str:
    """The ``haproxy`` executable; when missing, install the Debian package (``apt-get``).

    Blocks (minutes on a fresh machine; run it in a thread from async code). Raises
    :class:`HaproxyError` with the installer's last line when that fails (no root, no apt).
    """
    try:
        return ensure_program("haproxy", "haproxy")
    except MissingProgram as exc:
        raise HaproxyError(str(exc)) from exc


def bufsize_for(max_request_bytes: int) -> int:
    """HAProxy's ``tune.bufsize`` for bodies up to ``max_request_bytes``: the body plus room for
    the request headers, a multiple of 16."""
    return (max_request_bytes + _HEADER_ROOM_BYTES + 15) // 16 * 16


def derive_config(text: str, replicas: int, *, agent: bool = True,
                  admin_socket: Path | None = None) -> str:
    """The shipped config with exactly ``replicas`` server lines ``r1 .. rN``, each reading its
    address from ``GENRM_REPLICA_<i>`` and its agent port from ``GENRM_PROBE_PORT_<i>`` like
    the shipped ones; without ``agent``, each line ends in ``no-agent-check``; with
    ``admin_socket``, a ``stats socket`` there (admin level). Raises ``ValueError`` when the
    text has no such line to copy."""
    if replicas < 1:
        raise ValueError("at least one replica")
    lines = list(_SERVER_LINE.finditer(text))
    if not lines:
        raise ValueError('no `server rN "${GENRM_REPLICA_N-...}"` line in the HAProxy config')
    indent, options = lines[0].group(1), lines[0].group(2)
    if not agent:
        options += " no-agent-check"
    block = "\n".join(
        f'{indent}server r{i} "${{GENRM_REPLICA_{i}-127.0.0.1:{8000 + i}}}"'
        + _PROBE_PORT.sub(f'"${{GENRM_PROBE_PORT_{i}-{9000 + i}}}"', options)
        for i in range(1, replicas + 1)
    )
    start, end = lines[0].start(), lines[-1].end()
    out = text[:start] + block + text[end:]
    if admin_socket is not None:
        out, found = re.subn(r"^global\n", f"global\n    stats socket {admin_socket} mode 600 "
                             "level admin\n", out, count=1, flags=re.M)
        if not found:
            raise ValueError("no global section in the HAProxy config")
    return out


@asynccontextmanager
async def open_haproxy(
    replicas: Sequence[str],
    *,
    max_request_bytes: int,
    config: Path | None = None,
    log_path: Path | None = None,
    args: Sequence[str] = GLOBAL_POOL_ARGS,
    probe_ports: Sequence[int] | None = None,
) -> AsyncIterator[Haproxy]:
    """Run HAProxy with the shipped config in front of ``replicas`` (``host:port`` each, in
    ring order ``r1, r2, ...``), listening on a fresh loopback port. ``args`` go on HAProxy's
    command line before the config (by default what the README runs it with).
    ``probe_ports`` (one per replica, on the replica's host) are the agent checks' ports;
    without them the agent check is off. The runtime API listens on a socket of its own
    (:meth:`Haproxy.servers`).

    Blocks until a ``GET /readyz`` through HAProxy answers 200 (the replicas must be serving),
    at most 30 s, else raises :class:`HaproxyError`. On exit HAProxy gets SIGTERM (by pid),
    then SIGKILL after a grace period; nothing it started outlives the context.
    """
    exe = await trio.to_thread.run_sync(ensure_haproxy)
    with tempfile.TemporaryDirectory(prefix="genrm-haproxy-") as tmp:
        cfg_path = Path(tmp) / "haproxy.cfg"
        admin_socket = Path(tmp) / "admin.sock"
        if probe_ports is not None and len(probe_ports) != len(replicas):
            raise ValueError("one probe port per replica")
        log = await trio.to_thread.run_sync(
            _prepare, config or shipped_config(), cfg_path, len(replicas), log_path,
            probe_ports is not None, admin_socket)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(4096)
        port = listener.getsockname()[1]
        env = dict(os.environ)
        env["GENRM_HAPROXY_BIND"] = f"fd@{listener.fileno()}"
        env["GENRM_HAPROXY_BUFSIZE"] = str(bufsize_for(max_request_bytes))
        for i, address in enumerate(replicas, start=1):
            env[f"GENRM_REPLICA_{i}"] = address
            if probe_ports is not None:
                env[f"GENRM_PROBE_PORT_{i}"] = str(probe_ports[i - 1])
        try:
            process = await trio.lowlevel.open_process(
                [exe, *args, "-db", "-f", str(cfg_path)], env=env, pass_fds=(listener.fileno(),),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )
        finally:
            listener.close()  # HAProxy holds its own copy
            if not isinstance(log, int):
                log.close()
        proxy = Haproxy(f"http://127.0.0.1:{port}",
                        tuple(f"r{i}" for i in range(1, len(replicas) + 1)), process,
                        admin_socket)
        try:
            await _wait_ready(proxy)
            yield proxy
        finally:
            await stop_process(process, _STOP_GRACE_S)


def _prepare(config: Path, cfg_path: Path, replicas: int, log_path: Path | None,
             agent: bool, admin_socket: Path) -> BinaryIO | int:
    """Blocking: write the derived config; open the log (or DEVNULL) for HAProxy's output."""
    cfg_path.write_text(derive_config(config.read_text(encoding="utf-8"), replicas, agent=agent,
                                      admin_socket=admin_socket), encoding="utf-8")
    if log_path is None:
        return subprocess.DEVNULL
    return open(log_path, "ab")  # noqa: SIM115 - closed by open_haproxy once HAProxy has it


async def _wait_ready(proxy: Haproxy) -> None:
    port = int(proxy.url.rsplit(":", 1)[1])
    request = b"GET /readyz HTTP/1.1\r\nHost: haproxy\r\nConnection: close\r\n\r\n"
    with trio.move_on_after(_READY_S):
        while proxy.process.returncode is None:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    await stream.send_all(request)
                    head = await stream.receive_some(4096)
                if head.startswith(b"HTTP/1.1 200"):
                    return
            except (OSError, trio.BrokenResourceError):
                pass
            await trio.sleep(0.05)
    raise HaproxyError(
        f"haproxy did not become ready (exit code {proxy.process.returncode})"
    )
