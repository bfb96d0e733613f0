"""slime: :func:`group_rm`, a group reward for ``--group-rm --custom-rm-path``.

Read from THUDM/slime's source (it is not on PyPI: the ``slime`` there is another project):
with ``--group-rm``, ``generate_and_rm_group`` (``slime/rollout/sglang_rollout.py``) generates a
group's ``args.n_samples_per_prompt`` samples concurrently, then, once every one is done (and
the rollout was not aborted), awaits ``batched_async_rm(args, group)``
(``slime/rollout/rm_hub/__init__.py``), which with ``--custom-rm-path module.fn`` loads ``fn``
and returns ``await fn(args, samples)``; the rewards are zipped back onto the samples in order.
It runs on slime's rollout event loop (asyncio, in a thread of its own), one call per group,
many groups at once. Evaluation refuses ``--group-rm`` (``eval_rollout`` asserts it off), so
only training samples come here.

**One call, one request.** slime hands over the whole group at once, so by default
(``genrm_route: compare``) it goes to ``POST /compare`` in one request: the prompt
(``sample.prompt``, a string or chat messages) as ``conversation_history``, the answers
(``sample.response``) as ``response_objs`` in the group's order, judged at once with the same
pairs and judge calls as a cohort. Measured (``bench/slime_cohort_vs_compare.py``: 64 groups
of 8 at once through this function, mock judge at 20 ms a call, a shared 2-core machine, two
runs) it costs the server 0.6 times the CPU of a cohort (0.72 s against 1.32 s, 0.86 s against
1.44 s) and the caller a quarter or less (0.18 s against 0.92 s, 0.25 s against 0.98 s): one
request per group instead of N, so one body to decode and one answer to send, one connection,
and no cohort state, waiters, deadlines or record. What it gives up: a re-sent request is
judged again (no record to replay), and there is no cohort disposition log line, journal,
verdict reuse or cohort metrics. ``genrm_route: cohort`` sends the group as one cohort of
explicit members instead: group id ``slime:<fresh uuid>:g<group_index>`` (a partial rollout's
resubmitted group is a new cohort), slot = position, attempt 0, every member at once
(:meth:`~genrm_trio.integrations.client.GenRMClient.verify_groups`: one connection and one task
each on slime's loop, no thread), so the cohort is full on arrival. Either way N (the list's
length) must equal ``args.n_samples_per_prompt`` (and, for cohorts, the server's
``num_rollouts_per_prompt``).

**Outcomes.** A reward is returned as a float. A masked group (the judge failed for good) and
a failed one (``superseded``, ``shutdown``, ``evaluation_error``...) return
:data:`MASKED_SCORE` (0.0) for every sample and set ``sample.remove_sample = True``, which
slime turns into an all-zero loss mask (the samples still count in their group's reward
normalisation, where one value for the whole group gives zero advantage), with
``sample.metadata["genrm_masked"] = True`` and ``"genrm_failure"`` the reason. A refusal (a
4xx) raises :class:`~genrm_trio.integrations.client.ClientError`, which fails the rollout. Do
not set ``--reward-key``: the rewards are plain floats.

**Settings**, from slime's args (a ``--custom-config-path`` YAML file sets them) or the
environment: ``genrm_url`` (or ``GENRM_URL``, required), ``genrm_route`` (``compare``, the
default, or ``cohort``), ``genrm_token_env``, ``genrm_wait_s``, ``genrm_slack_s`` (see
:class:`~genrm_trio.integrations.client.GenRMClient`). Each call opens its own client on the
loop it runs on and closes it. Nothing of slime is imported.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Final

from genrm_trio.integrations.client import Masked, Member, Outcome, Rewarded
from genrm_trio.integrations.trl import prompt_input
from genrm_trio.integrations.verl import GenRMOptions, response_object

__all__ = ["MASKED_SCORE", "ROUTES", "compare_request", "group_members", "group_rm",
           "slime_options", "slime_route"]

#: The reward of every sample of a masked or failed cohort (module docstring).
MASKED_SCORE: Final = 0.0
_REASON_CHARS: Final = 200
#: Where a group goes: one /compare request (the default) or one /verify cohort.
ROUTES: Final = ("compare", "cohort")


def slime_options(args: Any, env: Mapping[str, str] | None = None) -> GenRMOptions:
    """The ``genrm_*`` settings from slime's ``args`` (``genrm_url`` falling back to the
    ``GENRM_URL`` environment variable). Raises ``ValueError`` naming the setting."""
    kwargs = {key: getattr(args, key) for key in (
        "genrm_url", "genrm_token_env", "genrm_wait_s", "genrm_slack_s")
        if getattr(args, key, None) is not None}
    if "genrm_url" not in kwargs:
        url = (os.environ if env is None else env).get("GENRM_URL")
        if url:
            kwargs["genrm_url"] = url
    return GenRMOptions.from_kwargs(kwargs, "slime args (or GENRM_URL)")


def slime_route(args: Any) -> str:
    """``args.genrm_route``: ``compare`` (the default) or ``cohort``; anything else raises
    ``ValueError`` naming it."""
    route = getattr(args, "genrm_route", None) or "compare"
    if route not in ROUTES:
        raise ValueError(f"genrm_route must be one of {', '.join(ROUTES)}, got {route!r}")
    return str(route)


def compare_request(samples: Sequence[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``/compare``'s ``conversation_history`` (the group's prompt: a string is one user
    message, chat messages as they are) and ``response_objs`` (the answers, in order)."""
    prompt = samples[0].prompt if samples else ""
    if isinstance(prompt, str):
        history = [{"role": "user", "content": prompt}]
    else:
        history = [{"role": str(m.get("role", "user")), "content": m.get("content", "")}
                   for m in prompt]
    return history, [response_object(str(s.response or ""), model="slime") for s in samples]


