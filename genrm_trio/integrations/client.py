"""The trainer hooks' shared client: members to ``POST /verify``, one outcome per member back.

A trainer hook builds :class:`Member` values (an explicit group key, the slot, the attempt, the
prompt as ``responses_create_params`` and the completion as a Responses object) and hands them
to one :class:`GenRMClient`. Each member gets exactly one of:

- :class:`Rewarded`: the reward of its slot, from a complete (or, with
  ``incomplete_cohort_policy: judge_present``, a partial) cohort;
- :class:`Masked`: the judge failed for good (the server's masked 200, ``mask_sample: true``);
  the placeholder ``reward: 0.0`` is never returned, only the reason. A hook maps it to its
  trainer's "no reward" (TRL: ``None``);
- :class:`Failed`: the cohort failed without a judgement (503 ``cohort_incomplete``,
  ``superseded``, ``shutdown``, ``evaluation_error``, ``cancelled``; 409 ``cohort_closed``),
  with the server's status, failure kind and detail;

or the call raises a :class:`ClientError` (below) for an answer that means the caller is wrong
(a 4xx such as 409 ``conflict`` / ``stale_attempt`` / ``prompt_mismatch``, 401, 422, or a 500),
naming the server's ``detail``.

**Event loops.** The client runs on the loop its caller runs on: asyncio (TRL runs async reward
functions on its own loop, in a daemon thread) or trio. It is written against anyio, the layer
httpx2 itself runs on, and uses httpx2 as its HTTP client; both were dependencies already (anyio
as httpx2's), so a trainer needs no aiohttp. This is the only module of genrm-trio that imports
anyio. A client belongs to the loop it was entered on (``async with``); open one per loop.

**How long a member waits.** As long as the server's own deadlines, never shorter: the first
call reads ``cohort_collection_timeout_s`` and ``cohort_evaluation_timeout_s`` from the server's
``GET /status`` config summary (once per client; pass ``settings`` to share one reading between
clients), and each send waits up to their sum plus ``slack_s``. A cohort's collection deadline
starts at its first member, which arrived no later than this send, and its evaluation deadline
starts when it is full, so the server answers within that time. A server without ``/status``
(or one that refuses it with anything but 401) gets the contract's defaults, 1800 s each, and
one warning line. ``wait_s`` replaces the sum (no ``/status`` read). When the time passes without
an answer, :class:`WaitExceeded` is raised: the server broke its own deadlines.

**Re-sends.** A transport error (connection refused or reset, the connection closed mid-wait, a
connect timeout) and a proxy's answer without our JSON (502, 504, a 503 with no
``failure_kind``: HAProxy with no replica up) re-send the identical bytes after a backoff (0.5 s
doubling to 8 s, jittered), at most ``transport_retries`` times, then :class:`ServerUnreachable`.
The server re-attaches an identical body to its slot as another waiter (CONTRACT.md 4,
"Disconnects"), or replays the slot's reward once the cohort has completed: a re-send is never a
second member. A 429 ``overloaded`` (no cohort was opened) is re-sent after its
``Retry-After``, for at most ``max_overload_wait_s`` in total (default: the collection
deadline), then :class:`RequestRefused` with the 429.

**Stateless groups.** :meth:`GenRMClient.compare` posts a whole group to ``/compare`` in one
request (slime's group reward: the caller holds the group), with the same re-sends; its
outcomes are the same three kinds.

**Bounds.** At most ``max_connections`` connections (and so members waiting) per client; no
thread, only one task per waiting member. :meth:`GenRMClient.verify_groups` admits whole groups:
a group's members are sent together and only when there is a connection for each of them, in
the order the groups first appear, so a bound smaller than the batch never strands part of a
group behind siblings holding every connection (the deadlock of a pool with a thread per waiting
member). A group larger than ``max_connections`` is refused (``ValueError``) before anything is
sent.

The exception tree (all :class:`~genrm_trio.errors.GenRMError`)::

    ClientError                 the client could not get an outcome
    +-- RequestRefused          a 4xx or 500: status, failure kind and detail from the server
    +-- ServerUnreachable       transport errors or proxy answers, retries exhausted
    +-- WaitExceeded            no answer within the server's deadlines plus slack_s
"""

