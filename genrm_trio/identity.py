"""Identity: canonical JSON, prompt and response digests, and cohort keys.

Pure core: no I/O, no trio, no module-level mutable state. Nothing here blocks.

A cohort is keyed either by the caller's explicit group id (``_ng_group_id``) and attempt, or,
for legacy callers, by the task index or prompt id (when sent) together with the prompt digest
and the attempt (CONTRACT.md section 1).

A judged comparison is keyed by :func:`verdict_key`: everything that decides what the judge is
asked (:func:`judge_fingerprint` of the configuration, the judge pass, the principle, the
conversation, both answers in order) and the scope the verdict may be reused in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import msgspec

from genrm_trio.config import Config
from genrm_trio.judge_prompt import PlainPrompt

__all__ = [
    "CohortKey",
    "canonical_json",
    "prompt_digest",
    "response_digest",
    "explicit_key",
    "legacy_key",
    "scoped_key",
    "describe",
    "judge_fingerprint",
    "verdict_scope",
    "verdict_prefix",
    "verdict_key",
]

# Longest piece of caller-supplied text :func:`describe` repeats verbatim.
_DESCRIBE_TEXT_CHARS = 64
# How much of a digest :func:`describe` shows.
_DESCRIBE_DIGEST_CHARS = 12


def _builtins(obj: Any) -> Any:
    # Structs (and other msgspec-known types) hash like the JSON they encode to.
    return msgspec.to_builtins(obj)


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes of ``obj``: sorted keys, compact separators, ASCII escapes.

    ASCII escaping makes strings holding lone surrogates (which JSON text may carry as ``\\ud800``
    escapes) encodable. msgspec Structs are encoded as their JSON objects. Never blocks. Raises
    ``TypeError`` / ``ValueError`` for values JSON cannot express (non-string keys mixed with
    others, unknown objects, circular references).
    """
    text = json.dumps(
        obj, ensure_ascii=True, sort_keys=True, separators=(",", ":"), default=_builtins
    )
    return text.encode("ascii")


def prompt_digest(prompt_input: Any, principle: str | None) -> str:
    """sha256 hex of ``canonical_json({"input": prompt_input, "principle": principle})``.

    ``prompt_input`` is ``responses_create_params.input`` exactly as received. Never blocks;
    raises as :func:`canonical_json`.
    """
    return hashlib.sha256(
        canonical_json({"input": prompt_input, "principle": principle})
    ).hexdigest()


def response_digest(response: Any) -> str:
    """sha256 hex of ``canonical_json(response)``: the whole Responses object. Never blocks;
    raises as :func:`canonical_json`."""
    return hashlib.sha256(canonical_json(response)).hexdigest()


class CohortKey(msgspec.Struct, frozen=True):
    """What identifies a cohort; hashable and comparable, so it can key a dict.

    Exactly one of ``group_id`` (explicit-id groups) and ``legacy_key`` (legacy groups) is set.
    ``legacy_key`` is ``"task:<index>:<prompt digest>"``, ``"prompt:<prompt id>:<prompt digest>"``
    or ``"anon:<prompt digest>"``.
    """

    group_id: str | None
    legacy_key: str | None
    attempt: int


def explicit_key(group_id: str, attempt: int) -> CohortKey:
    """The key of an explicit-id group (the caller sent ``_ng_group_id``). Never blocks."""
    return CohortKey(group_id=group_id, legacy_key=None, attempt=attempt)


def legacy_key(
    task_index: int | None, prompt_id: str | None, prompt_digest: str, attempt: int
) -> CohortKey:
    """The key of a legacy group: the task index when sent, else the prompt id when sent, then
    the prompt digest (so identical prompts from different tasks stay apart, and different
    prompts or principles under one task or prompt id never merge). Never blocks.
    """
    if task_index is not None:
        scope = f"task:{task_index}"
    elif prompt_id is not None:
        scope = f"prompt:{prompt_id}"
    else:
        scope = "anon"
    return CohortKey(group_id=None, legacy_key=f"{scope}:{prompt_digest}", attempt=attempt)


