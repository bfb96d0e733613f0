"""The fault-injecting mock GenRM judge: an OpenAI-compatible fake on trio sockets and h11.

It answers ``POST /v1/responses`` and ``POST /v1/chat/completions`` with a deterministic verdict
(:func:`genrm_trio.scoring.heuristic_judge_text` of the history, the two answers and the
principle), after a configurable latency, behind an optional capacity limit, and injects faults
on demand. The HTTP layer is h11 over raw trio sockets on purpose: a connection reset, a body
shorter than its ``Content-Length``, a chunked body cut mid-way and a trickled body must be real
on the wire, which a web framework would hide or repair.

::

    run_mock_judge(settings, state=...)      one listener, one task per connection (keep-alive)
      +-- connection task                    h11 request loop
            +-- judge call                   count, pick fault, [capacity] latency, prefix
                                             cache and per-token time, answer/fault
            +-- /health, /admin/*            stats, fault plan, reset (not counted as calls)
      +-- batched engine loop                [engine: batched] the shared steps

Layering: this package is a tool. It imports the pure core (``scoring``, ``errors``,
``openai_shapes``) and nothing from ``server`` or ``caller``; it never imports httpx2.
"""

from __future__ import annotations

import logging
from typing import Any

import h11
import msgspec
import trio

from genrm_trio.mock.engine import BatchedEngine
from genrm_trio.mock.faults import Fault, answer_with_fault
from genrm_trio.mock.http import (
    JUDGE_PATHS,
    MAX_BODY_BYTES,
    RECV_BYTES,
    RESPONSES_PATH,
    ConnectionGone,
    Request,
    error_body,
    json_decode,
    json_encode,
    send_response,
)
from genrm_trio.mock.inputs import BadJudgeRequest, JudgeInput, chat_input, responses_input
from genrm_trio.mock.prefix_cache import PrefixCache, block_keys, prompt_tokens
from genrm_trio.mock.settings import MockJudgeSettings, MockJudgeState
from genrm_trio.mock.verdicts import answer_body, answer_text, output_tokens

log = logging.getLogger(__name__)
_BACKLOG = 4096
_REFUSED = frozenset({Fault.HTTP_503, Fault.HTTP_429, Fault.HTTP_408, Fault.RESET})


