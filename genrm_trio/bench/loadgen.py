"""The benchmark load generator: trio tasks over raw h11 connections, loopback only.

Why not httpx: at a thousand requests in flight its pool measures itself, not the server. Here
every request owns one keep-alive connection taken from a small per-target idle stack, so the
client cost per request is one h11 state machine and two socket calls.

::

    drive_load(client, plan)                  K cohort workers in one nursery
      +-- worker                              cohort after cohort until count or time runs out
            +-- run_cohort(client, spec)      N member tasks, each one POST /verify
                  +-- H11Client.request       one connection, one request, one answer

Also here: realistic member bodies (:class:`BodyFactory`), and the server's CPU seconds, RSS
and peak RSS read from ``/proc`` (:func:`read_proc_stats`). Nothing here imports the server: the
load generator talks to any ``/verify`` speaker (ours, NeMo Gym's) over HTTP only.
"""

from __future__ import annotations

import math
import os
import random
import select
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import h11
import msgspec
import trio

__all__ = [
    "BodyFactory",
    "CohortResult",
    "CohortSpec",
    "H11Client",
    "HttpAnswer",
    "LoadPlan",
    "LoadResult",
    "LoadgenError",
    "MemberResult",
    "ProcStats",
    "ReadableWatch",
    "TRANSPORT_ERROR",
    "children_cpu_s",
    "count_fds",
    "drive_load",
    "median",
    "percentile",
    "read_proc_stats",
    "run_cohort",
    "send_member",
]

TRANSPORT_ERROR = -1
"""``MemberResult.status`` when the connection failed or closed before an answer."""

_RECV_BYTES = 65536
_CLOSE_GRACE_S = 1.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class LoadgenError(Exception):
    """The load generator could not talk to the target (refused, reset, bad HTTP)."""


class HttpAnswer(msgspec.Struct, frozen=True):
    """One HTTP answer: status code, the whole body and the headers (names lowercase)."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def header(self, name: bytes) -> bytes | None:
        """The first header called ``name`` (lowercase), or None."""
        return next((value for key, value in self.headers if key == name), None)


class _Connection:
    """One keep-alive HTTP/1.1 client connection: a trio stream and its h11 state machine."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def aclose(self) -> None:
        with trio.move_on_after(_CLOSE_GRACE_S, shield=True):
            await self.stream.aclose()


class H11Client:
    """Requests to one ``host:port`` over reusable h11 connections.

    Each request in flight owns one connection; finished connections whose both sides are
    reusable go back onto an idle stack of at most ``max_idle`` (the rest are closed). Close the
    client with :meth:`aclose`, which closes every idle connection; the client owns no task.
    """

    def __init__(self, host: str, port: int, *, max_idle: int = 2048) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._host_header = f"{host}:{port}".encode()

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        sent: trio.Event | None = None,
        on_sent: Callable[[int], None] | None = None,
        hold: trio.Event | None = None,
    ) -> HttpAnswer:
        """Send one request and read its whole answer.

        Blocks until the answer's last byte (a ``/verify`` blocks until its cohort resolves).
        Once the request's last byte was handed to the kernel, ``sent`` is set and ``on_sent``
        gets the socket's file descriptor; with ``hold`` given, reading the answer waits until
        it is set (so an outside observer can time the answer's arrival). Cancellation
        closes the connection, so the server sees the client go away. Raises
        :class:`LoadgenError` when the connection fails or the peer breaks HTTP.
        """
        conn = self._idle.pop() if self._idle else None
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        try:
            try:
                answer = await self._exchange(conn, method, path, body, sent, on_sent, hold)
            except LoadgenError:
                if not reused:
                    raise
                # A kept-alive connection the server closed meanwhile: one fresh try.
                await conn.aclose()
                conn = await self._connect()
                answer = await self._exchange(conn, method, path, body, sent, on_sent, hold)
        except BaseException:
            await conn.aclose()
            raise
        if (
            conn.h11.our_state is h11.DONE
            and conn.h11.their_state is h11.DONE
            and len(self._idle) < self.max_idle
        ):
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            await conn.aclose()
        return answer

    async def get(self, path: str) -> HttpAnswer:
        """``GET path``; see :meth:`request`."""
        return await self.request("GET", path)

    async def aclose(self) -> None:
        """Close every idle connection. Connections in flight are closed by their requests."""
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    async def _connect(self) -> _Connection:
        try:
            stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise LoadgenError(f"connect to {self.host}:{self.port}: {exc}") from exc
        return _Connection(stream)

    async def _exchange(
        self,
        conn: _Connection,
        method: str,
        path: str,
        body: bytes | None,
        sent: trio.Event | None,
        on_sent: Callable[[int], None] | None,
        hold: trio.Event | None,
    ) -> HttpAnswer:
        headers = [(b"host", self._host_header)]
        if body is not None:
            headers.append((b"content-type", b"application/json"))
            headers.append((b"content-length", str(len(body)).encode()))
        try:
            out = conn.h11.send(h11.Request(method=method, target=path, headers=headers)) or b""
            if body is not None:
                out += conn.h11.send(h11.Data(data=body)) or b""
            out += conn.h11.send(h11.EndOfMessage()) or b""
            await conn.stream.send_all(out)
            if sent is not None:
                sent.set()
            if on_sent is not None:
                on_sent(conn.stream.socket.fileno())
            if hold is not None:
                await hold.wait()
            status = 0
            answer_headers: tuple[tuple[bytes, bytes], ...] = ()
            chunks: list[bytes] = []
            while True:
                event = conn.h11.next_event()
                if event is h11.NEED_DATA:
                    data = await conn.stream.receive_some(_RECV_BYTES)
                    conn.h11.receive_data(data)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    answer_headers = tuple((bytes(k), bytes(v)) for k, v in event.headers)
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return HttpAnswer(status, b"".join(chunks), answer_headers)
                elif isinstance(event, h11.ConnectionClosed):
                    raise LoadgenError("server closed the connection before answering")
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise LoadgenError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        except h11.ProtocolError as exc:
            raise LoadgenError(f"{method} {path}: bad HTTP: {exc}") from exc


