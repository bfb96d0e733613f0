"""``genrm-trio collect``: tasks -> policy generations -> ``POST /verify`` -> artifacts + metrics.

::

    run_collection                       owns: two httpx2 clients, the artifact files, progress
      +-- progress task                  a tqdm bar on a terminal, plain lines otherwise
      +-- groups nursery                 at most --max-concurrent-groups groups at once
            +-- group                    one task's N members, dispatched together
                  +-- member             generate (policy), then /verify; one row per outcome

Group-level admission: a group takes one token of a capacity limiter before any of its members
starts and gives it back when the last one ends, so a concurrency limit can never leave half a
cohort waiting for a slot that only a finished group would free. Every HTTP call runs inside a
trio deadline (``*_timeout_s``); httpx2's own timeouts are off.

Server backpressure (:class:`_AdmissionGate`): a server at ``max_active_cohorts`` refuses the
member that would open a NEW cohort with 429 ``overloaded`` (``Retry-After``) and admits every
member of a cohort that exists. So a group's first member to be ready (the leader) is sent
alone; the others follow once it was admitted: its answer came back and was not a refusal, or
it has been waiting on its cohort for ``admission_probe_s``. A refused leader waits and retries;
if it gives up, the rest of the group is never sent (recorded as ``admission`` failures), so a
refused group can never open a cohort that waits out the collection deadline. Every ``/verify``
request retries 429s, and 503s that carry ``Retry-After``: it waits the server's hint (at least
it, plus up to 20 % jitter; without a hint, exponential from 0.5 s) but never more than
``retry_after_cap_s`` at once, and gives up once the next wait would take its total past
``backpressure_give_up_s``.

Outcomes of one member: a 200 that is not masked is a success (``<out>.jsonl``); a masked 200
(``judge_failed``) always goes to the sidecar; an HTTP error or transport failure goes to the
sidecar only with ``--route-failures-to-sidecar`` (``agent_request_failed`` for 429/502/503/504,
timeouts and transport errors, else ``agent_run_error``), and is only counted otherwise.

The caller side talks to the server over HTTP only; it never imports ``genrm_trio.server``.
"""

from __future__ import annotations

import email.utils
import logging
import math
import os
import random
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, TextIO

import click
import httpx2
import msgspec
import trio

from genrm_trio.caller.aggregate import (
    FAILURE_CLASS_KEY,
    NO_RESULT_REASON,
    ArtifactError,
    MetricsInput,
    build_metrics_input,
    compute_metrics,
    failures_path_for,
    metrics_path_for,
    read_jsonl,
    rollout_key,
    slim_row,
    split_classes,
    write_bytes_atomic,
)
from genrm_trio.caller.progress import show_progress
from genrm_trio.errors import GenRMError
from genrm_trio.metrics import MASK_KEY, ROLLOUT_INDEX_KEY, TASK_INDEX_KEY, encode_metrics

log = logging.getLogger(__name__)

GROUP_ID_KEY = "_ng_group_id"
GROUP_ATTEMPT_KEY = "_ng_group_attempt"
AGENT_RUN_ERROR = "agent_run_error"
AGENT_REQUEST_FAILED = "agent_request_failed"
JUDGE_FAILED = "judge_failed"

_GATEWAY_STATUSES = frozenset({429, 502, 503, 504})
_TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_MAX_BODY_CHARS = 2000
_IDENTITY_ALIASES = ("group_id", "group_attempt", GROUP_ID_KEY, GROUP_ATTEMPT_KEY)

DEFAULT_SERVER_TOKEN_ENV = "GENRM_AUTH_TOKEN"
"""Sent as the server's bearer token when set (name the server's ``auth_token_env`` alike)."""

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class CollectError(GenRMError):
    """The collection cannot start: bad input, bad options, artifacts in the way (exit 2)."""


class CollectOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``collect`` needs. ``policy_url`` None: the CLI embeds the mock policy."""

    input_path: str
    output_path: str
    server_url: str
    num_repeats: int
    policy_url: str | None = None
    policy_api: Literal["responses", "chat"] = "responses"
    policy_model: str | None = None
    policy_api_key_env: str | None = None
    max_concurrent_groups: int = 8
    legacy_groups: bool = False
    route_failures_to_sidecar: bool = False
    count_failure_classes_as_zero: tuple[str, ...] = ()
    resume: bool = False
    replace_failed_groups: bool = False
    overwrite: bool = False
    disable_aggregation: bool = False
    max_attempts: int = 3
    limit: int | None = None
    verify_timeout_s: float = 3900.0
    policy_timeout_s: float = 600.0
    policy_retries: int = 2
    progress_interval_s: float = 10.0
    server_token_env: str | None = None
    admission_probe_s: float = 0.1
    retry_after_cap_s: float = 30.0
    backpressure_give_up_s: float = 900.0


@dataclass
class CollectionResult:
    """What a run did. ``exit_code``: 0 ok, 1 no result (no metrics written)."""

    exit_code: int
    metrics: dict[str, Any] | None
    metrics_input: MetricsInput
    groups_planned: int
    groups_skipped: int
    successes: int = 0
    masked: int = 0
    failed: int = 0
    backpressure_retries: int = 0
    reason: str | None = None


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """One group to dispatch: a task, its identity for this run, and its attempt."""

    task_index: int
    task: dict[str, Any]
    group_id: str | None
    attempt: int


@dataclass
class Progress:
    """Live counters of one run (mutated by member tasks, read by the display task)."""

    total_rollouts: int
    started_at: float
    done: int = 0
    masked: int = 0
    failed: int = 0
    in_flight: int = 0
    retries: int = 0

    @property
    def finished(self) -> int:
        return self.done + self.masked + self.failed

    def line(self, now: float) -> str:
        elapsed = max(now - self.started_at, 1e-9)
        return (
            f"collect: {self.finished}/{self.total_rollouts} rollouts | done {self.done} "
            f"masked {self.masked} failed {self.failed} in flight {self.in_flight} "
            f"backpressure retries {self.retries} | {self.finished / elapsed:.1f}/s"
        )


class _CallFailed(Exception):
    """One HTTP call gave no usable answer. ``status`` None: transport error or deadline."""

    def __init__(self, message: str, status: int | None, body: str | None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s


def parse_retry_after(value: str | None, now_epoch_s: float) -> float | None:
    """Seconds from a ``Retry-After`` value (delay-seconds or HTTP-date), None if absent or
    malformed. A date in the past is 0."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now_epoch_s)


class _AdmissionGate:
    """One group's admission: its leader probes the server, the others wait here.

    ``decided`` is set once: ``refusal`` None means the followers may go; else the leader gave
    up on backpressure and ``refusal`` is why (the followers are not sent)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery  # the group's: holds the leader's probe timers
        self.leader_taken = False
        self.decided = trio.Event()
        self.refusal: _CallFailed | None = None

    def admit(self) -> None:
        self.decided.set()

    def refuse(self, failure: _CallFailed) -> None:
        if not self.decided.is_set():
            self.refusal = failure
            self.decided.set()


async def _admit_after(gate: _AdmissionGate, scope: trio.CancelScope, probe_s: float) -> None:
    """The leader has waited ``probe_s`` without a refusal: it is in a cohort; open the gate."""
    with scope:
        await trio.sleep(probe_s)
        gate.admit()


def _bounded(text: str | None) -> str | None:
    if text is None or len(text) <= _MAX_BODY_CHARS:
        return text
    return text[:_MAX_BODY_CHARS] + "…"


def _failure_class(status: int | None) -> str:
    """agent_request_failed: nothing says the rollout ran; agent_run_error: it ran and broke."""
    if status is None or status in _GATEWAY_STATUSES:
        return AGENT_REQUEST_FAILED
    return AGENT_RUN_ERROR


def _chat_messages(prompt: Any) -> list[dict[str, str]]:
    """Responses ``input`` (string or items) as chat messages: message items only."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages: list[dict[str, str]] = []
    for item in prompt if isinstance(prompt, list) else []:
        if not isinstance(item, Mapping) or item.get("type", "message") != "message":
            continue
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(
                str(p.get("text", "")) for p in content if isinstance(p, Mapping)
            )
        messages.append({"role": str(item.get("role", "user")), "content": str(content or "")})
    return messages


