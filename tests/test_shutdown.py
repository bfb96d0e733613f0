"""The shared shutdown deadline and the socket-level connection abort (server/shutdown.py)."""

from __future__ import annotations

import math
import socket

import pytest
import trio
import trio.testing

from genrm_trio.server.shutdown import ShutdownDeadline, abort_client_connections


async def test_deadline_is_fixed_once_when_shutdown_begins(autojump_clock: trio.abc.Clock) -> None:
    drain = ShutdownDeadline(5.0)
    assert not drain.begun and drain.deadline == math.inf and drain.remaining_s() == math.inf
    await trio.sleep(10)
    drain.begin()
    assert drain.begun and drain.deadline == 15.0
    await trio.sleep(2)
    drain.begin()  # a second begin (lifespan end, Hypercorn's return) starts no new grace
    assert drain.deadline == 15.0 and drain.remaining_s() == 3.0
    drain.expire_now()
    assert drain.deadline == 12.0 and drain.remaining_s() == 0.0
    await trio.sleep(1)
    drain.expire_now()  # never later
    assert drain.deadline == 12.0


async def test_scopes_opened_before_shutdown_follow_the_one_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Sends that started at different moments all end at the deadline: none gets a fresh
    grace of its own."""
    drain = ShutdownDeadline(1.0)
    ended: dict[str, float] = {}

    async def shielded_send(name: str, task_status: trio.TaskStatus[None]) -> None:
        with drain.scope(bound_s=5.0, shield=True) as scope:
            task_status.started()
            await trio.sleep_forever()
        assert scope.cancelled_caught
        ended[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(shielded_send, "early")  # at t=0: its own bound ends it at 5
        await trio.sleep(3)
        await nursery.start(shielded_send, "before")  # at t=3: bound 8, deadline 3 + 2 = 5
        await trio.sleep(1)
        nursery.cancel_scope.cancel()  # the request tasks are cancelled: the shields hold
        drain.begin()  # deadline 4 + 1 = 5
        with trio.CancelScope(shield=True):
            await trio.sleep(0.5)
            await nursery.start(shielded_send, "during")  # opened at 4.5: ends at 5, not 9.5
    assert ended == {"early": 5.0, "before": 5.0, "during": 5.0}


async def test_scope_after_offset_and_expire_now(autojump_clock: trio.abc.Clock) -> None:
    drain = ShutdownDeadline(2.0)
    ended: list[tuple[str, float]] = []

    async def timer(name: str, after_s: float) -> None:
        with drain.scope(after_s=after_s):
            await trio.sleep_forever()
        ended.append((name, trio.current_time()))

    with trio.fail_after(1000):  # virtual seconds: a timer that never ends fails the test
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer, "at deadline", 0.0)
            nursery.start_soon(timer, "cleanup", 0.25)
            await trio.sleep(100)
            assert ended == []  # no deadline before shutdown begins
            drain.begin()  # deadline 102
            await trio.sleep(1)
            drain.expire_now()  # a second signal: deadline 101
    assert sorted(ended) == [("at deadline", 101.0), ("cleanup", 101.25)]


def _connected_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname(), timeout=5.0)
    accepted, _ = listener.accept()
    accepted.settimeout(5.0)
    return client, accepted


def test_abort_breaks_accepted_connections_only() -> None:
    """Connections accepted on the port are shut down; the listener, connections this process
    made to the port as a client, and connections on other ports are left alone."""
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_server(("127.0.0.1", 0)) as other:
        port = listener.getsockname()[1]
        pairs = [_connected_pair(listener) for _ in range(3)]
        other_client, other_accepted = _connected_pair(other)
        try:
            assert abort_client_connections(port) == 3
            for client, accepted in pairs:
                assert client.recv(16) == b""  # the server side's FIN
                with pytest.raises(OSError):
                    accepted.sendall(b"x")  # EPIPE: a blocked writer would wake with this
                client.sendall(b"still open from the client side")
            other_accepted.sendall(b"ok")
            assert other_client.recv(16) == b"ok"
            late_client, late_accepted = _connected_pair(listener)  # still listening
            late_accepted.sendall(b"hi")
            assert late_client.recv(16) == b"hi"
            late_client.close()
            late_accepted.close()
        finally:
            for sock in (other_client, other_accepted, *(s for pair in pairs for s in pair)):
                sock.close()


async def test_abort_wakes_a_writer_blocked_inside_a_shield() -> None:
    """What Hypercorn's unbounded shielded ``send_all`` needs: a peer that never reads fills
    the buffers, and no cancellation reaches the writer; the abort does."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with listener:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
        client.connect(("127.0.0.1", port))
        with client:
            accepted = await listener.accept()
            outcome: list[str] = []
            woke = trio.Event()
            request_scope = trio.CancelScope()

            async def writer() -> None:
                with request_scope, trio.CancelScope(shield=True):
                    try:
                        await accepted.send_all(b"x" * (64 * 1024 * 1024))
                    except trio.BrokenResourceError:
                        outcome.append("broken")
                    woke.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                try:
                    await trio.testing.wait_all_tasks_blocked()
                    request_scope.cancel()
                    await trio.testing.wait_all_tasks_blocked()
                    assert outcome == []  # cancelled, yet still blocked in the shield
                    assert abort_client_connections(port) == 1
                    with trio.move_on_after(5.0):  # real sockets: the wake-up is immediate
                        await woke.wait()
                    assert outcome == ["broken"]
                finally:
                    client.close()  # a failed abort must not leave the writer blocked
            await accepted.aclose()
