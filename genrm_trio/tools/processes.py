"""Child processes the tools start (servers, judges, HAProxy): how they are stopped."""

from __future__ import annotations

import signal

import trio


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
