"""The soak's leak gate (``leak_checks``) on fixed snapshots, and the descriptor census it reads
(``fd_census``) on this test's own process with sockets it opens on 127.0.0.1."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from genrm_trio.bench.cases.soak import CONNECTION_SLACK, IdleSnapshot, leak_checks
from genrm_trio.bench.descriptors import fd_census, parse_tcp_table

IDLE_FDS = {"tcp listen LISTEN": 1, "pipe": 4, "anon_inode:eventpoll": 1, "unix": 2,
            "device": 1, "file": 3}
IDLE_COHORTS = {"active_cohorts": 0, "collecting": 0, "evaluating": 0, "waiters": 0,
                "active_bytes": 0}


def _after(fds: dict[str, int] | None = None, cohorts: dict[str, int] | None = None,
           judge: int = 0) -> IdleSnapshot:
    return IdleSnapshot({**IDLE_FDS, **(fds or {})}, {**IDLE_COHORTS, **(cohorts or {})},
                        judge)


BEFORE = IdleSnapshot(IDLE_FDS, IDLE_COHORTS)


def test_a_process_that_was_busy_but_holds_nothing_once_idle_passes() -> None:
    # The judge pool kept 300 connections (its idle cap is 1,024): bounded by design, and all
    # of them are the pool's. One connection a moment from its close is within the slack.
    after = _after({"tcp judge ESTABLISHED": 300, "tcp accepted ESTABLISHED": 1}, judge=300)
    figures, failed, report = leak_checks(BEFORE, after)
    assert failed == [], failed
    assert figures["idle_fds_after_minus_judge"] == sum(IDLE_FDS.values()) + 1
    assert "fds tcp accepted ESTABLISHED: before 0, after 1 (allowed 2)" in report
    assert "cohorts waiters: before 0, after 0 (allowed 0)" in report


@pytest.mark.parametrize(("fds", "cohorts", "judge", "expected"), [
    # CLOSE-WAIT sockets still held after the keep-alive timeout: the server never closed them.
    ({"tcp accepted CLOSE_WAIT": 300}, {}, 0, "300 more 'tcp accepted CLOSE_WAIT'"),
    ({"tcp accepted ESTABLISHED": CONNECTION_SLACK + 1}, {}, 0,
     "3 more 'tcp accepted ESTABLISHED'"),
    ({"file": 3 + 50}, {}, 0, "50 more 'file'"),
    ({"pipe": 4 + 40}, {}, 0, "40 more 'pipe'"),
    # Judge sockets the pool does not know of (it says 10, the process holds 200).
    ({"tcp judge CLOSE_WAIT": 190, "tcp judge ESTABLISHED": 10}, {}, 10, "200 judge sockets"),
    ({}, {"active_cohorts": 1}, 0, "cohorts: active_cohorts 0"),
    ({}, {"waiters": 3}, 0, "cohorts: waiters 0"),
    ({}, {"active_bytes": 4096}, 0, "cohorts: active_bytes 0"),
])
def test_a_leak_of_descriptors_connections_or_cohorts_fails(
    fds: dict[str, int], cohorts: dict[str, int], judge: int, expected: str,
) -> None:
    _, failed, _ = leak_checks(BEFORE, _after(fds, cohorts, judge))
    assert len(failed) == 1 and failed[0].startswith(expected), failed


def test_fewer_descriptors_than_before_pass() -> None:
    before = IdleSnapshot({**IDLE_FDS, "tcp accepted CLOSE_WAIT": 5}, IDLE_COHORTS)
    _, failed, _ = leak_checks(before, _after())
    assert failed == []


def test_parse_tcp_table_reads_ports_states_and_skips_unowned_rows() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0 0 "
        "4242 1 0000000000000000 100 0 0 10 0\n"
        "   1: 0100007F:1F90 0100007F:C350 08 00000000:00000000 00:00000000 00000000  0 0 "
        "4243 1 0000000000000000 20 4 30 10 -1\n"
        "   2: 0100007F:A00D 0100007F:C340 06 00000000:00000000 03:00000C38 00000000  0 0 "
        "0 3 0000000000000000\n")
    assert parse_tcp_table(text) == {4242: (8080, 0, "LISTEN"),
                                     4243: (8080, 50000, "CLOSE_WAIT")}


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def test_fd_census_classifies_a_real_process_sockets_by_role_and_state(
    sockets: list[socket.socket],
) -> None:
    pid = os.getpid()
    base = fd_census(pid)

    def census() -> dict[str, int]:
        now = fd_census(pid)
        return {k: now[k] - base.get(k, 0) for k in now if now[k] != base.get(k, 0)}

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sockets.append(listener)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # a "judge" this process calls
    sockets.append(other)
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    judge_port = other.getsockname()[1]
    clients = []
    for _ in range(3):
        client = socket.create_connection(listener.getsockname())
        sockets.append(client)
        clients.append(client)
    accepted = [listener.accept()[0] for _ in clients]
    sockets.extend(accepted)
    outbound = socket.create_connection(("127.0.0.1", judge_port))
    sockets.append(outbound)
    sockets.append(other.accept()[0])
    # The peer of one accepted connection closes: the accepted side is in CLOSE-WAIT until
    # this process closes it.
    clients[0].close()
    read_r, read_w = os.pipe()
    try:
        got = census()
        assert got.get("tcp listen LISTEN") == 2
        assert got.get("tcp accepted ESTABLISHED") == 2 + 1  # two of ours, the judge's side
        assert got.get("tcp accepted CLOSE_WAIT") == 1
        # Our clients' sides (their remote port is our listener's) are outbound here.
        assert got.get("tcp outbound ESTABLISHED") == 2 + 1
        assert got.get("tcp outbound FIN_WAIT2", 0) == 0  # closed: no descriptor
        assert got.get("pipe") == 2
        named = fd_census(pid, {judge_port: "judge"})
        assert named["tcp judge ESTABLISHED"] == 1
        accepted[0].close()
        sockets.remove(accepted[0])
        assert census().get("tcp accepted CLOSE_WAIT", 0) == 0
    finally:
        os.close(read_r)
        os.close(read_w)