def group_members(samples: Sequence[Any], *, n: int) -> list[Member]:
    """The members of one slime group: slot = position, one fresh group id. Pure but for the
    id. Raises ``TypeError`` for a fan-out group (lists of samples) and ``ValueError`` when
    the group is not ``n`` samples of one prompt."""
    if any(isinstance(s, list | tuple) for s in samples):
        raise TypeError("group_rm scores one sample per rollout; a custom generate function "
                        "that fans a rollout out into several samples is not supported")
    if len(samples) != n:
        raise ValueError(f"the group has {len(samples)} samples, but n_samples_per_prompt is "
                         f"{n}")
    index = getattr(samples[0], "group_index", None) if samples else None
    group = f"slime:{uuid.uuid4().hex}:g{index if isinstance(index, int) else 'x'}"
    inputs = [prompt_input(s.prompt) for s in samples]
    if any(i != inputs[0] for i in inputs[1:]):
        raise ValueError(f"the samples of group {index!r} hold different prompts")
    return [Member(group_id=group, slot=slot, responses_create_params={"input": inputs[slot]},
                   response=response_object(str(s.response or ""), model="slime"))
            for slot, s in enumerate(samples)]


async def group_rm(args: Any, samples: list[Any], **kwargs: Any) -> list[float]:
    """slime's ``--custom-rm-path`` group reward: one float per sample, in order (module
    docstring). Waits on the caller's loop until the group is judged; raises
    :class:`~genrm_trio.integrations.client.ClientError` on a refusal."""
    n = getattr(args, "n_samples_per_prompt", None)
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"args.n_samples_per_prompt must be >= 2 for cohorts, got {n!r}")
    route = slime_route(args)
    members = group_members(samples, n=n)  # checks the group either way
    options = slime_options(args)
    async with options.client(max_connections=n) as client:
        if route == "compare":
            history, responses = compare_request(samples)
            outcomes = await client.compare(history, responses)
        else:
            settings = await client.settings()
            if settings.num_rollouts is not None and settings.num_rollouts != n:
                raise ValueError(
                    f"the server's num_rollouts_per_prompt is {settings.num_rollouts}, but "
                    f"n_samples_per_prompt is {n}: they must be equal")
            outcomes = await client.verify_groups(members)
    return [_apply(outcome, sample) for outcome, sample in zip(outcomes, samples, strict=True)]


def _apply(outcome: Outcome, sample: Any) -> float:
    if isinstance(outcome, Rewarded):
        return outcome.reward
    reason = outcome.reason if isinstance(outcome, Masked) else f"{outcome.kind}: {outcome.detail}"
    sample.remove_sample = True
    metadata = getattr(sample, "metadata", None)
    if isinstance(metadata, dict):
        metadata["genrm_masked"] = True
        metadata["genrm_failure"] = reason[:_REASON_CHARS]
    return MASKED_SCORE
