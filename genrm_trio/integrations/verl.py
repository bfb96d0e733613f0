"""veRL: two reward managers that get each sample's reward from its genrm-trio cohort.

Read from veRL 0.9.1 (``pip install verl==0.9.1``); every fact below is from its source.

**The reward loop** (``verl/experimental/reward_loop/``), veRL 0.9.1's only reward path: a
``RewardLoopWorker`` (a Ray actor; ``reward.num_workers`` of them, default 8) loads the manager
class named by ``reward.reward_manager`` (``source: importlib``, ``name`` the class,
``module.path`` a file or ``pkg://`` module: ``verl/trainer/ppo/reward.py``,
``resolve_reward_manager_cls``) and builds it with ``(config, tokenizer, compute_score,
reward_router_address, reward_model_tokenizer)``; ``config`` is the whole trainer config. It
awaits ``run_single(data)`` once per sample, concurrently on the worker's asyncio loop, for a
one-sample ``DataProto``: the agent loop sends each sample as soon as it is generated (to a
worker chosen at random), or ``RewardLoopManager.compute_rm_score`` splits the batch into one
chunk per worker. Either way a group's samples reach different workers, in no order, and the
sample carries its ``uid`` (one uuid4 per prompt, set before the batch is repeated
``rollout.n`` times) and ``raw_prompt``, but no index within its group and no sign of whether
it is a validation sample. The manager's class method ``assemble_rm_scores`` (inherited from
``RewardManagerBase``) puts each score at the sample's last valid response token, in batch
order; ``reward_extra_info`` values become arrays keyed by the FIRST sample's keys, so every
sample must return the same keys. With ``reward.reward_model.enable`` and no
``custom_reward_function.path`` the worker scores with that model instead and never calls the
manager: keep it off.

:class:`GenRMRewardLoopManager` therefore:

- posts the sample as a member of the explicit group ``verl:<uid>`` (attempt 0: a uid is never
  reused), with ``raw_prompt`` as ``responses_create_params.input`` (message items, as for TRL)
  and the response decoded without special tokens as a Responses object;
- finds its own slot: it tries slot ``s`` (a random start), and on ``409 conflict`` (the slot
  holds another member's response) the next one, at most N tries. The server answers a
  conflict at once and changes nothing, so the group's members spread over the N slots in at
  most N tries each, whichever worker scores them. The response object carries a random id per
  sample, so two samples of a group with the same text are two members (the server re-attaches
  an identical body to its slot: a re-send, never a second member);
- never holds a thread: the wait is one task and one connection on the worker's own loop (a
  ``compute_score`` function run in veRL's default executor would hold one of its
  ``min(32, cpus + 4)`` threads per waiting sample, and a batch with more waiting samples than
  threads never completes its groups);
- N is the server's ``num_rollouts_per_prompt`` (from ``GET /status``). It must equal
  ``actor_rollout_ref.rollout.n`` (checked at the first sample) and, when validation runs
  (``trainer.test_freq > 0`` or ``trainer.val_before_train``), ``rollout.val_kwargs.n`` too
  (checked when the manager is built): veRL 0.9.1 does not tell a reward manager that a sample
  is a validation sample, so one N serves both.

**What veRL trains on.** A score must be a number (``assemble_rm_scores`` makes a tensor). A
masked cohort (the judge failed for good) and a failed one (``cohort_incomplete``,
``superseded``, ``shutdown``, ...) give every sample of the cohort the same score,
:data:`MASKED_SCORE` (0.0), with ``genrm_masked = 1.0`` in ``reward_extra_info``. A whole group
with one score has zero advantage under every group baseline veRL computes by uid (``grpo``,
``rloo``, ``grpo_passk``, ``reinforce_plus_plus_baseline``, ``dr_grpo``...): no policy-gradient
signal from it (it still counts in the loss normaliser and the KL and entropy terms), and a
dynamic-sampling filter on the group's std drops it. Under a batch-level baseline (``gae``,
``reinforce_plus_plus``, ``remax``) the 0.0 would be trained on: use a group estimator. The
failure kind and reason are in ``genrm_failure_kind`` / ``genrm_failure_reason`` (strings:
veRL's validation metrics skip them); ``genrm_member`` is ``<group id>#<slot>``. A refusal (a
4xx: a wrong token, N not matching, a prompt mismatch) raises
:class:`~genrm_trio.integrations.client.ClientError`, which fails the training step.

**The legacy manager** :class:`GenRMRewardManager` is an ``AbstractRewardManager``
(``verl/workers/reward_manager/abstract.py``: ``__init__(tokenizer, num_examine,
compute_score, reward_fn_key, **reward_kwargs)``, ``__call__(data, return_dict)``), for the
releases whose trainer calls one manager with the whole batch (those that still have
``reward_model.use_reward_loop``, set to false; 0.9.1's trainer has no such path but still
ships the class). It sees the
batch in the trainer's order (reordered by ``_balance_batch``): it groups the rows by uid, each
group's slots in the order its rows appear, sends every group as one cohort (whole groups at a
time, :meth:`~genrm_trio.integrations.client.GenRMClient.verify_groups`) and puts each reward
back on its own row. ``__call__`` is synchronous (veRL calls it so): it runs the client on an
event loop of its own for the call.

**Settings**, from ``reward.reward_kwargs`` (the reward loop) or the legacy manager's keyword
arguments (``reward_model.reward_kwargs``), all with the ``genrm_`` prefix: ``genrm_url``
(required), ``genrm_token_env``, ``genrm_max_connections``, ``genrm_wait_s``, ``genrm_slack_s``
(see :class:`~genrm_trio.integrations.client.GenRMClient`). The reward loop's client has no
bound of its own by default: every sample veRL sends waits at once (veRL bounds them), and a
bound below that would strand half groups behind each other.

veRL, torch and its tokenizer are imported only inside the functions and classes that need
them; the two classes are built at first access (the module's ``__getattr__``, which is what
veRL's ``getattr(module, name)`` reaches), so importing this module needs no veRL.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import anyio
import anyio.lowlevel
import msgspec

from genrm_trio.integrations.client import (
    DEFAULT_SLACK_S,
    Failed,
    GenRMClient,
    Masked,
    Member,
    Outcome,
    RequestRefused,
    Rewarded,
)
from genrm_trio.integrations.trl import prompt_input

__all__ = [
    "EXTRA_KEYS",
    "MASKED_SCORE",
    "GenRMOptions",
    "batch_members",
    "check_rollout_n",
    "group_id_of",
    "outcome_entry",
    "response_object",
    "verify_with_free_slot",
]

logger = logging.getLogger(__name__)

#: The score of every sample of a masked or failed cohort (module docstring).
MASKED_SCORE: Final = 0.0
#: The keys of every ``reward_extra_info`` (the same for every sample, as veRL requires).
EXTRA_KEYS: Final = ("genrm_masked", "genrm_failure_kind", "genrm_failure_reason",
                     "genrm_member")
#: The reward loop's client bound: none to speak of (module docstring, "Settings").
UNBOUNDED_CONNECTIONS: Final = 1 << 20
GROUP_PREFIX: Final = "verl:"
#: A uid longer than this is replaced by its digest (the server keeps group ids up to 512).
MAX_UID_CHARS: Final = 256
_REASON_CHARS: Final = 200


# ----------------------------------------------------------------------------- settings


class GenRMOptions(msgspec.Struct, frozen=True):
    """The ``genrm_*`` settings of a manager (module docstring, "Settings")."""

    url: str
    token_env: str | None = None
    max_connections: int | None = None
    wait_s: float | None = None
    slack_s: float = DEFAULT_SLACK_S

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None, where: str) -> GenRMOptions:
        """The options from ``genrm_*`` keys of ``kwargs`` (other keys are ignored: they belong
        to other managers). Raises ``ValueError`` naming ``where`` and the key."""
        kwargs = kwargs or {}
        url = kwargs.get("genrm_url")
        if not isinstance(url, str) or not url.strip():
            raise ValueError(f"{where}.genrm_url is required: the genrm-trio server's base URL "
                             "(http://host:port)")
        token_env = kwargs.get("genrm_token_env")
        if token_env is not None and not isinstance(token_env, str):
            raise ValueError(f"{where}.genrm_token_env must be the name of an environment "
                             "variable")
        max_connections = kwargs.get("genrm_max_connections")
        if max_connections is not None and (isinstance(max_connections, bool) or not isinstance(
                max_connections, int) or max_connections < 1):
            raise ValueError(f"{where}.genrm_max_connections must be an integer >= 1")
        wait_s = _seconds(kwargs.get("genrm_wait_s"), f"{where}.genrm_wait_s", optional=True)
        slack_s = _seconds(kwargs.get("genrm_slack_s", DEFAULT_SLACK_S),
                           f"{where}.genrm_slack_s", optional=False)
        assert slack_s is not None
        return cls(url.strip(), token_env, max_connections, wait_s, slack_s)

    def client(self, *, max_connections: int) -> GenRMClient:
        return GenRMClient(self.url, token_env=self.token_env, wait_s=self.wait_s,
                           slack_s=self.slack_s,
                           max_connections=self.max_connections or max_connections)


def _seconds(value: Any, name: str, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_rollout_n(config: Any) -> int:
    """``actor_rollout_ref.rollout.n`` of a veRL trainer config (a mapping or an OmegaConf
    node), after checking that validation, when it runs, samples as many: ``val_kwargs.n``
    must then be equal (module docstring). Raises ``ValueError`` naming the keys."""
    rollout = _get(_get(config, "actor_rollout_ref"), "rollout")
    n = _get(rollout, "n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"actor_rollout_ref.rollout.n must be >= 2 for cohorts, got {n!r}")
    trainer = _get(config, "trainer")
    test_freq = _get(trainer, "test_freq")
    validates = bool(_get(trainer, "val_before_train")) or (
        isinstance(test_freq, int) and not isinstance(test_freq, bool) and test_freq > 0)
    val_n = _get(_get(rollout, "val_kwargs"), "n")
    if validates and val_n != n:
        raise ValueError(
            f"actor_rollout_ref.rollout.val_kwargs.n is {val_n!r} but rollout.n is {n}: veRL "
            "does not tell a reward manager which samples are validation samples, so a "
            "genrm-trio cohort size serves both; set val_kwargs.n equal to rollout.n, or turn "
            "validation off (trainer.test_freq=-1 trainer.val_before_train=false)")
    return n


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    getter = getattr(node, "get", None)
    return getter(key) if callable(getter) else getattr(node, key, None)


# ----------------------------------------------------------------------------- the mapping


def group_id_of(uid: Any) -> str:
    """The explicit group id of the samples with veRL uid ``uid``: ``verl:<uid>`` (a very
    long uid by its digest)."""
    text = str(uid)
    if len(text) > MAX_UID_CHARS:
        text = "sha256-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return GROUP_PREFIX + text


def response_object(text: str, *, response_id: str | None = None,
                    model: str = "verl") -> dict[str, Any]:
    """A Responses object with one assistant message, ``text``. ``response_id`` (the reward
    loop's per-sample nonce) makes equal texts two distinct members."""
    message = {"type": "message", "role": "assistant", "id": "msg_0", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}
    body: dict[str, Any] = {"object": "response", "status": "completed", "model": model,
                            "output": [message]}
    if response_id is not None:
        body["id"] = response_id
    return body


def batch_members(uids: Sequence[Any], prompts: Sequence[Any], texts: Sequence[str],
                  *, n: int | None = None) -> list[Member]:
    """The legacy manager's members, one per row, in the rows' order: grouped by uid, each
    group's slots in the order its rows appear (whatever order veRL's balancing left them in).
    Pure. Raises ``ValueError`` when the groups are not all of one size (of ``n`` when given)
    or a group's rows hold different prompts."""
    if not len(uids) == len(prompts) == len(texts):
        raise ValueError(f"{len(uids)} uids, {len(prompts)} prompts, {len(texts)} responses")
    slots: dict[str, int] = {}
    first_prompt: dict[str, bytes] = {}
    members: list[Member] = []
    for uid, prompt, text in zip(uids, prompts, texts, strict=True):
        group = group_id_of(uid)
        slot = slots.get(group, 0)
        slots[group] = slot + 1
        rcp_input = prompt_input(prompt)
        canon = msgspec.json.encode(rcp_input)
        if first_prompt.setdefault(group, canon) != canon:
            raise ValueError(f"rows of uid {str(uid)[:100]!r} hold different prompts")
        members.append(Member(group_id=group, slot=slot,
                              responses_create_params={"input": rcp_input},
                              response=response_object(text)))
    sizes = set(slots.values())
    expected = {n} if n is not None else sizes
    if len(sizes) > 1 or (sizes and sizes != expected):
        shown = ", ".join(f"{g[len(GROUP_PREFIX):][:40]}: {s}" for g, s in
                          list(slots.items())[:4])
        raise ValueError(
            f"every uid must have {n if n is not None else 'the same number of'} samples "
            f"(the server's num_rollouts_per_prompt); got {shown}")
    return members


def outcome_entry(outcome: Outcome, member: Member) -> tuple[float, dict[str, Any]]:
    """The score and the ``reward_extra_info`` of one sample (module docstring, "What veRL
    trains on"): the same :data:`EXTRA_KEYS` for every outcome."""
    where = f"{member.group_id}#{member.slot}"
    if isinstance(outcome, Rewarded):
        return outcome.reward, {"genrm_masked": 0.0, "genrm_failure_kind": "",
                                "genrm_failure_reason": "", "genrm_member": where}
    if isinstance(outcome, Masked):
        kind, reason = "judge_failed", outcome.reason
    else:
        kind, reason = outcome.kind, outcome.detail
    return MASKED_SCORE, {"genrm_masked": 1.0, "genrm_failure_kind": kind,
                          "genrm_failure_reason": reason[:_REASON_CHARS],
                          "genrm_member": where}


async def verify_with_free_slot(client: GenRMClient, member: Member, n: int) -> tuple[
        Outcome, Member]:
    """Send ``member`` at its slot, and on ``409 conflict`` at the next one (modulo ``n``),
    at most ``n`` tries (module docstring): the outcome and the member as it was placed.
    Raises ``ValueError`` when every slot holds another response (more samples of the group
    than N), and :class:`ClientError` as :meth:`GenRMClient.verify` does."""
    for k in range(n):
        placed = msgspec.structs.replace(member, slot=(member.slot + k) % n)
        try:
            return await client.verify(placed), placed
        except RequestRefused as exc:
            if exc.status != 409 or exc.kind != "conflict":
                raise
    raise ValueError(
        f"all {n} slots of group {member.group_id!r} hold other responses: more samples "
        "share this uid than the server's num_rollouts_per_prompt (rollout.n must equal it)")


def _report(outcomes: Iterable[Outcome], where: str) -> None:
    bad = [o for o in outcomes if not isinstance(o, Rewarded)]
    if bad:
        first = bad[0]
        text = (f"masked: {first.reason[:_REASON_CHARS]}" if isinstance(first, Masked) else
                f"{first.kind}: {first.detail[:_REASON_CHARS]}" if isinstance(first, Failed)
                else "")
        logger.warning("%s: %d samples got the masked score %.1f (first %s)", where,
                       len(bad), MASKED_SCORE, text)


# ----------------------------------------------------------------------------- veRL's side


def _decode_response(tokenizer: Any, row: Any) -> str:
    """The row's valid response tokens, decoded without special tokens (as veRL's own
    managers read them)."""
    responses = row["responses"]
    length = int(row["attention_mask"][-responses.shape[-1]:].sum())
    return str(tokenizer.decode(responses[:length], skip_special_tokens=True))


def _prompt_of(tokenizer: Any, row: Any, non_tensor: Mapping[str, Any]) -> Any:
    """The sample's chat prompt: ``raw_prompt`` (a list of messages), else its valid prompt
    tokens decoded."""
    raw = non_tensor.get("raw_prompt")
    if raw is not None and not isinstance(raw, str):
        return [dict(m) for m in list(raw)]
    if isinstance(raw, str):
        return raw
    prompts = row["prompts"]
    mask = row["attention_mask"][: prompts.shape[-1]].bool()
    return str(tokenizer.decode(prompts[mask], skip_special_tokens=True))


class _RewardLoopManager:
    """The logic of :class:`GenRMRewardLoopManager`; the class veRL loads adds
    ``RewardManagerBase`` (for ``assemble_rm_scores``) after it."""

    def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None,
                 reward_router_address: str | None = None,
                 reward_model_tokenizer: Any = None) -> None:
        super().__init__(config, tokenizer, compute_score)  # type: ignore[call-arg]
        self.config = config
        self.tokenizer = tokenizer
        self.options = GenRMOptions.from_kwargs(_get(_get(config, "reward"), "reward_kwargs"),
                                                "reward.reward_kwargs")
        self.n = check_rollout_n(config)
        self._client: tuple[object, GenRMClient] | None = None
        self._rng = random.Random()

    async def client(self) -> GenRMClient:
        """This process's client for the running loop (veRL's worker keeps one loop; another
        loop gets a client of its own). Its first use reads the server's settings and checks
        its N against ``rollout.n``."""
        token = anyio.lowlevel.current_token()  # a new object each call, equal on one loop
        if self._client is None or self._client[0] != token:
            client = self.options.client(max_connections=UNBOUNDED_CONNECTIONS)
            await client.__aenter__()
            self._client = (token, client)
        client = self._client[1]
        settings = await client.settings()
        if settings.num_rollouts is not None and settings.num_rollouts != self.n:
            raise ValueError(
                f"the server's num_rollouts_per_prompt is {settings.num_rollouts}, but "
                f"actor_rollout_ref.rollout.n is {self.n}: they must be equal")
        return client

    async def aclose(self) -> None:
        """Close the client (veRL never calls it: the worker lives as long as training)."""
        held, self._client = self._client, None
        if held is not None:
            await held[1].__aexit__(None, None, None)

    async def run_single(self, data: Any) -> dict[str, Any]:
        """The reward of the last sample of ``data`` (veRL sends one) from its cohort. Waits
        on this loop (never a thread) until the cohort has its outcome; raises
        :class:`ClientError` on a refusal."""
        item = data[len(data) - 1]
        uid = item.non_tensor_batch.get("uid")
        if uid is None:
            raise ValueError("the sample has no non_tensor_batch['uid']: the trainer sets one "
                             "per prompt before repeating it rollout.n times")
        rcp_input = prompt_input(_prompt_of(self.tokenizer, item.batch, item.non_tensor_batch))
        text = _decode_response(self.tokenizer, item.batch)
        client = await self.client()
        member = Member(group_id=group_id_of(uid), slot=self._rng.randrange(self.n),
                        responses_create_params={"input": rcp_input},
                        response=response_object(text, response_id="resp_" + uuid.uuid4().hex))
        outcome, placed = await verify_with_free_slot(client, member, self.n)
        if placed.slot == 0:  # one line per cohort, not per sample
            _report([outcome], f"{type(self).__name__}: cohort {placed.group_id!r}")
        score, info = outcome_entry(outcome, placed)
        return {"reward_score": score, "reward_extra_info": info}


