"""TRL: :class:`GenRMReward`, an async reward function for ``GRPOTrainer(reward_funcs=[...])``.

What TRL 1.16 does with it (``trl/trainer/grpo_trainer.py``): ``_calculate_rewards`` calls every
reward function with ``prompts``, ``completions``, ``completion_ids``, ``trainer_state``,
``log_extra``, ``log_metric`` and every dataset column as keyword lists; an async one (a callable
whose ``__call__`` is ``async def``) is awaited on the trainer's own event loop, an asyncio loop in
a daemon thread, with the other async reward functions gathered beside it, while the training
thread waits. Each process scores only its own slice of the generation batch; the slices are then
gathered and the advantages computed per group of ``num_generations`` consecutive rows of the
global batch. The function's ``__name__`` names it in the logs (``rewards/<name>/mean``). A
``None`` becomes NaN: the completion is left out of its group's mean and std, and a row where
every reward function gave None is "unscorable": its advantage is set to 0 (no policy-gradient
signal; it still counts in the loss normaliser and the KL term) and it is left out of the logged
``reward``.

**The batch layout.** TRL's ``RepeatSampler`` puts a prompt's N copies next to each other in the
global generation batch, and accelerate hands process ``p`` the rows ``[p * B, (p + 1) * B)``
(``B`` = the process's ``len(prompts)``; TRL itself slices the gathered advantages this way). So a
row ``i`` of process ``p`` is global position ``p * B + i``: its group is that position divided by
N, its slot the remainder. A group can straddle two processes (N = 4, B = 6: process 0 holds
group 1's slots 0-1, process 1 its slots 2-3); both name the same cohort, so the server gathers
the two halves. N is ``num_generations`` while training and ``num_generations_eval`` while
evaluating (read from the trainer's ``model.training``, found through TRL's ``log_metric``
argument, a bound method of the trainer); the server's ``num_rollouts_per_prompt`` must equal it
(checked against ``GET /status`` before anything is sent).

**The group key** is the same string on every process: ``trl:<run>:<mode>:s<global step>:
c<call>:g<group>:<tag>``. ``run`` is ``run_id``, or a fresh random id made by process 0 and
broadcast to the others at the first call (so every launch, including a resumed one, names new
cohorts); ``call`` counts this object's calls (every process calls it once per generation
round, train or eval, so the count agrees; the global step alone repeats when a step generates
more than once); ``group`` is the group's index in the global batch; ``tag`` is the value of
``id_column`` when given, else the first 12 hex digits of the prompt's sha256. The same prompt
twice in one batch (a dataset with duplicate rows) is two groups with two indices: two cohorts,
each judged among its own N completions. Attempt is always 0: a key is never reused.

**Prompts and completions.** A plain prompt is sent as ``responses_create_params.input`` as is;
a conversational one as a list of message items (string content as is; list content keeps its
text parts, as ``input_text``, or ``output_text`` for assistant turns). A completion (a string,
or the assistant messages of a conversational completion, tool turns skipped) becomes a
Responses object with one ``message`` output item per assistant message. A ``principle``
column (``principle_column``) is sent as each member's principle.

**Outcomes.** A reward is returned as a float; a masked cohort (the judge failed for good) and
a failed one (503 ``cohort_incomplete``, ``superseded``, ``shutdown``...) as ``None``, counted
in the metrics ``<name>/masked`` and ``<name>/failed`` (the fraction of this process's rows)
and summed up in one warning line per call. A refusal (a 4xx: a wrong token, a conflicting
member, N not matching) raises :class:`~genrm_trio.integrations.client.ClientError`, which stops
the training step: those are configuration errors, not bad luck.

TRL, accelerate and torch are imported only inside the functions that need them (accelerate's
``PartialState`` and ``broadcast_object_list`` when the process index is not given): importing
this module needs none of them.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final

import httpx2

from genrm_trio.identity import canonical_json
from genrm_trio.integrations.client import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SLACK_S,
    DEFAULT_TRANSPORT_RETRIES,
    Failed,
    GenRMClient,
    Masked,
    Member,
    Outcome,
    Rewarded,
    ServerSettings,
)

__all__ = ["GenRMReward", "prompt_input", "completion_response"]

logger = logging.getLogger(__name__)

#: Longest ``run_id`` (the whole key stays far below the server's 512-character bound).
MAX_RUN_ID_CHARS: Final = 128
#: Longest ``id_column`` value used as is in a key; longer ones are replaced by a digest.
MAX_TAG_CHARS: Final = 128
_PROMPT_TAG_HEX: Final = 12
_REASON_CHARS: Final = 200


def prompt_input(prompt: Any) -> Any:
    """``responses_create_params.input`` for a TRL prompt: a string as is; a conversation
    (a list of ``{"role", "content"}`` messages) as message items. Raises ``TypeError`` for
    anything else."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return [_message_item(m) for m in prompt]
    raise TypeError(f"a TRL prompt is a string or a list of messages, got {type(prompt).__name__}")