# -- bodies ------------------------------------------------------------------------------------

_WORDS = (
    "the model should explain each step clearly and check the result against the constraints "
    "given in the question before answering with a short final summary of its reasoning about "
    "prime numbers integrals graphs sorting networks probability vectors matrices compilers"
).split()


def _text(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n_chars]


class BodyFactory:
    """Realistic ``/verify`` bodies: a ~500-character prompt, a 1-2 KB answer, optional reasoning
    (``prompt_chars`` and ``answer_chars``, a range, change the sizes).

    ``id_mode`` ``explicit`` sends ``_ng_group_id``/``_ng_group_attempt``; ``legacy`` sends only
    ``_ng_task_index`` (the cohort key is then task index plus prompt digest). Pure: no I/O.
    ``run_tag`` makes group ids and prompts unique per run, so runs never collide.
    """

    def __init__(
        self, *, seed: int, id_mode: str = "explicit", reasoning: bool = False, run_tag: str = "",
        prompt_chars: int = 470, answer_chars: tuple[int, int] = (1024, 2048),
    ) -> None:
        if id_mode not in ("explicit", "legacy"):
            raise ValueError(f"id_mode must be explicit or legacy, got {id_mode!r}")
        self.id_mode = id_mode
        self.reasoning = reasoning
        self.run_tag = run_tag or f"{seed}"
        self._rng = random.Random(seed)
        self._answers = [_text(self._rng, self._rng.randint(*answer_chars)) for _ in range(64)]
        self._reasonings = [_text(self._rng, self._rng.randint(512, 1024)) for _ in range(16)]
        self._prompt_tail = _text(self._rng, prompt_chars)
        self._encoder = msgspec.json.Encoder()

    def member(self, cohort: int, index: int) -> bytes:
        """The JSON body of member ``index`` of cohort number ``cohort``."""
        prompt = f"[{self.run_tag}/{cohort}] {self._prompt_tail}"
        answer = self._answers[(cohort * 31 + index) % len(self._answers)]
        output: list[dict[str, Any]] = []
        if self.reasoning:
            output.append(
                {
                    "type": "reasoning",
                    "id": f"rs_{cohort}_{index}",
                    "summary": [
                        {
                            "type": "summary_text",
                            "text": self._reasonings[(cohort + index) % len(self._reasonings)],
                        }
                    ],
                }
            )
        output.append(
            {
                "type": "message",
                "id": f"msg_{cohort}_{index}",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": f"{index}: {answer}", "annotations": []}
                ],
            }
        )
        body: dict[str, Any] = {
            "responses_create_params": {"input": [{"role": "user", "content": prompt}]},
            "response": {
                "id": f"resp_{cohort}_{index}",
                "object": "response",
                "created_at": 0,
                "model": "policy",
                "status": "completed",
                "output": output,
                "parallel_tool_calls": False,
                "tool_choice": "auto",
                "tools": [],
            },
            "_ng_rollout_index": index,
        }
        if self.id_mode == "explicit":
            body["_ng_group_id"] = f"{self.run_tag}-g{cohort}"
            body["_ng_group_attempt"] = 0
        else:
            body["_ng_task_index"] = cohort
        return self._encoder.encode(body)


