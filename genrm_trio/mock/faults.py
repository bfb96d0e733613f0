"""The mock judge's faults: every way a judge call can go wrong, in one place.

:class:`Fault` names them; the text faults (a 200 whose verdict is garbage, poisoned, cut) are
the texts below, which :mod:`genrm_trio.mock.verdicts` answers with; the wire faults (statuses,
resets, truncated and trickled bodies, a hang) are sent by :func:`answer_with_fault`. The
random mix is :data:`RANDOM_MIX`. A new fault: a member of :class:`Fault`, then its text or its
branch in :func:`answer_with_fault`.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Callable
from types import MappingProxyType

import h11
import trio

from genrm_trio.mock.http import RECV_BYTES, error_body, seconds_header, send_response

# Small pieces so every single read succeeds quickly: only a whole-call deadline stops a trickle.
TRICKLE_PIECE_BYTES = 4


class Fault(enum.StrEnum):
    """One way a judge call can go wrong (``NONE``: it does not).

    On the wire: ``503``/``408`` JSON error statuses (408 closes the connection); ``429`` with a
    ``Retry-After`` header; ``reset`` closes the socket with RST after reading the request;
    ``truncated`` declares a ``Content-Length`` larger than the bytes sent, then closes;
    ``cut_chunked`` stops a chunked body mid-way, then closes; ``trickle`` sends a valid body a
    few bytes at a time, ``trickle_interval_s`` apart; ``hang`` never answers (until the client
    leaves or the server stops); ``garbage`` is a 200 whose text has no JSON verdict; ``empty``
    a 200 with blank text; ``nonfinite`` a 200 whose verdict has ``1e999`` scores;
    ``extreme`` finite scores near the float limit with opposite signs; ``wrong_types`` a
    verdict of lists and words; ``out_of_range`` scores and ranking off their scales;
    ``incomplete`` a 200 with ``"status": "incomplete"`` and a cut verdict.
    """

    NONE = "none"
    HTTP_503 = "503"
    HTTP_429 = "429"
    HTTP_408 = "408"
    RESET = "reset"
    TRUNCATED = "truncated"
    CUT_CHUNKED = "cut_chunked"
    TRICKLE = "trickle"
    HANG = "hang"
    GARBAGE = "garbage"
    EMPTY = "empty"
    NONFINITE = "nonfinite"
    EXTREME = "extreme"
    WRONG_TYPES = "wrong_types"
    OUT_OF_RANGE = "out_of_range"
    INCOMPLETE = "incomplete"


# The random mix (fault_rate > 0 with fault "none") leaves out the two faults that only a
# client-side deadline ends; ask for them by name.
RANDOM_MIX: tuple[Fault, ...] = tuple(
    f for f in Fault if f not in (Fault.NONE, Fault.HANG, Fault.TRICKLE)
)


GARBAGE_TEXT = (
    "Both responses have merits. After weighing helpfulness and accuracy I would rather not "
    "commit to scores for this pair."
)


NONFINITE_TEXT = '```json\n{"score_1": 1e999, "score_2": -1e999, "ranking": 3.5}\n```'


# Poisoned verdicts that parse as JSON: each must be refused, never summed.
POISON_TEXT = MappingProxyType({
    "extreme": '{"score_1": 1.7e308, "score_2": -1.7e308, "ranking": 1}',
    "wrong_types": '{"score_1": [4], "score_2": {"v": 2}, "ranking": "high"}',
    "out_of_range": '{"score_1": 9, "score_2": -3, "ranking": 0}',
})


async def answer_with_fault(
    stream: trio.SocketStream,
    conn: h11.Connection,
    fault: Fault,
    body_of: Callable[[], bytes],
    *,
    retry_after_s: float,
    trickle_interval_s: float,
) -> bool:
    """Answer one judge call with ``fault`` (``NONE``: a 200 with ``body_of()``, which holds a
    text fault already); False when the connection must end here. ``retry_after_s`` and
    ``trickle_interval_s`` come from :class:`~genrm_trio.mock.settings.MockJudgeSettings`."""
    if fault is Fault.HTTP_503:
        await send_response(stream, conn, 503, error_body(503, "mock judge overloaded"))
        return True
    if fault is Fault.HTTP_429:
        retry_after = seconds_header(retry_after_s)
        await send_response(
            stream,
            conn,
            429,
            error_body(429, "mock judge rate limit"),
            extra=[(b"retry-after", retry_after)],
        )
        return True
    if fault is Fault.HTTP_408:
        await send_response(stream, conn, 408, error_body(408, "mock judge timeout"), close=True)
        return False
    if fault is Fault.RESET:
        # SO_LINGER with a zero timeout turns close() into an RST.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False
    if fault is Fault.HANG:
        # Keep the call (and its capacity slot) until the client leaves.
        while await stream.receive_some(RECV_BYTES):
            pass
        return False
    body = body_of()
    if fault is Fault.TRUNCATED:
        await send_partial(stream, conn, body, chunked=False)
        return False
    if fault is Fault.CUT_CHUNKED:
        await send_partial(stream, conn, body, chunked=True)
        return False
    if fault is Fault.TRICKLE:
        return await send_trickle(stream, conn, body, trickle_interval_s)
    await send_response(stream, conn, 200, body)
    return True


async def send_partial(
    stream: trio.SocketStream, conn: h11.Connection, body: bytes, *, chunked: bool
) -> None:
    """Headers and the first half of ``body``, never the end of the message."""
    framing = (
        (b"transfer-encoding", b"chunked")
        if chunked
        else (b"content-length", str(len(body)).encode())
    )
    headers = [(b"content-type", b"application/json"), framing]
    data = conn.send(h11.Response(status_code=200, headers=headers))
    data += conn.send(h11.Data(data=body[: len(body) // 2]))
    await stream.send_all(data)

async def send_trickle(
    stream: trio.SocketStream, conn: h11.Connection, body: bytes, interval_s: float
) -> bool:
    """Send ``body`` a few bytes per ``interval_s``; False if the client left first.

    A watcher notices the client leaving (its deadline fired) so the call, and its capacity
    slot, end at once rather than at the next failed send.
    """
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    client_gone = False

    async def watch_client(cancel_scope: trio.CancelScope) -> None:
        nonlocal client_gone
        try:
            # Bytes a keep-alive client sends meanwhile are kept for h11's next cycle.
            while data := await stream.receive_some(RECV_BYTES):
                conn.receive_data(data)
        except trio.BrokenResourceError:
            pass
        client_gone = True
        cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_client, nursery.cancel_scope)
        try:
            await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
            for start in range(0, len(body), TRICKLE_PIECE_BYTES):
                await trio.sleep(interval_s)
                piece = body[start : start + TRICKLE_PIECE_BYTES]
                await stream.send_all(conn.send(h11.Data(data=piece)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
        except trio.BrokenResourceError:
            client_gone = True
        nursery.cancel_scope.cancel()
    return not client_gone