class _Server:
    """One running mock judge: settings, shared state, the capacity limiter, the prefix cache
    (one per mock judge: each process or port is one engine)."""

    def __init__(self, settings: MockJudgeSettings, state: MockJudgeState) -> None:
        self.settings = settings
        self.state = state
        self.cache = PrefixCache(settings.prefix_cache_tokens)
        self.limiter = (
            trio.CapacityLimiter(settings.capacity) if settings.capacity is not None else None
        )
        self.batched = (
            BatchedEngine(self.cache, settings.prompt_token_s, settings.output_token_s,
                          settings.engine_step_tokens)
            if settings.engine == "batched" else None
        )

    # -- connection loop -------------------------------------------------------------------

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        """Serve one connection's requests until either side closes; a task boundary."""
        conn = h11.Connection(h11.SERVER)
        self.state.connections += 1
        self.state.notify()
        try:
            while True:
                try:
                    request = await self._receive_request(stream, conn)
                except ConnectionGone:
                    return
                except h11.RemoteProtocolError as exc:
                    await self._send_protocol_error(stream, conn, exc)
                    return
                if not await self._dispatch(stream, conn, request):
                    return
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
                else:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            # The client went away mid-exchange (often on purpose: its deadline fired).
            log.debug("mock judge connection ended: %r", exc)
        finally:
            await stream.aclose()

    async def _next_event(self, stream: trio.SocketStream, conn: h11.Connection) -> Any:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(RECV_BYTES))
                continue
            return event

    async def _receive_request(self, stream: trio.SocketStream, conn: h11.Connection) -> Request:
        event = await self._next_event(stream, conn)
        if isinstance(event, h11.ConnectionClosed):
            raise ConnectionGone
        if not isinstance(event, h11.Request):
            raise h11.RemoteProtocolError(f"expected a request, got {type(event).__name__}")
        method = event.method
        path = event.target.decode("ascii", "replace").split("?", 1)[0]
        traceparent = next((v.decode("latin-1") for k, v in event.headers
                            if k == b"traceparent"), None)
        if conn.client_is_waiting_for_100_continue:
            await stream.send_all(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self._next_event(stream, conn)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > MAX_BODY_BYTES:
                    raise h11.RemoteProtocolError("request body too large", 413)
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in body")
        return Request(method, path, b"".join(chunks), traceparent)

    async def _send_protocol_error(
        self, stream: trio.SocketStream, conn: h11.Connection, exc: h11.RemoteProtocolError
    ) -> None:
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = exc.error_status_hint
        await send_response(stream, conn, status, error_body(status, str(exc)), close=True)

    # -- routing ---------------------------------------------------------------------------

    async def _dispatch(
        self, stream: trio.SocketStream, conn: h11.Connection, request: Request
    ) -> bool:
        """Answer one request; False when the connection must end here."""
        path, method = request.path, request.method
        if path in JUDGE_PATHS:
            if method != b"POST":
                await send_response(stream, conn, 405, error_body(405, "use POST"))
                return True
            return await self._judge_call(stream, conn, request)
        if path == "/health" and method == b"GET":
            body = json_encode({"status": "ok"})
        elif path == "/admin/stats" and method == b"GET":
            body = json_encode(self.state.snapshot())
        elif path == "/admin/fault" and method == b"POST":
            try:
                self._apply_fault_request(request.body)
            except (msgspec.DecodeError, ValueError, TypeError) as exc:
                await send_response(stream, conn, 400, error_body(400, str(exc)))
                return True
            body = json_encode(self.state.snapshot())
        elif path == "/admin/reset" and method == b"POST":
            self.state.reset()
            self.cache.clear()
            body = json_encode(self.state.snapshot())
        else:
            await send_response(stream, conn, 404, error_body(404, f"no route {path}"))
            return True
        await send_response(stream, conn, 200, body)
        return True

    def _apply_fault_request(self, raw: bytes) -> None:
        payload = json_decode(raw)
        if not isinstance(payload, dict) or "fault" not in payload:
            raise ValueError('expected {"fault": NAME, "count": N|null, "rate": R}')
        count = payload.get("count")
        rate = payload.get("rate", 0.0)
        if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
            raise ValueError("count must be an integer or null")
        if not isinstance(rate, int | float) or isinstance(rate, bool):
            raise ValueError("rate must be a number")
        self.state.set_fault(str(payload["fault"]), count, rate=float(rate))

    # -- judge calls -----------------------------------------------------------------------

    async def _judge_call(
        self, stream: trio.SocketStream, conn: h11.Connection, request: Request
    ) -> bool:
        state = self.state
        state.calls += 1
        state.calls_by_path[request.path] += 1
        call_no = state.calls
        state.traceparents.append(request.traceparent)
        state.notify()
        try:
            decoded = json_decode(request.body)
            if request.path == RESPONSES_PATH:
                judged = responses_input(decoded, self.settings)
            else:
                judged = chat_input(decoded, self.settings)
        except msgspec.DecodeError as exc:
            await send_response(stream, conn, 400, error_body(400, f"bad judge request: {exc}"))
            return True
        except BadJudgeRequest as exc:
            await send_response(stream, conn, exc.status,
                             error_body(exc.status, f"bad judge request: {exc}"))
            return True
        fault = state.next_fault()
        if fault is Fault.NONE:
            state.note_prompt(judged.prompt)
        if self.limiter is None:
            return await self._serve_call(stream, conn, request, judged, fault, call_no)
        state.queued += 1
        state.notify()
        try:
            await self.limiter.acquire()
        finally:
            state.queued -= 1
        try:
            return await self._serve_call(stream, conn, request, judged, fault, call_no)
        finally:
            self.limiter.release()

    async def _serve_call(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        request: Request,
        judged: JudgeInput,
        fault: Fault,
        call_no: int,
    ) -> bool:
        state = self.state
        state.in_flight += 1
        if state.in_flight > state.max_in_flight:
            state.max_in_flight = state.in_flight
        state.notify()
        started = trio.current_time()
        settings = self.settings
        try:
            delay = settings.latency_s
            if settings.latency_jitter_s > 0:
                delay += state.rng.uniform(0.0, settings.latency_jitter_s)
            # The engine: find the cached prefix, compute the rest (its blocks are reusable
            # from then on), then decode. A refused call (an error status, a reset) runs none.
            engine = fault not in _REFUSED
            keys = block_keys(judged.prompt) if engine else []
            tokens = prompt_tokens(judged.prompt)
            answer = answer_text(fault, judged)
            decoded = output_tokens(answer[0]) if engine else 0
            if self.batched is not None:
                # The batched engine: the latency first (network, tokenizing), then the
                # shared steps (genrm_trio.mock.engine).
                if delay > 0:
                    await trio.sleep(delay)
                cached = await self.batched.serve(keys, tokens, decoded) if engine else 0
            else:
                cached = self.cache.lookup(keys, tokens) if engine else 0
                if engine:
                    delay += (tokens - cached) * settings.prompt_token_s
                if delay > 0:
                    await trio.sleep(delay)
                if engine:
                    self.cache.insert(keys)
                    if decoded * settings.output_token_s > 0:
                        await trio.sleep(decoded * settings.output_token_s)
            if engine:
                state.prompt_tokens += tokens
                state.cached_tokens += cached
                state.output_tokens += decoded
            return await answer_with_fault(
                stream, conn, fault,
                lambda: answer_body(request.path, answer, judged, call_no, tokens, cached,
                                    settings.cache_report),
                retry_after_s=self.settings.retry_after_s,
                trickle_interval_s=self.settings.trickle_interval_s,
            )
        finally:
            state.in_flight -= 1
            state.busy_s += trio.current_time() - started
            state.notify()


async def _open_listener(host: str, port: int) -> trio.SocketListener:
    """Bind exactly one socket (the first address ``host`` resolves to), so port 0 is one port."""
    infos = await trio.socket.getaddrinfo(
        host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    sock = trio.socket.socket(family, kind, proto)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await sock.bind(address)
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


def _base_url(listener: trio.SocketListener) -> str:
    bound_host, bound_port = listener.socket.getsockname()[:2]
    if ":" in bound_host:
        bound_host = f"[{bound_host}]"
    return f"http://{bound_host}:{bound_port}"


async def run_mock_judge(
    settings: MockJudgeSettings,
    *,
    state: MockJudgeState | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the mock judge until cancelled; report ``http://HOST:PORT`` (no ``/v1``) once bound.

    Use with ``base_url = await nursery.start(run_mock_judge, settings)``. Blocks forever; the
    caller's cancellation stops it and every connection task (hung calls included) with it.
    Without ``state`` a fresh :class:`MockJudgeState` is made from the settings; a given
    ``state`` keeps its own fault plan and random generator unless the settings name a plan
    (``fault`` not ``none`` or ``fault_rate > 0``): that plan and ``seed`` then replace them.
    Pass a state with ``functools.partial(run_mock_judge, settings, state=state)``.
    Raises ``OSError`` if binding fails (before ``started``). Per-connection errors (client
    gone, bad HTTP) end only that connection.
    """
    if state is None:
        state = MockJudgeState.from_settings(settings)
    elif settings.fault is not Fault.NONE or settings.fault_rate > 0:
        state.set_fault(settings.fault, settings.fault_count, rate=settings.fault_rate)
        state.rng.seed(settings.seed)
    server = _Server(settings, state)
    listener = await _open_listener(settings.host, settings.port)
    async with listener, trio.open_nursery() as nursery:
        if server.batched is not None:
            nursery.start_soon(server.batched.run)
        task_status.started(_base_url(listener))
        await trio.serve_listeners(server.serve_connection, [listener])