# -- cohorts -----------------------------------------------------------------------------------


class _Verdict(msgspec.Struct):
    reward: float | None = None
    failure_kind: str | None = None
    mask_sample: bool | None = None


_verdict_decoder = msgspec.json.Decoder(_Verdict)


class MemberResult(msgspec.Struct, frozen=True):
    """One member: its slot, HTTP status (``TRANSPORT_ERROR`` if none), reward, failure kind,
    and its send start / answer times (``time.perf_counter`` seconds)."""

    index: int
    status: int
    reward: float | None
    failure_kind: str | None
    sent_at: float
    done_at: float


class CohortResult(msgspec.Struct, frozen=True):
    """One cohort's members, in slot order."""

    cohort: int
    members: tuple[MemberResult, ...]

    @property
    def ok(self) -> bool:
        """Every member got HTTP 200 with an unmasked reward."""
        return all(m.status == 200 and m.reward is not None for m in self.members)

    @property
    def latency_s(self) -> float:
        """From the last member's send to the last answer."""
        return max(m.done_at for m in self.members) - max(m.sent_at for m in self.members)


class CohortSpec(msgspec.Struct, frozen=True):
    """Cohort number ``cohort`` with ``size`` members sent; ``delays_s[i]`` before member i."""

    cohort: int
    size: int
    delays_s: tuple[float, ...] = ()


def _member_result(index: int, answer: HttpAnswer | None, sent: float) -> MemberResult:
    done = time.perf_counter()
    if answer is None:
        return MemberResult(index, TRANSPORT_ERROR, None, "transport", sent, done)
    reward: float | None = None
    kind: str | None = None
    try:
        verdict = _verdict_decoder.decode(answer.body)
    except msgspec.DecodeError:
        kind = "undecodable"
    else:
        kind = verdict.failure_kind
        if answer.status == 200 and not verdict.mask_sample:
            reward = verdict.reward
    if answer.status != 200 and kind is None:
        kind = f"http_{answer.status}"
    return MemberResult(index, answer.status, reward, kind, sent, done)


async def send_member(
    client: H11Client,
    body: bytes,
    index: int,
    *,
    sent: trio.Event | None = None,
    on_sent: Callable[[int], None] | None = None,
    hold: trio.Event | None = None,
) -> MemberResult:
    """POST one member and wait for its answer; transport failures become a result.

    Blocks until the server answers (or the connection fails). Cancellation propagates (and
    closes the connection).
    """
    start = time.perf_counter()
    try:
        answer = await client.request(
            "POST", "/verify", body, sent=sent, on_sent=on_sent, hold=hold
        )
    except LoadgenError:
        return _member_result(index, None, start)
    return _member_result(index, answer, start)


async def run_cohort(client: H11Client, bodies: BodyFactory, spec: CohortSpec) -> CohortResult:
    """Send all ``spec.size`` members of one cohort concurrently and wait for every answer.

    Blocks until every member has an answer or a transport failure. Cancellation propagates.
    """
    results: list[MemberResult | None] = [None] * spec.size

    async def member(i: int) -> None:
        if spec.delays_s:
            await trio.sleep(spec.delays_s[i])
        results[i] = await send_member(client, bodies.member(spec.cohort, i), i)

    async with trio.open_nursery() as nursery:
        for i in range(spec.size):
            nursery.start_soon(member, i)
    return CohortResult(spec.cohort, tuple(r for r in results if r is not None))


# -- load --------------------------------------------------------------------------------------