def _message_item(message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role") if isinstance(message.get("role"), str) else "user"
    content = message.get("content")
    if isinstance(content, list):
        part_type = "output_text" if role == "assistant" else "input_text"
        content = [{"type": part_type, "text": part["text"]} for part in content
                   if isinstance(part, dict) and part.get("type") == "text"
                   and isinstance(part.get("text"), str)]
    elif not isinstance(content, str):
        content = "" if content is None else str(content)
    return {"type": "message", "role": role, "content": content}


def completion_response(completion: Any) -> dict[str, Any]:
    """A Responses object for a TRL completion: a string is one assistant message; a
    conversational completion keeps its assistant messages (tool turns are not the policy's
    answer). Deterministic, so a re-send has the same response digest. Raises ``TypeError``
    for anything else."""
    if isinstance(completion, str):
        texts = [completion]
    elif isinstance(completion, list) and all(isinstance(m, dict) for m in completion):
        texts = []
        for message in completion:
            if message.get("role", "assistant") != "assistant":
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p["text"] for p in content if isinstance(p, dict)
                                  and p.get("type") == "text" and isinstance(p.get("text"), str))
            texts.append(content if isinstance(content, str) else "")
    else:
        raise TypeError(
            f"a TRL completion is a string or a list of messages, got {type(completion).__name__}")
    output = [{"type": "message", "role": "assistant", "id": f"msg_{k}", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}
              for k, text in enumerate(texts)]
    return {"object": "response", "status": "completed", "model": "trl", "output": output}