from __future__ import annotations

import email.utils
import logging
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final

import anyio
import httpx2
import msgspec

from genrm_trio.errors import GenRMError

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "ClientError",
    "Failed",
    "GenRMClient",
    "Masked",
    "Member",
    "Outcome",
    "RequestRefused",
    "Rewarded",
    "ServerSettings",
    "ServerUnreachable",
    "WaitExceeded",
    "bearer_token",
]

logger = logging.getLogger(__name__)

#: Connections (members waiting at once) per client unless the caller says otherwise.
DEFAULT_MAX_CONNECTIONS: Final = 256
#: Waited beyond the server's two deadlines: its answer's own send, a proxy in between.
DEFAULT_SLACK_S: Final = 60.0
DEFAULT_CONNECT_TIMEOUT_S: Final = 10.0
DEFAULT_TRANSPORT_RETRIES: Final = 8
#: The contract's defaults of cohort_collection_timeout_s and cohort_evaluation_timeout_s,
#: assumed for a server that does not say (no /status).
CONTRACT_DEADLINE_S: Final = 1800.0
#: GET /status must answer within this (it is a snapshot, answered at once).
STATUS_TIMEOUT_S: Final = 30.0
RETRY_BACKOFF_START_S: Final = 0.5
RETRY_BACKOFF_MAX_S: Final = 8.0
#: A 429 without a usable Retry-After waits this long.
OVERLOAD_DEFAULT_WAIT_S: Final = 1.0
#: Longest server detail or body kept in an outcome or an exception message.
DETAIL_CHARS: Final = 2000

# Transport errors that mean "the member may or may not have arrived; send it again". Others
# (an unsupported URL scheme, a proxy misconfiguration, our own protocol error) are not retried.
_RESENDABLE: Final = (httpx2.NetworkError, httpx2.RemoteProtocolError, httpx2.TimeoutException)
# Statuses a proxy in front of the server answers for a replica that is down or slow.
_PROXY_STATUSES: Final = frozenset({502, 503, 504})
# Failures of the member's cohort: an outcome, not an error of the caller.
_COHORT_FAILURES: Final = frozenset({
    "cohort_incomplete", "superseded", "shutdown", "evaluation_error", "cancelled",
    "cohort_closed",
})

_ENCODER: Final = msgspec.json.Encoder()
_DECODER: Final = msgspec.json.Decoder()


# ----------------------------------------------------------------------------- errors


class ClientError(GenRMError):
    """The client could not get an outcome for a member (subclasses say why)."""


class RequestRefused(ClientError):
    """The server refused the request: ``status`` (4xx or 500), its ``failure_kind`` (None when
    the body had none) and ``detail``, cut to :data:`DETAIL_CHARS`."""

    def __init__(self, status: int, kind: str | None, detail: str, *,
                 path: str = "/verify") -> None:
        self.status = status
        self.kind = kind
        self.detail = detail
        super().__init__(f"{path} answered {status} {kind or ''}: {detail}".replace("  ", " "))


class ServerUnreachable(ClientError):
    """Transport errors (or a proxy's error answers) on every try."""


class WaitExceeded(ClientError):
    """No answer within the server's deadlines plus the client's slack."""


# ----------------------------------------------------------------------------- values


class Member(msgspec.Struct, frozen=True):
    """One member as the hook built it. ``extra`` keys (a ``principle``, an
    ``instance_config``, anything to be echoed) go into the body too; the identity keys
    (``_ng_group_id``, ``_ng_group_attempt``, ``_ng_rollout_index``) and the two objects always
    win over them."""

    group_id: str
    slot: int
    responses_create_params: dict[str, Any]
    response: dict[str, Any]
    attempt: int = 0
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    def encode(self) -> bytes:
        """The ``/verify`` body, encoded once: every re-send sends these bytes."""
        return _ENCODER.encode({
            **self.extra,
            "responses_create_params": self.responses_create_params,
            "response": self.response,
            "_ng_group_id": self.group_id,
            "_ng_group_attempt": self.attempt,
            "_ng_rollout_index": self.slot,
        })