class LoadPlan(msgspec.Struct, frozen=True, kw_only=True):
    """K cohorts in flight, N members each, until ``max_cohorts`` were started or ``duration_s``
    has passed; cohort numbers start at ``first_cohort``."""

    n: int
    k: int
    max_cohorts: int
    duration_s: float
    first_cohort: int = 0


class LoadResult(msgspec.Struct, frozen=True):
    """What one load run saw: every cohort, and the wall time from first send to last answer."""

    cohorts: tuple[CohortResult, ...]
    wall_s: float

    @property
    def verifies(self) -> int:
        """Members answered with a real reward."""
        return sum(1 for c in self.cohorts for m in c.members if m.reward is not None)

    @property
    def failures(self) -> dict[str, int]:
        """Count of members without a reward, by failure kind."""
        out: dict[str, int] = {}
        for c in self.cohorts:
            for m in c.members:
                if m.reward is None:
                    key = m.failure_kind or "none"
                    out[key] = out.get(key, 0) + 1
        return out

    def latencies_s(self) -> list[float]:
        """Per-cohort latency (last send to last answer) of the fully rewarded cohorts."""
        return [c.latency_s for c in self.cohorts if c.ok]


async def drive_load(
    client: H11Client,
    bodies: BodyFactory,
    plan: LoadPlan,
    *,
    delays: Callable[[random.Random], float] | None = None,
    seed: int = 0,
) -> LoadResult:
    """Keep ``plan.k`` cohorts in flight until ``plan.max_cohorts`` were started or
    ``plan.duration_s`` has passed (cohorts in flight then still finish).

    Blocks until the last started cohort is answered. Cancellation propagates; nothing started
    here outlives the call.
    """
    rng = random.Random(seed)
    results: list[CohortResult] = []
    next_cohort = plan.first_cohort
    stop_at = time.perf_counter() + plan.duration_s
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal next_cohort
        while next_cohort - plan.first_cohort < plan.max_cohorts and time.perf_counter() < stop_at:
            number = next_cohort
            next_cohort += 1
            spec_delays = tuple(delays(rng) for _ in range(plan.n)) if delays else ()
            spec = CohortSpec(number, plan.n, spec_delays)
            results.append(await run_cohort(client, bodies, spec))

    async with trio.open_nursery() as nursery:
        for _ in range(plan.k):
            nursery.start_soon(worker)
    return LoadResult(tuple(results), time.perf_counter() - start)


# -- process stats -----------------------------------------------------------------------------


class ProcStats(msgspec.Struct, frozen=True):
    """A process's CPU seconds (user + system), resident and peak resident bytes."""

    cpu_s: float
    rss_bytes: int
    peak_rss_bytes: int


def read_proc_stats(pid: int) -> ProcStats:
    """Read ``/proc/PID/stat`` and ``/proc/PID/status``. Raises ``OSError`` if the pid is gone."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    rss = peak = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return ProcStats(cpu_s, rss, peak)


def children_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid``'s live children so far (the server's span
    export process), from ``/proc``; 0.0 for none. Children that end meanwhile are skipped."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


class ReadableWatch:
    """Times when sockets become readable (an answer arrived, or the peer closed), observed by
    epoll from a worker thread so the load generator's own work never delays the stamp.

    Register descriptors with :meth:`add` (from the trio thread), then run :meth:`watch` in a
    thread (``trio.to_thread.run_sync``). Each descriptor is reported once (one-shot).
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self.registered = 0
        self.seen: dict[int, float] = {}

    def add(self, fd: int) -> None:
        """Watch ``fd`` for data, hang-up or error. Non-blocking."""
        mask = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
        self._epoll.register(fd, mask | select.EPOLLONESHOT)
        self.registered += 1

    def watch(self, limit_s: float) -> dict[int, float]:
        """Blocks (thread) until every registered descriptor was readable once, or ``limit_s``
        passed; returns fd -> ``time.perf_counter()`` when first seen readable, and closes the
        epoll object."""
        deadline = time.perf_counter() + limit_s
        try:
            while len(self.seen) < self.registered and time.perf_counter() < deadline:
                for fd, _ in self._epoll.poll(0.05, 4096):
                    self.seen.setdefault(fd, time.perf_counter())
        finally:
            self._epoll.close()
        return self.seen


def count_fds(pid: int) -> int:
    """How many file descriptors ``pid`` has open (sockets included)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """The median; NaN for no values."""
    return statistics.median(values) if values else math.nan