def _response_from_chat(answer: Mapping[str, Any]) -> dict[str, Any]:
    """A chat completion turned into the Responses object /verify rewards."""
    choices = answer.get("choices") or [{}]
    text = str(((choices[0] or {}).get("message") or {}).get("content") or "")
    usage = answer.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens", 0)
    completion_tokens = usage.get("completion_tokens", 0)
    return {
        "id": str(answer.get("id", "")),
        "object": "response",
        "model": answer.get("model"),
        "status": "completed",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": prompt_tokens,
            "output_tokens": completion_tokens,
            "total_tokens": usage.get("total_tokens", prompt_tokens + completion_tokens),
        },
    }


def load_tasks(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The dataset: every non-blank line a JSON object with ``responses_create_params``.

    Blocking file I/O. Raises CollectError naming the line for anything else.
    """
    if not path.exists():
        raise CollectError(f"input {path}: no such file")
    try:
        rows = read_jsonl(path)
    except (ArtifactError, OSError) as exc:
        raise CollectError(f"input {path}: {exc}") from exc
    for number, row in enumerate(rows, 1):
        if not isinstance(row.get("responses_create_params"), dict):
            raise CollectError(f"input {path}: task {number} has no responses_create_params object")
    return rows[:limit] if limit is not None else rows


def plan_groups(
    tasks: list[dict[str, Any]],
    successes: list[dict[str, Any]],
    failures: list[dict[str, Any]],
    options: CollectOptions,
    run_id: str,
) -> tuple[list[GroupPlan], int]:
    """Which groups this run dispatches, with which identity; and how many were skipped.

    Pure. A task whose N rollouts all succeeded is skipped; one whose failed rollout already
    has ``max_attempts`` sidecar rows is skipped (retry cap). Everything else is re-run as a
    whole group (a cohort needs all N members). Identity: a fresh ``{run_id}-{task}`` group id
    at attempt 0; with ``--replace-failed-groups`` the task's last failed group id at its
    highest attempt + 1; with ``--legacy-groups`` none.
    """
    n = options.num_repeats
    resuming = options.resume or options.replace_failed_groups
    succeeded = {rollout_key(r) for r in successes}
    failure_rows: dict[int, list[dict[str, Any]]] = {}
    for row in failures:
        task = row.get(TASK_INDEX_KEY)
        if isinstance(task, int):
            failure_rows.setdefault(task, []).append(row)
    attempts_seen: dict[tuple[str, int], int] = {}
    for row in (*successes, *failures):
        gid, attempt = row.get(GROUP_ID_KEY), row.get(GROUP_ATTEMPT_KEY)
        task = row.get(TASK_INDEX_KEY)
        if isinstance(gid, str) and isinstance(attempt, int) and isinstance(task, int):
            attempts_seen[(gid, task)] = max(attempts_seen.get((gid, task), -1), attempt)

    plans: list[GroupPlan] = []
    skipped = 0
    for index, task in enumerate(tasks):
        body = {k: v for k, v in task.items() if k not in _IDENTITY_ALIASES}
        fresh = GroupPlan(
            index, body, None if options.legacy_groups else f"{run_id}-{index}", 0
        )
        if not resuming:
            plans.append(fresh)
            continue
        missing = [r for r in range(n) if (index, r) not in succeeded]
        if not missing:
            skipped += 1
            continue
        rows = failure_rows.get(index, [])
        tries = max(
            (sum(1 for f in rows if f.get(ROLLOUT_INDEX_KEY) == r) for r in missing), default=0
        )
        if tries >= options.max_attempts:
            skipped += 1
            log.warning("task %d: %d failed attempts, retry cap reached; skipped", index, tries)
            continue
        last_gid = next(
            (f[GROUP_ID_KEY] for f in reversed(rows) if isinstance(f.get(GROUP_ID_KEY), str)), None
        )
        if options.replace_failed_groups and last_gid is not None:
            attempt = attempts_seen.get((last_gid, index), -1) + 1
            plans.append(GroupPlan(index, body, last_gid, attempt))
        else:
            plans.append(fresh)
    return plans, skipped


def _validate(options: CollectOptions) -> None:
    if options.num_repeats < 1:
        raise CollectError("--num-repeats must be >= 1")
    if options.max_concurrent_groups < 1:
        raise CollectError("--max-concurrent-groups must be >= 1")
    if options.max_attempts < 1:
        raise CollectError("--max-attempts must be >= 1")
    if options.policy_retries < 0:
        raise CollectError("--policy-retries must be >= 0")
    for name in ("verify_timeout_s", "policy_timeout_s", "progress_interval_s",
                 "admission_probe_s", "retry_after_cap_s", "backpressure_give_up_s"):
        value = getattr(options, name)
        if not (math.isfinite(value) and value > 0):
            raise CollectError(f"--{name.replace('_', '-')} must be a finite number > 0")
    if options.replace_failed_groups and options.legacy_groups:
        raise CollectError("--replace-failed-groups needs explicit group ids (not --legacy-groups)")
    if options.policy_url is None:
        raise CollectError("no policy URL")
    server_auth_headers(options)  # a named token variable that is not set: stop before any call


class _Collector:
    """One run's shared state; every field is owned by :func:`run_collection`."""

    def __init__(
        self,
        options: CollectOptions,
        server: httpx2.AsyncClient,
        policy: httpx2.AsyncClient,
        main_file: trio.abc.AsyncResource,
        sidecar_file: trio.abc.AsyncResource,
        progress: Progress,
        successes: dict[tuple[Any, Any], dict[str, Any]],
        failures: list[dict[str, Any]],
    ) -> None:
        self.options = options
        self.server = server
        self.policy = policy
        self.main_file: Any = main_file
        self.sidecar_file: Any = sidecar_file
        self.progress = progress
        self.successes = successes
        self.failures = failures
        self.write_lock = trio.Lock()
        self.new_successes = 0
        self.new_masked = 0
        self.new_failed = 0
        self.backpressure_retries = 0
        self.rng = random.Random()
        headers = {}
        if options.policy_api_key_env:
            key = os.environ.get(options.policy_api_key_env)
            if key:
                headers["authorization"] = f"Bearer {key}"
        self.policy_headers = headers
        self.server_headers = server_auth_headers(options)

    async def _append(self, handle: Any, row: dict[str, Any], memory: Any) -> None:
        line = _encode(row) + b"\n"
        # Memory and file get the same rows in the same order: offline equals online.
        async with self.write_lock:
            memory(slim_row(row))
            await handle.write(line)
            await handle.flush()

    async def record_success(self, row: dict[str, Any]) -> None:
        await self._append(
            self.main_file, row, lambda slim: self.successes.__setitem__(rollout_key(slim), slim)
        )
        self.new_successes += 1
        self.progress.done += 1

    async def record_masked(self, row: dict[str, Any]) -> None:
        row.setdefault(FAILURE_CLASS_KEY, JUDGE_FAILED)
        await self._append(self.sidecar_file, row, self.failures.append)
        self.new_masked += 1
        self.progress.masked += 1

    async def record_failure(
        self, plan: GroupPlan, rollout_index: int, stage: str, failure: _CallFailed
    ) -> None:
        self.new_failed += 1
        self.progress.failed += 1
        log.warning(
            "task %d rollout %d: %s failed: %s", plan.task_index, rollout_index, stage,
            str(failure)[:200],
        )
        if not self.options.route_failures_to_sidecar:
            return
        row: dict[str, Any] = {
            TASK_INDEX_KEY: plan.task_index,
            ROLLOUT_INDEX_KEY: rollout_index,
            GROUP_ID_KEY: plan.group_id,
            GROUP_ATTEMPT_KEY: plan.attempt,
            FAILURE_CLASS_KEY: _failure_class(failure.status),
            "_ng_failure_stage": stage,
            "_ng_failure_http_status": failure.status,
            "_ng_failure_message": _bounded(str(failure)),
            "_ng_failure_response_body": _bounded(failure.body),
        }
        await self._append(self.sidecar_file, row, self.failures.append)

    async def _post_json(
        self, client: httpx2.AsyncClient, url: str, body: Any, deadline_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """POST JSON and decode the JSON answer, inside a trio deadline. Raises _CallFailed."""
        content = _encode(body)
        request_headers = {"content-type": "application/json", **(headers or {})}
        try:
            with trio.fail_after(deadline_s):
                response = await client.post(url, content=content, headers=request_headers)
        except trio.TooSlowError as exc:
            raise _CallFailed(f"no answer within {deadline_s:g} s from {url}", None, None) from exc
        except httpx2.HTTPError as exc:
            raise _CallFailed(f"{type(exc).__name__}: {exc} ({url})", None, None) from exc
        text = response.text
        if response.status_code != 200:
            raise _CallFailed(
                f"HTTP {response.status_code} from {url}", response.status_code, text,
                parse_retry_after(response.headers.get("retry-after"), time.time()))
        try:
            answer = _decode(response.content)
        except msgspec.DecodeError as exc:
            raise _CallFailed(f"answer from {url} is not JSON", 200, text) from exc
        if not isinstance(answer, dict):
            raise _CallFailed(f"answer from {url} is not a JSON object", 200, text)
        return answer

    async def generate(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """One policy generation, retried on transient failures. Raises _CallFailed."""
        params = dict(task["responses_create_params"])
        if self.options.policy_model and "model" not in params:
            params["model"] = self.options.policy_model
        base = str(self.options.policy_url).rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        if self.options.policy_api == "responses":
            url, body = f"{base}/v1/responses", params
        else:
            url = f"{base}/v1/chat/completions"
            body = {k: v for k, v in params.items() if k not in ("input", "max_output_tokens")}
            body["messages"] = _chat_messages(params.get("input"))
            if "max_output_tokens" in params:
                body["max_tokens"] = params["max_output_tokens"]
        for attempt in range(self.options.policy_retries + 1):
            try:
                answer = await self._post_json(
                    self.policy, url, body, self.options.policy_timeout_s, self.policy_headers
                )
            except _CallFailed as failure:
                retryable = failure.status is None or failure.status in _TRANSIENT_STATUSES
                if not retryable or attempt == self.options.policy_retries:
                    raise
                await trio.sleep(min(0.25 * 2**attempt, 5.0))
                continue
            return answer if self.options.policy_api == "responses" else _response_from_chat(answer)
        raise AssertionError("unreachable")

    def _backpressure_wait_s(self, failure: _CallFailed, retry: int) -> float | None:
        """How long to wait before retrying a refused ``/verify``, or None: not backpressure."""
        hint = failure.retry_after_s
        if failure.status == 429:
            base = hint if hint is not None else min(0.5 * 2.0 ** min(retry, 16), 30.0)
        elif failure.status == 503 and hint is not None:
            base = hint
        else:
            return None
        return min(base * self.rng.uniform(1.0, 1.2), self.options.retry_after_cap_s)

    async def verify(self, body: dict[str, Any], gate: _AdmissionGate | None = None) -> Any:
        """POST one member to ``/verify``, waiting out backpressure (see the module docstring).

        With ``gate`` (the group's leader), each attempt opens the gate once it has waited
        ``admission_probe_s`` unrefused or was answered with anything but backpressure; giving
        up refuses the gate. Raises _CallFailed with the last failure."""
        url = self.options.server_url.rstrip("/") + "/verify"
        waited_s = 0.0
        retry = 0
        while True:
            probe = trio.CancelScope()
            if gate is not None and not gate.decided.is_set():
                gate.nursery.start_soon(_admit_after, gate, probe, self.options.admission_probe_s)
            try:
                answer = await self._post_json(
                    self.server, url, body, self.options.verify_timeout_s, self.server_headers)
            except _CallFailed as failure:
                wait_s = self._backpressure_wait_s(failure, retry)
                if wait_s is None or waited_s + wait_s > self.options.backpressure_give_up_s:
                    if gate is not None:
                        if wait_s is None:
                            gate.admit()
                        else:
                            gate.refuse(failure)
                    raise
            else:
                if gate is not None:
                    gate.admit()
                return answer
            finally:
                probe.cancel()
            retry += 1
            self.backpressure_retries += 1
            self.progress.retries += 1
            await trio.sleep(wait_s)
            waited_s += wait_s

    async def run_member(self, plan: GroupPlan, rollout_index: int,
                         gate: _AdmissionGate | None = None) -> None:
        """Generate one rollout and verify it; record exactly one outcome. Never raises
        (except Cancelled): failures become rows or counts. With ``gate``, the first member to
        be generated leads the group's admission and the others wait for it."""
        self.progress.in_flight += 1
        try:
            try:
                response = await self.generate(plan.task)
            except _CallFailed as failure:
                await self.record_failure(plan, rollout_index, "policy", failure)
                return
            body = dict(plan.task)
            body["response"] = response
            body[TASK_INDEX_KEY] = plan.task_index
            body[ROLLOUT_INDEX_KEY] = rollout_index
            if plan.group_id is not None:
                body[GROUP_ID_KEY] = plan.group_id
                body[GROUP_ATTEMPT_KEY] = plan.attempt
            leads = gate is not None and not gate.leader_taken
            if gate is not None and not leads:
                await gate.decided.wait()
                if gate.refusal is not None:
                    refusal = gate.refusal
                    await self.record_failure(plan, rollout_index, "admission", _CallFailed(
                        f"not sent: the group's first member was refused ({refusal})",
                        refusal.status, refusal.body))
                    return
            elif gate is not None:
                gate.leader_taken = True
            try:
                answer = await self.verify(body, gate if leads else None)
            except _CallFailed as failure:
                await self.record_failure(plan, rollout_index, "verify", failure)
                return
            if answer.get(MASK_KEY) is True:
                await self.record_masked(answer)
            else:
                await self.record_success(answer)
        finally:
            self.progress.in_flight -= 1

    async def run_group(self, plan: GroupPlan, limiter: trio.CapacityLimiter) -> None:
        """All N members of one group at once; gives back the group's limiter token at the end."""
        try:
            async with trio.open_nursery() as members:
                gate = _AdmissionGate(members) if self.options.num_repeats > 1 else None
                for rollout_index in range(self.options.num_repeats):
                    members.start_soon(self.run_member, plan, rollout_index, gate)
        finally:
            limiter.release_on_behalf_of(plan)


def server_auth_headers(options: CollectOptions) -> dict[str, str]:
    """The ``Authorization`` header for the server: the token in ``server_token_env`` (default
    :data:`DEFAULT_SERVER_TOKEN_ENV`, used only when set). Raises CollectError when a variable
    named explicitly is not set. The token is never logged."""
    name = options.server_token_env or DEFAULT_SERVER_TOKEN_ENV
    token = os.environ.get(name, "").strip()
    if not token:
        if options.server_token_env is not None:
            raise CollectError(f"--server-token-env: environment variable {name!r} is not set")
        return {}
    return {"authorization": f"Bearer {token}"}


def _read_existing(path: Path) -> list[dict[str, Any]]:
    try:
        return read_jsonl(path)
    except (ArtifactError, OSError) as exc:
        raise CollectError(str(exc)) from exc


def _prepare(
    options: CollectOptions,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Blocking start-up file work: tasks, existing successes and failures; clears a stale
    metrics file (so a run that ends without result leaves none). Raises CollectError."""
    output = Path(options.output_path)
    sidecar = failures_path_for(output)
    tasks = load_tasks(Path(options.input_path), options.limit)
    resuming = options.resume or options.replace_failed_groups
    if not resuming and not options.overwrite and (output.exists() or sidecar.exists()):
        raise CollectError(
            f"{output} or its sidecar exists; pass --resume, --replace-failed-groups or --overwrite"
        )
    old_successes = _read_existing(output) if resuming else []
    old_failures = _read_existing(sidecar) if resuming else []
    output.parent.mkdir(parents=True, exist_ok=True)
    metrics_path_for(output).unlink(missing_ok=True)
    return tasks, old_successes, old_failures


async def run_collection(
    options: CollectOptions, *, progress_stream: TextIO | None = None
) -> CollectionResult:
    """Run one collection to the end and write its artifacts.

    Blocks until every planned group has an outcome (bounded by the per-call deadlines).
    Cancellation stops every in-flight call; rows already written stay (``--resume`` picks up).
    Raises CollectError before any call when the input, the options or the existing artifacts
    make the run impossible. Returns the run's result; ``exit_code`` 1 means the no-result guard
    applied and no metrics file exists.
    """
    _validate(options)
    output = Path(options.output_path)
    sidecar = failures_path_for(output)
    metrics_file = metrics_path_for(output)
    resuming = options.resume or options.replace_failed_groups
    tasks, old_successes, old_failures = await trio.to_thread.run_sync(_prepare, options)
    run_id = uuid.uuid4().hex[:16]
    plans, skipped = plan_groups(tasks, old_successes, old_failures, options, run_id)
    log.info(
        "collect run %s: %d tasks, %d groups to run, %d skipped", run_id, len(tasks), len(plans),
        skipped,
    )

    successes = {rollout_key(r): slim_row(r) for r in old_successes}
    failures = [slim_row(r) for r in old_failures]
    mode = "ab" if resuming else "wb"
    progress = Progress(len(plans) * options.num_repeats, trio.current_time())
    stream = progress_stream if progress_stream is not None else sys.stderr
    connections = options.max_concurrent_groups * options.num_repeats
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)

    async with (
        await trio.open_file(output, mode) as main_file,
        await trio.open_file(sidecar, mode) as sidecar_file,
        httpx2.AsyncClient(timeout=None, limits=limits, trust_env=False) as server_client,
        httpx2.AsyncClient(timeout=None, limits=limits, trust_env=False) as policy_client,
    ):
        collector = _Collector(
            options, server_client, policy_client, main_file, sidecar_file, progress,
            successes, failures,
        )
        if plans:
            async with trio.open_nursery() as outer:
                outer.start_soon(show_progress, progress, stream, options.progress_interval_s)
                limiter = trio.CapacityLimiter(options.max_concurrent_groups)
                async with trio.open_nursery() as groups:
                    for plan in plans:
                        await limiter.acquire_on_behalf_of(plan)
                        groups.start_soon(collector.run_group, plan, limiter)
                outer.cancel_scope.cancel()
            stream.write(f"{progress.line(trio.current_time())}\n")
            stream.flush()

    metrics_input = build_metrics_input(
        successes.values(), failures, options.count_failure_classes_as_zero
    )
    result = CollectionResult(
        exit_code=0,
        metrics=None,
        metrics_input=metrics_input,
        groups_planned=len(plans),
        groups_skipped=skipped,
        successes=collector.new_successes,
        masked=collector.new_masked,
        failed=collector.new_failed,
        backpressure_retries=collector.backpressure_retries,
    )
    if not metrics_input.has_result:
        result.exit_code = 1
        result.reason = NO_RESULT_REASON
        return result
    if not options.disable_aggregation:
        result.metrics = compute_metrics(metrics_input)
        await trio.to_thread.run_sync(
            write_bytes_atomic, metrics_file, encode_metrics(result.metrics)
        )
    return result


async def collect_main(
    options: CollectOptions,
    *,
    mock_policy_overrides: tuple[str, ...] = (),
    progress_stream: TextIO | None = None,
) -> CollectionResult:
    """``run_collection``, first starting the embedded mock policy when no policy URL is given.

    The embedded policy lives in this function's nursery and stops when the run ends.
    """
    if options.policy_url is not None:
        return await run_collection(options, progress_stream=progress_stream)
    # Imported here: only this entry point needs the embedded policy (and Hypercorn).
    from genrm_trio.caller.mock_policy import load_mock_policy_settings, run_mock_policy

    settings = load_mock_policy_settings(None, mock_policy_overrides, host="127.0.0.1", port=0)
    outcome: CollectionResult | CollectError
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(run_mock_policy, settings))
        try:
            outcome = await run_collection(
                msgspec.structs.replace(options, policy_url=url), progress_stream=progress_stream
            )
        except CollectError as exc:
            # Raised after the nursery closes, so callers see it bare, not in a group.
            outcome = exc
        nursery.cancel_scope.cancel()
    if isinstance(outcome, CollectError):
        raise outcome
    return outcome


@click.command("collect")
@click.option("--input", "input_path", required=True, type=click.Path(dir_okay=False))
@click.option("--output", "output_path", required=True, type=click.Path(dir_okay=False))
@click.option("--server", "server_url", required=True,
              help="genrm-trio (or genrm_compare) base URL.")
@click.option("--policy-url", default=None, help="OpenAI-compatible policy base URL; "
              "omitted: an embedded deterministic mock policy.")
@click.option("--policy-api", type=click.Choice(["responses", "chat"]), default="responses")
@click.option("--policy-model", default=None, help="Model name sent when the task has none.")
@click.option("--policy-api-key-env", default=None, metavar="ENV",
              help="Environment variable holding the policy's bearer token.")
@click.option("--mock-policy-set", "mock_policy_overrides", multiple=True, metavar="KEY=VALUE",
              help="Setting of the embedded mock policy (repeatable).")
@click.option("--num-repeats", required=True, type=int, help="Rollouts per task (the server's N).")
@click.option("--max-concurrent-groups", default=8, show_default=True, type=int)
@click.option("--legacy-groups", is_flag=True, help="Send no _ng_group_id (legacy cohort keys).")
@click.option("--route-failures-to-sidecar", is_flag=True,
              help="Write HTTP/transport failures of /verify and the policy to the sidecar.")
@click.option("--count-failure-classes-as-zero", "count_classes", multiple=True,
              metavar="CLASS[,CLASS...]", help="Failure classes counted as reward 0.0 in metrics.")
@click.option("--resume", is_flag=True, help="Skip rollouts already in the output; retry failures.")
@click.option("--replace-failed-groups", is_flag=True,
              help="Re-run failed groups under their group id with the attempt advanced.")
@click.option("--overwrite", is_flag=True, help="Start over even if the output exists.")
@click.option("--disable-aggregation", is_flag=True, help="Write no metrics file.")
@click.option("--max-attempts", default=3, show_default=True, type=int,
              help="Failed attempts per rollout after which --resume stops retrying it.")
@click.option("--limit", default=None, type=int, help="Only the first N tasks.")
@click.option("--verify-timeout-s", default=3900.0, show_default=True, type=float)
@click.option("--policy-timeout-s", default=600.0, show_default=True, type=float)
@click.option("--policy-retries", default=2, show_default=True, type=int)
@click.option("--progress-interval-s", default=10.0, show_default=True, type=float)
@click.option("--server-token-env", default=None, metavar="ENV",
              help=f"Environment variable holding the server's bearer token (default: "
              f"{DEFAULT_SERVER_TOKEN_ENV}, sent only when set).")
@click.option("--admission-probe-s", default=0.1, show_default=True, type=float,
              help="A group's first member unrefused this long counts as admitted; then the "
              "rest of the group is sent.")
@click.option("--retry-after-cap-s", default=30.0, show_default=True, type=float,
              help="Longest single wait on a 429 / 503 Retry-After.")
@click.option("--backpressure-give-up-s", default=900.0, show_default=True, type=float,
              help="Total waiting on backpressure after which a request gives up.")
def collect_cli(
    mock_policy_overrides: tuple[str, ...], count_classes: tuple[str, ...], **kwargs: Any
) -> None:
    """Generate N rollouts per task, verify them with the server, write the artifacts.

    Exit codes: 0 done (metrics written unless --disable-aggregation), 1 no result (no success
    and no counted failure; no metrics file), 2 bad input, options or artifacts.
    """
    from genrm_trio.logs import setup_logging

    setup_logging("INFO", "auto")  # JSON lines off a terminal, key=value on one
    options = CollectOptions(count_failure_classes_as_zero=split_classes(count_classes), **kwargs)
    if options.policy_url is None and not mock_policy_overrides:
        log.info("no --policy-url: using the embedded mock policy")
    try:
        result = trio.run(
            partial(collect_main, options, mock_policy_overrides=mock_policy_overrides)
        )
    except (CollectError, click.BadParameter) as exc:
        message = exc.message if isinstance(exc, click.BadParameter) else str(exc)
        click.echo(f"genrm-trio collect: {message}", err=True)
        raise SystemExit(2) from exc
    if result.exit_code != 0:
        click.echo(f"genrm-trio collect: {result.reason}", err=True)
        raise SystemExit(result.exit_code)
    if result.metrics is not None:
        key = result.metrics["key_metrics"]
        click.echo(encode_metrics({"key_metrics": key}).decode(), nl=False)

