"""The mock judge's HTTP plumbing (h11 over raw trio sockets): its routes, one request as read,
JSON and error bodies, and :func:`send_response`."""

from __future__ import annotations

import h11
import msgspec
import trio

RESPONSES_PATH = "/v1/responses"
CHAT_PATH = "/v1/chat/completions"
JUDGE_PATHS = (RESPONSES_PATH, CHAT_PATH)
RECV_BYTES = 65536
MAX_BODY_BYTES = 64 * 1024 * 1024
json_encode = msgspec.json.Encoder().encode
json_decode = msgspec.json.Decoder().decode


def error_body(status: int, message: str) -> bytes:
    return json_encode({"error": {"message": message, "type": "mock_judge", "code": status}})


def seconds_header(value: float) -> bytes:
    return (str(int(value)) if value == int(value) else f"{value:g}").encode()


class Request(msgspec.Struct):
    method: bytes
    path: str
    body: bytes
    traceparent: str | None = None  # W3C trace context the caller sent, if any


class ConnectionGone(Exception):
    """The peer closed the connection between requests (a normal end)."""


async def send_response(
    stream: trio.SocketStream,
    conn: h11.Connection,
    status: int,
    body: bytes,
    *,
    extra: list[tuple[bytes, bytes]] | None = None,
    close: bool = False,
) -> None:
    """Send one whole response (``close``: the connection ends after it)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if extra:
        headers.extend(extra)
    if close:
        headers.append((b"connection", b"close"))
    data = conn.send(h11.Response(status_code=status, headers=headers))
    if body:
        data += conn.send(h11.Data(data=body))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)
