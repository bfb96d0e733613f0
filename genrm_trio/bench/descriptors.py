"""A census of a process's open file descriptors by kind, and of its TCP sockets by role and
state, from ``/proc/<pid>/fd`` and ``/proc/<pid>/net/tcp{,6}`` (Linux; the bench reads
``/proc`` by hand already, :func:`genrm_trio.bench.loadgen.read_proc_stats`).

Each descriptor gets one class: ``tcp <role> <STATE>`` for a TCP socket, where the role is
``listen`` (a listening socket), ``accepted`` (its local port is one the process listens on: a
client's connection to it), a name from ``peers`` (its remote port is that peer's: ``judge``)
or ``outbound``; ``unix``, ``udp``, ``socket`` (another socket), ``pipe``,
``anon_inode:<name>`` (``eventpoll``, ``eventfd``...), ``device`` (``/dev/...``) or ``file``.
A descriptor closed while it is read is left out. Nothing here imports the server.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping

__all__ = ["TCP_STATES", "close_wait_count", "fd_census", "parse_tcp_table"]

TCP_STATES: Mapping[int, str] = {
    1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
    6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING",
    12: "NEW_SYN_RECV",
}
"""The kernel's TCP state numbers (the ``st`` column of ``/proc/net/tcp``, hex)."""


def parse_tcp_table(text: str) -> dict[int, tuple[int, int, str]]:
    """``/proc/net/tcp`` (or ``tcp6``) text as ``{inode: (local port, remote port, state)}``;
    rows of inode 0 (TIME_WAIT and other sockets no descriptor owns) are left out. Pure."""
    out: dict[int, tuple[int, int, str]] = {}
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10:
            continue
        inode = int(cols[9])
        if inode == 0:
            continue
        local_port = int(cols[1].rsplit(":", 1)[1], 16)
        remote_port = int(cols[2].rsplit(":", 1)[1], 16)
        state = TCP_STATES.get(int(cols[3], 16), f"state{cols[3]}")
        out[inode] = (local_port, remote_port, state)
    return out


def _inodes(path: str) -> set[int]:
    """The inodes of a ``/proc/net`` table (``unix``: 7th column; ``udp``: 10th); empty when
    it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return set()
    col = 6 if path.endswith("unix") else 9
    return {int(c[col]) for c in (line.split() for line in lines) if len(c) > col}


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return ""


def close_wait_count(port: int) -> int:
    """This machine's sockets in CLOSE-WAIT whose local port is ``port``: for a server's port,
    connections their clients closed that the server still holds. Read from
    ``/proc/net/tcp`` and ``tcp6`` (0 where they cannot be read); two small procfs reads."""
    return sum(
        1
        for table in ("/proc/net/tcp", "/proc/net/tcp6")
        for local, _, state in parse_tcp_table(_read(table)).values()
        if local == port and state == "CLOSE_WAIT"
    )


def fd_census(pid: int, peers: Mapping[int, str] | None = None) -> Counter[str]:
    """How many descriptors ``pid`` has open, by class (module docstring); ``peers`` names
    outbound connections by their remote port (``{judge_port: "judge"}``). Blocks briefly
    (procfs reads)."""
    peers = peers or {}
    fd_dir = f"/proc/{pid}/fd"
    targets: list[str] = []
    for name in os.listdir(fd_dir):
        try:
            targets.append(os.readlink(f"{fd_dir}/{name}"))
        except OSError:  # closed meanwhile
            continue
    tcp = parse_tcp_table(_read(f"/proc/{pid}/net/tcp"))
    tcp.update(parse_tcp_table(_read(f"/proc/{pid}/net/tcp6")))
    socket_inodes = {int(t[8:-1]) for t in targets if t.startswith("socket:[")}
    listening = {tcp[i][0] for i in socket_inodes if i in tcp and tcp[i][2] == "LISTEN"}
    unix = udp = set[int]()
    if socket_inodes - tcp.keys():
        unix = _inodes(f"/proc/{pid}/net/unix")
        udp = _inodes(f"/proc/{pid}/net/udp") | _inodes(f"/proc/{pid}/net/udp6")
    census: Counter[str] = Counter()
    for target in targets:
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in tcp:
                local, remote, state = tcp[inode]
                role = ("listen" if state == "LISTEN" else "accepted" if local in listening
                        else peers.get(remote, "outbound"))
                census[f"tcp {role} {state}"] += 1
            else:
                census["unix" if inode in unix else "udp" if inode in udp else "socket"] += 1
        elif target.startswith("pipe:"):
            census["pipe"] += 1
        elif target.startswith("anon_inode:"):
            census["anon_inode:" + target[11:].strip("[]")] += 1
        elif target.startswith("/dev/"):
            census["device"] += 1
        else:
            census["file"] += 1
    return census
