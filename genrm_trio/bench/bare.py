"""The physical limit of this HTTP stack: a bare Hypercorn ASGI app, for the ``scaleout`` bench.

It reads each request's whole body (a ``/verify``-sized one in the bench) and answers at once
with a canned JSON object of the size ``genrm-trio serve`` would answer for that body (the body
echoed plus the reward fields): no decoding, no cohort, no judge. It runs under the same
Hypercorn settings as ``genrm-trio serve``, so the server's verifies/s over this app's is the
share of the stack's limit that the server reaches.

::

    python -m genrm_trio.bench.bare --port 0     prints "genrm-trio bare listening on URL";
                                                 SIGTERM or SIGINT stops it
"""

from __future__ import annotations

import signal
from typing import Any

import click
import trio
from hypercorn.trio import serve as hypercorn_serve

from genrm_trio.config import Config
from genrm_trio.server.serve import _hypercorn_config

__all__ = ["CANNED_JUDGE", "BareApp", "bare_cli", "canned_judge"]

CANNED_JUDGE = "genrm_trio.bench.bare:canned_judge"
"""The ``judge.plugin`` spec of :func:`canned_judge`."""

_CANNED_VERDICT = '{"score_1": 4, "score_2": 3, "ranking": 3}'

ANSWER_EXTRA_BYTES = 120
"""What a /verify success answer adds to the member's body (reward, mask and failure fields)."""

_MAX_CANNED = 4096


async def canned_judge(request: dict[str, Any]) -> str:
    """A judge plugin (``judge.plugin: genrm_trio.bench.bare:canned_judge``) that answers one
    fixed verdict at once: a judge that costs the server nothing but parsing its answer, so a
    replica's throughput is the server's own. Never blocks beyond one checkpoint."""
    await trio.lowlevel.checkpoint()
    return _CANNED_VERDICT


class BareApp:
    """The ASGI app. Canned answers are built once per body size (at most ``_MAX_CANNED``
    sizes are kept) and owned by the instance."""

    def __init__(self) -> None:
        self._canned: dict[int, bytes] = {}

    def canned(self, body_bytes: int) -> bytes:
        size = body_bytes + ANSWER_EXTRA_BYTES
        answer = self._canned.get(size)
        if answer is None:
            head = b'{"reward":3.0,"mask_sample":false,"failure_kind":null,"pad":"'
            answer = head + b"x" * max(0, size - len(head) - 2) + b'"}'
            if len(self._canned) < _MAX_CANNED:
                self._canned[size] = answer
        return answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[1]  # startup / shutdown
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        payload = self.canned(size)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


async def _serve(host: str, port: int) -> None:
    hconfig = _hypercorn_config(Config(host=host, port=port))
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    stop.set()

            nursery.start_soon(watch)
            binds: list[str] = await nursery.start(
                lambda task_status: hypercorn_serve(
                    BareApp(), hconfig, shutdown_trigger=stop.wait, task_status=task_status)
            )
            print(f"genrm-trio bare listening on {binds[0]}", flush=True)
            await stop.wait()
            nursery.cancel_scope.deadline = trio.current_time() + hconfig.graceful_timeout + 1


@click.command("bare")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=0, show_default=True, help="0 = any free port.")
def bare_cli(host: str, port: int) -> None:
    """Serve the bare ASGI app until SIGINT or SIGTERM."""
    trio.run(_serve, host, port)


if __name__ == "__main__":
    bare_cli()