class Rewarded(msgspec.Struct, frozen=True):
    """The slot's reward; ``answer`` is the server's whole 200 body."""

    reward: float
    answer: dict[str, Any]


class Masked(msgspec.Struct, frozen=True):
    """The judge failed for good: no reward. ``reason`` is the server's ``failure_reason``."""

    reason: str
    answer: dict[str, Any]


class Failed(msgspec.Struct, frozen=True):
    """The cohort failed without a judgement: HTTP ``status``, ``kind`` and ``detail``."""

    status: int
    kind: str
    detail: str


Outcome = Rewarded | Masked | Failed


class ServerSettings(msgspec.Struct, frozen=True):
    """What the client needs to know about the server. ``num_rollouts`` is the server's
    ``num_rollouts_per_prompt`` (None when unknown: no ``/status``); ``from_status`` says
    whether the numbers were read from the server or assumed."""

    collection_timeout_s: float
    evaluation_timeout_s: float
    num_rollouts: int | None = None
    from_status: bool = True

    @property
    def wait_s(self) -> float:
        return self.collection_timeout_s + self.evaluation_timeout_s


def bearer_token(token: str | None, token_env: str | None,
                 env: Mapping[str, str] | None = None) -> str | None:
    """The bearer token to send: ``token`` itself, else the variable ``token_env`` names (the
    same name as the server's ``auth_token_env``), else None. A named variable that is unset or
    blank raises ``ValueError`` naming it (never its value)."""
    if token is not None:
        if not token.strip():
            raise ValueError("token is blank")
        return token.strip()
    if token_env is None:
        return None
    value = (os.environ if env is None else env).get(token_env, "")
    if not value.strip():
        raise ValueError(f"environment variable {token_env!r} (token_env) is not set or empty")
    return value.strip()


# ----------------------------------------------------------------------------- the client