class _LegacyRewardManager:
    """The logic of :class:`GenRMRewardManager`; the class veRL loads adds
    ``AbstractRewardManager`` after it."""

    def __init__(self, tokenizer: Any, num_examine: int = 0, compute_score: Any = None,
                 reward_fn_key: str = "data_source", **reward_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.reward_fn_key = reward_fn_key
        self.options = GenRMOptions.from_kwargs(reward_kwargs, "reward_model.reward_kwargs")

    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        """Rewards of the whole batch, on the rows' last valid response tokens, in the
        batch's order. Blocks the calling thread (veRL's call is synchronous) until every
        group has its outcome; raises :class:`ClientError` on a refusal."""
        import torch

        if "rm_scores" in data.batch.keys():
            return self._extract_reward_from_rm_scores(  # type: ignore[attr-defined]
                data, return_dict)
        size = len(data)
        rows = [data[i] for i in range(size)]
        uids = data.non_tensor_batch.get("uid")
        if uids is None:
            raise ValueError("the batch has no non_tensor_batch['uid']")
        texts = [_decode_response(self.tokenizer, r.batch) for r in rows]
        prompts = [_prompt_of(self.tokenizer, r.batch, r.non_tensor_batch) for r in rows]
        outcomes, members = self._run(list(uids), prompts, texts)
        reward_tensor = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        prompt_length = data.batch["prompts"].shape[-1]
        lengths = data.batch["attention_mask"][:, prompt_length:].sum(dim=-1)
        extra: dict[str, list[Any]] = {key: [] for key in EXTRA_KEYS}
        for i, (outcome, member) in enumerate(zip(outcomes, members, strict=True)):
            score, info = outcome_entry(outcome, member)
            reward_tensor[i, int(lengths[i]) - 1] = score
            for key in EXTRA_KEYS:
                extra[key].append(info[key])
        _report(outcomes, type(self).__name__)
        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": extra}
        return reward_tensor

    def _run(self, uids: list[Any], prompts: list[Any], texts: list[str]) -> tuple[
            list[Outcome], list[Member]]:
        async def score() -> tuple[list[Outcome], list[Member]]:
            # Every group of the batch at once (a smaller genrm_max_connections admits whole
            # groups at a time).
            async with self.options.client(max_connections=max(1, len(uids))) as client:
                settings = await client.settings()
                members = batch_members(uids, prompts, texts, n=settings.num_rollouts)
                return await client.verify_groups(members), members

        try:
            return anyio.run(score, backend="asyncio")
        except RuntimeError as exc:
            if "running event loop" in str(exc) or "already running" in str(exc):
                raise RuntimeError("GenRMRewardManager is synchronous: call it outside an "
                                   "event loop (veRL's trainer does)") from exc
            raise


# ----------------------------------------------------------------------------- lazy classes


def _reward_loop_class() -> type:
    try:
        from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
    except ImportError as exc:
        raise ImportError("GenRMRewardLoopManager needs veRL: pip install "
                          "'genrm-trio[verl]'") from exc
    return type("GenRMRewardLoopManager", (_RewardLoopManager, RewardManagerBase),
                {"__module__": __name__, "__doc__": _RewardLoopManager.__doc__})


def _legacy_class() -> type:
    try:
        from verl.workers.reward_manager.abstract import AbstractRewardManager
    except ImportError as exc:
        raise ImportError("GenRMRewardManager needs veRL: pip install "
                          "'genrm-trio[verl]'") from exc
    return type("GenRMRewardManager", (_LegacyRewardManager, AbstractRewardManager),
                {"__module__": __name__, "__doc__": _LegacyRewardManager.__doc__})


_LAZY: Final = {"GenRMRewardLoopManager": _reward_loop_class,
                "GenRMRewardManager": _legacy_class}


def __getattr__(name: str) -> Any:
    """``GenRMRewardLoopManager`` and ``GenRMRewardManager``, built (importing veRL) at first
    access and kept in the module."""
    build = _LAZY.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = build()
    globals()[name] = cls
    return cls

