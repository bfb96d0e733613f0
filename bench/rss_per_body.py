"""RSS per accepted /verify body: what a waiting member costs the server in memory.

    python3 bench/rss_per_body.py [--count 200] [--mb 1]

Starts ``genrm-trio serve`` (port 0, ``num_rollouts_per_prompt: 2``, ``max_active_bytes:
null``), then for each answer text (ASCII; ASCII ending with an em dash; ASCII ending with an
emoji) and each client behaviour (the connection held open, as a waiting client does; closed
once the member is admitted) sends ``--count`` one-member cohorts of about ``--mb`` MB one
after another, each admitted (``/status``) before the next, and prints the RSS growth per body
against the body's bytes and against ``/status`` ``active_bytes``. A fresh server per
combination; every server is stopped by its pid. Loopback only; about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import msgspec
import trio

ENDINGS = {"ascii": "", "em dash": "\u2014", "emoji": "\U0001F600"}


def make_body(group: str, size: int, ending: str) -> bytes:
    unit = "the model should explain each step clearly and check the result first "
    text = (unit * (size // len(unit) + 1))[: size - 700 - len(ending)] + ending
    return msgspec.json.encode({
        "responses_create_params": {"input": [{"role": "user", "content": f"prompt {group}"}]},
        "response": {"id": "resp", "object": "response", "status": "completed",
                     "output": [{"type": "message", "role": "assistant", "content": [
                         {"type": "output_text", "text": text, "annotations": []}]}]},
        "_ng_rollout_index": 0, "_ng_group_id": group, "_ng_group_attempt": 0,
    })


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def status(port: int) -> dict[str, int]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    cohorts: dict[str, int] = json.loads(data.split(b"\r\n\r\n", 1)[1])["cohorts"]
    return cohorts


async def one_run(count: int, size: int, ending: str, hold: bool) -> tuple[float, float]:
    """(RSS growth / body bytes, RSS growth / active_bytes) for one fresh server."""
    cmd = [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
           "--set", "num_rollouts_per_prompt=2", "--set", "max_active_bytes=null",
           "--set", "log_level=WARNING", "--set", f"max_request_bytes={2 * size + 65536}"]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL)
    held: list[trio.SocketStream] = []
    try:
        assert proc.stdout is not None
        line = b""
        while b"listening on" not in line:
            line += await proc.stdout.receive_some(4096)
        port = int(line.decode().split("listening on ")[1].split()[0].rsplit(":", 1)[1])
        await trio.sleep(0.5)
        before = rss_bytes(proc.pid)
        sent = 0
        for i in range(count):
            raw = make_body(f"g{i}", size, ending)
            sent += len(raw)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(
                b"POST /verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            while (await status(port))["active_cohorts"] < i + 1:  # noqa: ASYNC110 - another process
                await trio.sleep(0.005)
            if hold:
                held.append(stream)
            else:
                await stream.aclose()
        await trio.sleep(1.5)  # closed clients: their waiters are noticed gone and removed
        grown = rss_bytes(proc.pid) - before
        active = (await status(port))["active_bytes"]
        return grown / sent, grown / active
    finally:
        for stream in held:
            await stream.aclose()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--mb", type=float, default=1.0)
    args = parser.parse_args()
    size = int(args.mb * 1_000_000)
    print(f"{'answer':9s} {'client':6s} {'RSS/body bytes':>15s} {'RSS/active_bytes':>17s}")
    for name, ending in ENDINGS.items():
        for hold in (True, False):
            per_body, per_active = await one_run(args.count, size, ending, hold)
            print(f"{name:9s} {'holds' if hold else 'closes':6s} {per_body:15.2f}x "
                  f"{per_active:16.2f}x", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trio.run(main)
