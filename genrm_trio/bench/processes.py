"""Child processes the tools start (servers, judges, HAProxy, wrk): how the programs are found
(installed from Debian packages when missing) and how the processes are stopped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import trio


class MissingProgram(Exception):
    """A program the tool needs is missing and could not be installed."""


def ensure_program(program: str, package: str) -> str:
    """The path of ``program``; when missing, install the Debian ``package`` (``apt-get``,
    which needs root). Also looks in ``/usr/sbin`` and ``/usr/local/sbin``, where Debian puts
    daemons and which not every user's PATH has.

    Blocks (minutes on a fresh machine; run it in a thread from async code). Raises
    :class:`MissingProgram` with the installer's last line when that fails (no root, no apt).
    """
    found = _which(program)
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None:
        raise MissingProgram(f"{program} is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for step in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", package]):
        done = subprocess.run(step, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise MissingProgram(f"{' '.join(step[:2])} failed: {' '.join(tail)}")
    found = _which(program)
    if found is None:
        raise MissingProgram(
            f"apt-get install {package} succeeded but no {program} executable found")
    return found


def _which(program: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/usr/local/sbin"])
    return shutil.which(program, path=path)


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