class GenRMReward:
    """A genrm-trio cohort reward for TRL's ``GRPOTrainer``::

        reward = GenRMReward("http://genrm:8000", num_generations=8)
        trainer = GRPOTrainer(model=..., reward_funcs=[reward],
                              args=GRPOConfig(num_generations=8, ...), train_dataset=...)

    Build it on every process, before or after the trainer (with several processes and no
    ``run_id``, its first call is a collective: process 0's random run id is broadcast). The
    object keeps no connection between calls: each call opens a
    :class:`~genrm_trio.integrations.client.GenRMClient` on the loop it runs on and closes it,
    so it works on whichever loop TRL gives it and pickles as plain data. ``token`` /
    ``token_env``, ``max_connections``, ``wait_s``, ``slack_s``, ``connect_timeout_s`` and
    ``transport_retries`` go to the client (see its docstring); ``transport_factory`` makes the
    httpx2 transport of each call's client (tests). ``process_index`` and ``num_processes``
    default to the trainer's accelerator (read at the first call), else accelerate's
    ``PartialState``.
    """

    def __init__(
        self,
        url: str,
        *,
        num_generations: int,
        num_generations_eval: int | None = None,
        run_id: str | None = None,
        id_column: str | None = None,
        principle_column: str | None = "principle",
        name: str = "genrm",
        process_index: int | None = None,
        num_processes: int | None = None,
        token: str | None = None,
        token_env: str | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        wait_s: float | None = None,
        slack_s: float = DEFAULT_SLACK_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        transport_retries: int = DEFAULT_TRANSPORT_RETRIES,
        transport_factory: Callable[[], httpx2.AsyncBaseTransport] | None = None,
    ) -> None:
        if num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (a cohort), got {num_generations}")
        if num_generations_eval is not None and num_generations_eval < 2:
            raise ValueError(f"num_generations_eval must be >= 2, got {num_generations_eval}")
        if max_connections < max(num_generations, num_generations_eval or 0):
            raise ValueError("max_connections must be >= num_generations (a group is sent "
                             f"whole), got {max_connections}")
        if run_id is not None and not 0 < len(run_id) <= MAX_RUN_ID_CHARS:
            raise ValueError(f"run_id must have 1 to {MAX_RUN_ID_CHARS} characters")
        if (process_index is None) != (num_processes is None):
            raise ValueError("give both process_index and num_processes, or neither")
        if process_index is not None and num_processes is not None and not (
                0 <= process_index < num_processes):
            raise ValueError(f"process_index {process_index} not in [0, {num_processes})")
        # TRL names a reward function by its __name__ (rewards/<name>/mean in the logs).
        self.__name__ = name
        self.url = url
        self.num_generations = num_generations
        self.num_generations_eval = num_generations_eval or num_generations
        self.run_id: str | None = run_id
        self.id_column = id_column
        self.principle_column = principle_column
        # Read at the first call when not given: the trainer's accelerator knows them (its
        # distributed state may not exist yet when this object is built).
        self.process_index: int | None = process_index
        self.num_processes: int | None = num_processes
        self.calls = 0
        self._client_options: dict[str, Any] = {
            "token": token, "token_env": token_env, "max_connections": max_connections,
            "wait_s": wait_s, "slack_s": slack_s, "connect_timeout_s": connect_timeout_s,
            "transport_retries": transport_retries}
        # Fail at construction, not at the first step, on a bad token setting.
        GenRMClient(url, **self._client_options)
        self._transport_factory = transport_factory
        self._settings: ServerSettings | None = None
        self._mode_warned = False

    # ------------------------------------------------------------------ TRL's entry

    async def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Any] | None = None,
        trainer_state: Any = None,
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list[Any]], None] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        """One reward (or None) per completion of this process's slice, in order. Blocks (on
        the caller's loop, never a thread) until every group of the slice has its outcome;
        raises :class:`~genrm_trio.integrations.client.ClientError` on a refusal."""
        self._resolve(log_metric)
        call = self.calls
        self.calls += 1
        training = self._training(log_metric)
        mode = "train" if training else "eval"
        n = self.num_generations if training else self.num_generations_eval
        step = getattr(trainer_state, "global_step", None)
        members = self.members(prompts, completions, columns, mode=mode, call=call,
                               global_step=step if isinstance(step, int) else -1, n=n)
        transport = self._transport_factory() if self._transport_factory else None
        async with GenRMClient(self.url, settings=self._settings, transport=transport,
                               **self._client_options) as client:
            settings = await client.settings()
            self._settings = settings
            if settings.num_rollouts is not None and settings.num_rollouts != n:
                raise ValueError(
                    f"the server's num_rollouts_per_prompt is {settings.num_rollouts}, but "
                    f"this {mode} round has {n} generations per prompt "
                    f"({'num_generations' if training else 'num_generations_eval'}): "
                    "they must be equal")
            outcomes = await client.verify_groups(members)
        self._report(outcomes, log_metric)
        return [o.reward if isinstance(o, Rewarded) else None for o in outcomes]

    # ------------------------------------------------------------------ the mapping

    def members(self, prompts: Sequence[Any], completions: Sequence[Any],
                columns: dict[str, Any], *, mode: str, call: int, global_step: int,
                n: int) -> list[Member]:
        """The members of this process's slice (see the module docstring for the layout and
        the key). Pure: no I/O. Raises ``ValueError`` when the slice does not fit the layout
        (lengths, a group whose rows hold different prompts, which means N is wrong)."""
        assert self.process_index is not None and self.num_processes is not None
        size = len(prompts)
        if len(completions) != size:
            raise ValueError(f"{len(completions)} completions for {size} prompts")
        if (size * self.num_processes) % n:
            raise ValueError(f"a global batch of {size} x {self.num_processes} rows is not "
                             f"a whole number of groups of {n}")
        ids = columns.get(self.id_column) if self.id_column is not None else None
        if self.id_column is not None and (not isinstance(ids, list | tuple) or
                                           len(ids) != size):
            raise ValueError(f"id_column {self.id_column!r} is not a column of the dataset")
        principles = (columns.get(self.principle_column)
                      if self.principle_column is not None else None)
        members: list[Member] = []
        group_prompt: dict[int, bytes] = {}
        for row in range(size):
            position = self.process_index * size + row
            group, slot = divmod(position, n)
            rcp_input = prompt_input(prompts[row])
            canon = canonical_json(rcp_input)
            first = group_prompt.setdefault(group, canon)
            if first != canon:
                raise ValueError(
                    f"rows of group {group} (global positions {group * n}..{group * n + n - 1}) "
                    f"hold different prompts: {n} generations per prompt does not match the "
                    "trainer's batch")
            if ids is not None:
                tag = str(ids[row])
                if len(tag) > MAX_TAG_CHARS or ":" in tag:
                    tag = "id-" + hashlib.sha256(tag.encode("utf-8", "surrogatepass")
                                                 ).hexdigest()[:_PROMPT_TAG_HEX]
            else:
                tag = hashlib.sha256(canon).hexdigest()[:_PROMPT_TAG_HEX]
            extra: dict[str, Any] = {}
            if isinstance(principles, list | tuple) and len(principles) == size and isinstance(
                    principles[row], str):
                extra["principle"] = principles[row]
            members.append(Member(
                group_id=f"trl:{self.run_id}:{mode}:s{global_step}:c{call}:g{group}:{tag}",
                slot=slot, responses_create_params={"input": rcp_input},
                response=completion_response(completions[row]), extra=extra))
        return members

    # ------------------------------------------------------------------ helpers

    def _resolve(self, log_metric: Any) -> None:
        """At the first call: the process layout (the trainer's accelerator, reached through
        ``log_metric``, else accelerate's ``PartialState``) and, without a ``run_id``, a fresh
        one: process 0's, broadcast to the others (a collective; every process makes its first
        call at the same point of training, while the training threads wait)."""
        if self.process_index is None or self.num_processes is None:
            accelerator = getattr(getattr(log_metric, "__self__", None), "accelerator", None)
            index = getattr(accelerator, "process_index", None)
            count = getattr(accelerator, "num_processes", None)
            if isinstance(index, int) and isinstance(count, int):
                self.process_index, self.num_processes = index, count
            else:
                self.process_index, self.num_processes = _accelerate_process()
        if self.run_id is None:
            self.run_id = _shared_run_id(self.num_processes)

    def _training(self, log_metric: Any) -> bool:
        """True while training: the trainer's ``model.training``, reached through
        ``log_metric`` (a bound method of the trainer). Without it: training, with one
        warning when eval and train sizes differ."""
        trainer = getattr(log_metric, "__self__", None)
        model = getattr(trainer, "model", None)
        training = getattr(model, "training", None)
        accelerator = getattr(trainer, "accelerator", None)
        index = getattr(accelerator, "process_index", None)
        if isinstance(index, int) and index != self.process_index:
            raise ValueError(f"GenRMReward was built for process {self.process_index}, but "
                             f"the trainer runs as process {index}")
        if isinstance(training, bool):
            return training
        if self.num_generations_eval != self.num_generations and not self._mode_warned:
            self._mode_warned = True
            logger.warning("%s: cannot tell training from evaluation (no trainer behind "
                           "log_metric); using num_generations", self.__name__)
        return True

    def _report(self, outcomes: list[Outcome], log_metric: Any) -> None:
        masked = [o for o in outcomes if isinstance(o, Masked)]
        failed = [o for o in outcomes if isinstance(o, Failed)]
        if callable(log_metric) and outcomes:
            log_metric(f"{self.__name__}/masked", len(masked) / len(outcomes))
            log_metric(f"{self.__name__}/failed", len(failed) / len(outcomes))
        if masked or failed:
            first = (f"masked: {masked[0].reason[:_REASON_CHARS]}" if masked else
                     f"{failed[0].kind}: {failed[0].detail[:_REASON_CHARS]}")
            logger.warning(
                "%s: %d of %d completions got no reward (%d masked, %d failed; first %s): "
                "TRL leaves them out of their groups' statistics", self.__name__,
                len(masked) + len(failed), len(outcomes), len(masked), len(failed), first)


def _accelerate_process() -> tuple[int, int]:
    """This process's index and the process count, from accelerate (TRL's dependency)."""
    try:
        from accelerate import PartialState
    except ImportError as exc:
        raise ImportError("GenRMReward needs accelerate for the process layout (pip install "
                          "'genrm-trio[trl]'), or pass process_index and num_processes") from exc
    state = PartialState()
    return int(state.process_index), int(state.num_processes)


def _shared_run_id(num_processes: int) -> str:
    """A fresh run id, the same on every process: process 0's, broadcast (a collective)."""
    mine = uuid.uuid4().hex[:16]
    if num_processes == 1:
        return mine
    try:
        from accelerate.utils import broadcast_object_list
    except ImportError as exc:
        raise ImportError("with several processes and no run_id, GenRMReward broadcasts one "
                          "with accelerate (pip install 'genrm-trio[trl]')") from exc
    box: list[Any] = [mine]
    broadcast_object_list(box, from_process=0)
    return str(box[0])