def scoped_key(scope: str, prompt_digest: str, attempt: int) -> CohortKey:
    """The key of a prompt-keyed cohort whose scope a route builds instead of the body's task
    index or prompt id (``POST /get_reward``: ``"openrlhf-label:<label digest>"``, so equal
    prompt texts with different labels stay apart). Shaped like a legacy key, so it never
    meets an explicit group's. Never blocks."""
    return CohortKey(group_id=None, legacy_key=f"{scope}:{prompt_digest}", attempt=attempt)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def describe(key: CohortKey) -> str:
    """Short, bounded text naming a cohort, for logs and failure details.

    Caller-supplied ids are shown with ``repr`` (so control characters cannot forge log lines)
    and clipped to 64 characters; the prompt digest is shortened to 12. At most about 110
    characters. Never blocks.
    """
    if key.group_id is not None:
        return f"group {_clip(repr(key.group_id), _DESCRIBE_TEXT_CHARS)} attempt {key.attempt}"
    legacy = key.legacy_key or ""
    scope, _, digest = legacy.rpartition(":")
    return (
        f"legacy {_clip(repr(scope), _DESCRIBE_TEXT_CHARS)} "
        f"prompt {digest[:_DESCRIBE_DIGEST_CHARS]} attempt {key.attempt}"
    )


# --------------------------------------------------------------------------- verdict keys

#: Bumped whenever the bytes :func:`verdict_key` hashes change meaning, so journaled verdicts
#: of an older layout can never match.
VERDICT_KEY_VERSION = "genrm-trio/verdict/1"


def judge_fingerprint(cfg: Config, template: PlainPrompt | None) -> bytes:
    """Canonical bytes of everything in ``cfg`` that decides what one comparison asks the judge
    and how its answer becomes a verdict: the backend (HTTP, a named plugin, the built-in
    judge), the model (with no ``judge.model``, the judge's base URLs stand for the model they
    serve), the API, the prompt form and its template (``template``: the ``plain`` template in
    use, None for ``genrm_roles``), the structured-output mode, the generation parameters, the
    seed policy, the default principle, and the defaults a verdict's missing fields take.
    Endpoint routing is not in it: any endpoint of ``judge.base_urls`` serves the same model.
    Never blocks."""
    judge = cfg.judge
    if judge.plugin:
        backend: list[Any] = ["plugin", judge.plugin, judge.plugin_flavor]
    elif judge.base_urls:
        backend = ["http", judge.model if judge.model else sorted(judge.base_urls)]
    else:
        backend = ["builtin"]
    prompt: list[Any] = [judge.prompt]
    if judge.prompt == "plain" and template is not None:
        prompt += [None if template.system is None else template.system.template,
                   template.user.template]
    return canonical_json({
        "backend": backend,
        "api": judge.api,
        "prompt": prompt,
        "structured_output": judge.structured_output,
        "params": cfg.genrm_responses_create_params,
        "seed": judge.seed,
        "default_principle": cfg.default_principle,
        "defaults": [cfg.default_score, cfg.default_ranking],
    })


def verdict_scope(mode: str, key: CohortKey) -> list[str] | None:
    """Where a verdict judged for cohort ``key`` may be reused under ``verdict_reuse: mode``:
    ``global``: anywhere (None); ``group``: the same explicit group id, or the same legacy key,
    whatever the attempt. Never blocks."""
    if mode == "global":
        return None
    if key.group_id is not None:
        return ["group", key.group_id]
    return ["legacy", key.legacy_key or ""]


def _part(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def verdict_prefix(
    scope: Sequence[str] | None, fingerprint: bytes, principle: str | None, history: Any,
) -> bytes:
    """The parts of a verdict key that one cohort's comparisons share (built once per cohort,
    see :func:`verdict_key`): the key version, ``scope`` (:func:`verdict_scope`), the judge
    ``fingerprint``, the principle sent (None when none is) and the conversation ``history``.
    Never blocks; raises as :func:`canonical_json`."""
    return b"".join((
        _part(canonical_json(VERDICT_KEY_VERSION)), _part(canonical_json(scope)),
        _part(fingerprint), _part(canonical_json(principle)), _part(canonical_json(history)),
    ))


def verdict_key(prefix: bytes, judge_idx: int, response_1: str, response_2: str) -> bytes:
    """The 32-byte sha256 key of one comparison's verdict: ``prefix`` (:func:`verdict_prefix`),
    then the judge pass ``judge_idx``, ``response_1`` and ``response_2`` in that order
    (position matters: the swapped pair is another key). Every part is canonical JSON (ASCII
    escapes, so lone surrogates hash too) after its 8-byte length, so no two different lists of
    parts give the same bytes. Never Python's ``hash()``: the key must be the same in the next
    process. Never blocks."""
    return hashlib.sha256(b"".join((
        prefix, _part(canonical_json(judge_idx)), _part(canonical_json(response_1)),
        _part(canonical_json(response_2)),
    ))).digest()
