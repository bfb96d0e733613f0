"""The lean h11 judge pool over real loopback sockets: keep-alive reuse, a stale reused
connection retried once on a fresh one, chunked answers, and faults mapped to retryable errors."""

from __future__ import annotations

import json
from functools import partial

import h11
import trio

from genrm_trio.config import Config, JudgeConfig
from genrm_trio.server.judge import JudgeRequest, open_judge

REQUEST = JudgeRequest(history=[{"role": "user", "content": "2+2?"}], response_1="4",
                       response_2="five", principle=None)
VERDICT = '```json\n{"score_1": 5, "score_2": 1, "ranking": 1}\n```'


def answer_body() -> bytes:
    return json.dumps({"status": "completed", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": VERDICT}]}]}).encode()


class ScriptedServer:
    """Answers each request on a connection per ``mode``: 'keepalive' (stays open), 'close-after'
    (answers, then closes without saying so: the next reuse finds it stale), 'chunked'."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.requests = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.EndOfMessage):
                    self.requests += 1
                    body = answer_body()
                    headers = [("content-type", "application/json")]
                    if self.mode == "chunked":
                        headers.append(("transfer-encoding", "chunked"))
                        out = conn.send(h11.Response(status_code=200, headers=headers))
                        out += conn.send(h11.Data(data=body[:10]))
                        out += conn.send(h11.Data(data=body[10:]))
                    else:
                        headers.append(("content-length", str(len(body))))
                        out = conn.send(h11.Response(status_code=200, headers=headers))
                        out += conn.send(h11.Data(data=body))
                    out += conn.send(h11.EndOfMessage())
                    await stream.send_all(out)
                    if self.mode == "close-after":
                        return
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed):
                    return


async def judge_against(server: ScriptedServer, calls: int) -> list[int]:
    """Make ``calls`` calls one after another; returns /status's client count after each."""
    clients: list[int] = []
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        cfg = Config(judge=JudgeConfig(base_urls=(f"http://127.0.0.1:{port}",)),
                     genrm_parse_retries=0)
        async with open_judge(cfg) as judge:
            for _ in range(calls):
                with trio.fail_after(5):
                    verdict = await judge.judge_pair(REQUEST)
                assert (verdict.score_1, verdict.score_2, verdict.ranking) == (5.0, 1.0, 1.0)
                clients.append(judge.status()["endpoints"][0]["clients"])
            assert judge.stats.calls == calls  # no attempt was spent on a stale connection
        nursery.cancel_scope.cancel()
    return clients


async def test_keep_alive_connection_is_reused() -> None:
    server = ScriptedServer("keepalive")
    clients = await judge_against(server, 5)
    assert server.requests == 5 and server.connections == 1
    assert clients == [1] * 5  # /status counts the pool's connection (it used to say 0)


async def test_stale_reused_connection_is_retried_on_a_fresh_one() -> None:
    server = ScriptedServer("close-after")
    await judge_against(server, 4)  # genrm_parse_retries=0: a stale failure would fail the call
    assert server.requests == 4 and server.connections == 4


async def test_chunked_answers_are_read_whole() -> None:
    server = ScriptedServer("chunked")
    await judge_against(server, 3)
    assert server.requests == 3 and server.connections == 1