class GenRMClient:
    """An HTTP client of one genrm-trio server (or of HAProxy in front of its replicas), for
    the loop it is entered on::

        async with GenRMClient("http://127.0.0.1:8000", token_env="GENRM_TOKEN") as client:
            outcomes = await client.verify_groups(members)

    ``url`` is the base URL (a path prefix is kept: ``http://host/genrm`` posts to
    ``http://host/genrm/verify``). ``transport`` replaces httpx2's (tests); the connection
    bound then belongs to that transport. Nothing here starts a thread; a client's tasks live
    inside the call that started them.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_env: str | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        settings: ServerSettings | None = None,
        wait_s: float | None = None,
        slack_s: float = DEFAULT_SLACK_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        transport_retries: int = DEFAULT_TRANSPORT_RETRIES,
        max_overload_wait_s: float | None = None,
        transport: httpx2.AsyncBaseTransport | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        for name, value in (("slack_s", slack_s), ("connect_timeout_s", connect_timeout_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if wait_s is not None and not (math.isfinite(wait_s) and wait_s > 0):
            raise ValueError(f"wait_s must be finite and > 0, got {wait_s!r}")
        if transport_retries < 0:
            raise ValueError(f"transport_retries must be >= 0, got {transport_retries}")
        if max_overload_wait_s is not None and not max_overload_wait_s >= 0:
            raise ValueError(f"max_overload_wait_s must be >= 0, got {max_overload_wait_s!r}")
        self.url = url.rstrip("/")
        self.max_connections = max_connections
        self._token = bearer_token(token, token_env)
        self._settings = settings
        if wait_s is not None:
            self._settings = ServerSettings(wait_s, 0.0, settings.num_rollouts if settings
                                            else None, from_status=False)
        self._slack_s = slack_s
        self._connect_timeout_s = connect_timeout_s
        self._transport_retries = transport_retries
        self._max_overload_wait_s = max_overload_wait_s
        self._transport = transport
        self._http: httpx2.AsyncClient | None = None
        self._rng = random.Random()

    async def __aenter__(self) -> GenRMClient:
        headers = {"Content-Type": "application/json"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        self._http = httpx2.AsyncClient(
            headers=headers,
            # Plain HTTP needs no TLS context, and httpx2's default one (the CA bundle loaded)
            # costs about 40 ms of CPU per client: the hooks open a client per call (slime:
            # per group). https URLs keep the default verification.
            verify=not self.url.startswith("http://"),
            timeout=httpx2.Timeout(None, connect=self._connect_timeout_s),
            limits=httpx2.Limits(max_connections=self.max_connections,
                                 max_keepalive_connections=self.max_connections),
            transport=self._transport,
        )
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        http, self._http = self._http, None
        if http is not None:
            with anyio.CancelScope(shield=True):
                await http.aclose()

    def _client(self) -> httpx2.AsyncClient:
        if self._http is None:
            raise RuntimeError("GenRMClient is used outside its 'async with' block")
        return self._http

    # ------------------------------------------------------------------ settings

    async def settings(self) -> ServerSettings:
        """The server's deadlines and N, read from ``GET /status`` on the first call (or as
        given to the constructor). Raises :class:`RequestRefused` for a 401 (a wrong token
        fails here, before any member is sent) and :class:`ServerUnreachable` when the server
        cannot be reached; any other answer gives the contract's defaults and one warning."""
        if self._settings is not None:
            return self._settings
        failures = 0
        while True:
            try:
                with anyio.fail_after(STATUS_TIMEOUT_S):
                    answer = await self._client().get(self.url + "/status")
                break
            except (TimeoutError, *_RESENDABLE) as exc:
                failures += 1
                if failures > self._transport_retries:
                    raise ServerUnreachable(
                        f"GET {self.url}/status: {type(exc).__name__}: {exc}") from exc
                await anyio.sleep(self._backoff_s(failures))
        if answer.status_code == 401:
            raise RequestRefused(401, "unauthorized", _detail(answer))
        config = None
        if answer.status_code == 200:
            try:
                config = _DECODER.decode(answer.content).get("config")
            except (msgspec.DecodeError, AttributeError):
                config = None
        settings = _settings_from(config) if isinstance(config, dict) else None
        if settings is None:
            logger.warning(
                "%s/status gave no config summary (HTTP %d): assuming the contract's deadlines, "
                "%.0f s to collect and %.0f s to evaluate; pass wait_s= to say otherwise",
                self.url, answer.status_code, CONTRACT_DEADLINE_S, CONTRACT_DEADLINE_S)
            settings = ServerSettings(CONTRACT_DEADLINE_S, CONTRACT_DEADLINE_S, None,
                                      from_status=False)
        self._settings = settings
        return settings

    # ------------------------------------------------------------------ members

    async def verify(self, member: Member) -> Outcome:
        """Send one member and wait for its outcome (see the module docstring for how long,
        and what is re-sent). Cancelling the call closes its connection: the server then drops
        only this waiter, the member stays in its cohort."""
        settings = await self.settings()
        body = member.encode()
        failures = 0
        overloaded_s = 0.0
        overload_budget_s = (settings.collection_timeout_s if self._max_overload_wait_s is None
                             else self._max_overload_wait_s)
        while True:
            try:
                with anyio.fail_after(settings.wait_s + self._slack_s):
                    answer = await self._client().post(self.url + "/verify", content=body)
            except TimeoutError as exc:
                raise WaitExceeded(
                    f"member {member.slot} of {member.group_id!r}: no answer within "
                    f"{settings.wait_s + self._slack_s:.0f} s (the server's collection and "
                    "evaluation deadlines plus slack_s)") from exc
            except _RESENDABLE as exc:
                failures += 1
                if failures > self._transport_retries:
                    raise ServerUnreachable(
                        f"member {member.slot} of {member.group_id!r}: {type(exc).__name__}: "
                        f"{exc} ({failures} tries)") from exc
                logger.info("member %d of %.100r: %s, sending it again", member.slot,
                            member.group_id, type(exc).__name__)
                await anyio.sleep(self._backoff_s(failures))
                continue
            status = answer.status_code
            parsed = _json_object(answer)
            kind = parsed.get("failure_kind") if parsed is not None else None
            if status == 200 and parsed is not None:
                return _success(parsed, member)
            if status == 429 and kind == "overloaded":
                pause = _retry_after_s(answer.headers.get("retry-after"))
                if overloaded_s + pause > overload_budget_s:
                    raise RequestRefused(429, kind, _detail(answer) + (
                        f" (still overloaded after {overloaded_s:.0f} s of retries)"))
                overloaded_s += pause
                await anyio.sleep(pause)
                continue
            if kind in _COHORT_FAILURES:
                return Failed(status, str(kind), _detail(answer))
            if status in _PROXY_STATUSES and kind is None:
                failures += 1
                if failures > self._transport_retries:
                    raise ServerUnreachable(
                        f"member {member.slot} of {member.group_id!r}: HTTP {status} "
                        f"{_detail(answer)} ({failures} tries)")
                await anyio.sleep(self._backoff_s(failures))
                continue
            raise RequestRefused(status, kind if isinstance(kind, str) else None,
                                 _detail(answer))

    async def compare(self, conversation_history: Sequence[Mapping[str, Any]],
                      responses: Sequence[Mapping[str, Any]],
                      principle: str | None = None) -> list[Outcome]:
        """``POST /compare``: ``responses`` judged now, statelessly, one outcome each in their
        order: :class:`Rewarded` (``answer`` is the whole body), or for all of them
        :class:`Masked` (503 ``judge_failed``: the judge failed, or the evaluation deadline
        passed) or :class:`Failed` (503 ``evaluation_error``, ``shutdown``). Transport errors
        and proxy answers are re-sent as for :meth:`verify` (a re-send is judged again: there
        is no record to replay); waits up to ``cohort_evaluation_timeout_s`` plus ``slack_s``.
        Raises :class:`ClientError` as :meth:`verify` does."""
        settings = await self.settings()
        fields: dict[str, Any] = {"conversation_history": list(conversation_history),
                                  "response_objs": list(responses)}
        if principle is not None:
            fields["principle"] = principle
        body = _ENCODER.encode(fields)
        wait_s = (settings.evaluation_timeout_s if settings.evaluation_timeout_s > 0
                  else settings.wait_s) + self._slack_s
        failures = 0
        while True:
            try:
                with anyio.fail_after(wait_s):
                    answer = await self._client().post(self.url + "/compare", content=body)
            except TimeoutError as exc:
                raise WaitExceeded(f"/compare of {len(responses)} responses: no answer within "
                                   f"{wait_s:.0f} s") from exc
            except _RESENDABLE as exc:
                failures += 1
                if failures > self._transport_retries:
                    raise ServerUnreachable(f"/compare: {type(exc).__name__}: {exc} "
                                            f"({failures} tries)") from exc
                await anyio.sleep(self._backoff_s(failures))
                continue
            parsed = _json_object(answer)
            kind = parsed.get("failure_kind") if parsed is not None else None
            rewards = parsed.get("rewards") if parsed is not None else None
            if answer.status_code == 200 and isinstance(rewards, list) and len(rewards) == len(
                    responses):
                if not all(isinstance(r, int | float) and not isinstance(r, bool)
                           and math.isfinite(r) for r in rewards):
                    raise RequestRefused(200, None, f"rewards {rewards!r}", path="/compare")
                assert parsed is not None
                return [Rewarded(float(r), parsed) for r in rewards]
            if kind == "judge_failed":
                return [Masked(_detail(answer), parsed or {}) for _ in responses]
            if kind in ("evaluation_error", "shutdown"):
                return [Failed(answer.status_code, kind, _detail(answer)) for _ in responses]
            if answer.status_code in _PROXY_STATUSES and kind is None:
                failures += 1
                if failures > self._transport_retries:
                    raise ServerUnreachable(f"/compare: HTTP {answer.status_code} "
                                            f"{_detail(answer)} ({failures} tries)")
                await anyio.sleep(self._backoff_s(failures))
                continue
            raise RequestRefused(answer.status_code, kind if isinstance(kind, str) else None,
                                 _detail(answer), path="/compare")

    async def verify_groups(self, members: Sequence[Member]) -> list[Outcome]:
        """Outcomes of ``members``, in their order. Members are grouped by ``group_id``;
        a group is admitted whole once a connection is free for each of its members, groups in
        the order they first appear (module docstring, "Bounds"). The first
        :class:`ClientError` of any member cancels the others (their connections close; their
        members stay in their cohorts) and is raised. Raises ``ValueError`` before sending
        anything when a group is larger than ``max_connections``."""
        groups: dict[str, list[int]] = {}
        for position, member in enumerate(members):
            groups.setdefault(member.group_id, []).append(position)
        largest = max((len(g) for g in groups.values()), default=0)
        if largest > self.max_connections:
            raise ValueError(
                f"a group of {largest} members needs max_connections >= {largest}, "
                f"got {self.max_connections}")
        await self.settings()
        outcomes: list[Outcome | None] = [None] * len(members)
        error: list[ClientError] = []
        in_flight = 0
        freed = anyio.Event()

        async def one(position: int, scope: anyio.CancelScope) -> None:
            nonlocal in_flight
            try:
                outcomes[position] = await self.verify(members[position])
            except ClientError as exc:
                if not error:
                    error.append(exc)
                scope.cancel()
            finally:
                in_flight -= 1
                freed.set()

        async with anyio.create_task_group() as tasks:
            for positions in groups.values():
                while in_flight + len(positions) > self.max_connections:
                    freed = anyio.Event()
                    await freed.wait()
                in_flight += len(positions)
                for position in positions:
                    tasks.start_soon(one, position, tasks.cancel_scope)
        if error:
            raise error[0]
        done: list[Outcome] = []
        for outcome in outcomes:
            assert outcome is not None  # every task either set its outcome or raised
            done.append(outcome)
        return done

    def _backoff_s(self, failures: int) -> float:
        ceiling = min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_START_S * 2.0 ** (failures - 1))
        return ceiling * (0.5 + 0.5 * self._rng.random())


