"""Identity: canonical JSON, prompt and response digests, and cohort keys.

Pure core: no I/O, no trio, no module-level mutable state. Nothing here blocks.

A cohort is keyed either by the caller's explicit group id (``_ng_group_id``) and attempt, or,
for legacy callers, by the task index or prompt id (when sent) together with the prompt digest
and the attempt (CONTRACT.md section 1).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

__all__ = [
    "CohortKey",
    "canonical_json",
    "prompt_digest",
    "response_digest",
    "explicit_key",
    "legacy_key",
    "describe",
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
