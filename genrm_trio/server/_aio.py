"""The asyncio bridge: the only module of genrm-trio that touches asyncio or trio-asyncio.

::

    trio task (judge call)                      trio-flavoured
        |  AsyncioBridge.call(fn, arg)
        v
    trio_asyncio.aio_as_trio(fn, loop=loop)     the one crossing point
        |
        v
    asyncio task running fn(arg)                asyncio-flavoured, on the trio-asyncio loop

The loop is owned by :func:`open_asyncio_bridge`: it runs inside the caller's trio task tree
and is shut down (remaining asyncio tasks cancelled) when the context manager exits.
Cancellation is carried both ways: cancelling the trio caller cancels the asyncio task; an
asyncio task that ends with ``CancelledError`` while the trio caller was *not* cancelled is
reported as :class:`AsyncioCancelled`, an ordinary exception, so it cannot be mistaken for a
trio cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio_asyncio  # type: ignore[import-untyped]

from genrm_trio.errors import GenRMError

T = TypeVar("T")
R = TypeVar("R")


class AsyncioCancelled(GenRMError):
    """The asyncio side cancelled the call on its own (not a trio cancellation)."""


class AsyncioBridge:
    """Runs asyncio-flavoured async callables from trio tasks, on one trio-asyncio loop.

    Obtain one from :func:`open_asyncio_bridge`; it is valid only inside that block.
    """

    def __init__(self, loop: Any) -> None:
        self._loop = loop

    async def call(self, fn: Callable[[T], Awaitable[R]], arg: T) -> R:
        """Run ``await fn(arg)`` as an asyncio task and return its result.

        Blocks until the asyncio task ends. Cancelling the calling trio scope cancels the
        asyncio task and raises ``trio.Cancelled`` once it has ended. Raises whatever ``fn``
        raises, except that an asyncio-side ``CancelledError`` becomes :class:`AsyncioCancelled`.
        """
        wrapped = trio_asyncio.aio_as_trio(fn, loop=self._loop)
        try:
            result: R = await wrapped(arg)
        except asyncio.CancelledError as exc:
            # Only reached when trio did not cancel us: trio-asyncio turns a cancellation we
            # asked for into trio.Cancelled, which passes through untouched.
            raise AsyncioCancelled("the asyncio task was cancelled on the asyncio side") from exc
        return result


@asynccontextmanager
async def open_asyncio_bridge() -> AsyncIterator[AsyncioBridge]:
    """Open a trio-asyncio loop for the lifetime of the block and yield a bridge onto it.

    Blocks on exit until every asyncio task still on the loop has been cancelled and ended.
    Must be entered from a trio task; the loop lives in that task's tree.
    """
    async with trio_asyncio.open_loop() as loop:
        yield AsyncioBridge(loop)