# ----------------------------------------------------------------------------- answers


def _settings_from(config: dict[str, Any]) -> ServerSettings | None:
    collection = config.get("cohort_collection_timeout_s")
    evaluation = config.get("cohort_evaluation_timeout_s")
    n = config.get("num_rollouts_per_prompt")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
               and v > 0 for v in (collection, evaluation)):
        return None
    assert isinstance(collection, int | float) and isinstance(evaluation, int | float)
    return ServerSettings(float(collection), float(evaluation),
                          n if isinstance(n, int) and not isinstance(n, bool) else None)


def _json_object(answer: httpx2.Response) -> dict[str, Any] | None:
    try:
        parsed = _DECODER.decode(answer.content)
    except msgspec.DecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _detail(answer: httpx2.Response) -> str:
    parsed = _json_object(answer)
    if parsed is not None and isinstance(parsed.get("detail"), str):
        text: str = parsed["detail"]
    else:
        text = answer.content[:DETAIL_CHARS].decode("utf-8", "replace") or answer.reason_phrase
    return text[:DETAIL_CHARS]


def _success(answer: dict[str, Any], member: Member) -> Outcome:
    if answer.get("mask_sample") is True:
        reason = answer.get("failure_reason")
        return Masked(reason[:DETAIL_CHARS] if isinstance(reason, str) else "", answer)
    reward = answer.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(
            reward):
        raise RequestRefused(200, None, f"answer for member {member.slot} of "
                             f"{member.group_id!r} has no finite reward: {reward!r}")
    return Rewarded(float(reward), answer)


def _retry_after_s(value: str | None) -> float:
    """RFC 9110 ``Retry-After``: delay-seconds or an HTTP-date; anything else, or nothing,
    :data:`OVERLOAD_DEFAULT_WAIT_S`."""
    if value is None:
        return OVERLOAD_DEFAULT_WAIT_S
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return OVERLOAD_DEFAULT_WAIT_S
    seconds: float = when.timestamp() - time.time()
    return max(0.0, seconds)
