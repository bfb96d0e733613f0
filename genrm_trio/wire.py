"""Wire formats: msgspec structs and the shared encoders/decoders for every HTTP payload.

Pure core: no I/O, no trio. Inbound ``/verify`` bodies are kept as the dict that was received
(unknown keys must be echoed back unchanged); only the keys the server interprets are validated,
through :class:`VerifyFields`, so msgspec's error names the JSON path (``$.response``).
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import msgspec

from genrm_trio.errors import BadCoordinates, BadRequest

JSON_ENCODER = msgspec.json.Encoder()
JSON_DECODER = msgspec.json.Decoder()

#: Old NeMo Gym spellings accepted on input; answers use only the ``_ng_`` names.
IDENTITY_ALIASES = MappingProxyType(
    {"group_id": "_ng_group_id", "group_attempt": "_ng_group_attempt"}
)

LEGACY_GUIDANCE = (
    " To recover, resend the whole group with a fresh _ng_group_id shared by every member"
    " (legacy groups keyed by task index or prompt keep their recorded failure)."
)

MAX_FAILURE_TEXT = 2000


class VerifyFields(msgspec.Struct, kw_only=True):
    """The keys of a ``/verify`` body that the server interprets; the rest is carried through."""

    responses_create_params: dict[str, Any]
    response: dict[str, Any]
    group_id: str | None = msgspec.field(default=None, name="_ng_group_id")
    group_attempt: int | None = msgspec.field(default=None, name="_ng_group_attempt")
    rollout_index: int | None = msgspec.field(default=None, name="_ng_rollout_index")
    task_index: int | None = msgspec.field(default=None, name="_ng_task_index")
    prompt_id: str | None = None
    principle: str | None = None
    instance_config: dict[str, Any] | None = None


class VerifyMember(msgspec.Struct, frozen=True, kw_only=True):
    """A validated ``/verify`` request: the body as received plus its interpreted fields."""

    body: dict[str, Any]
    fields: VerifyFields
    attempt: int
    attempt_given: bool
    size_bytes: int


class CompareRequest(msgspec.Struct, kw_only=True):
    conversation_history: list[dict[str, Any]]
    response_objs: list[dict[str, Any]]
    principle: str | None = None


class AggregateMetricsRequest(msgspec.Struct, kw_only=True):
    verify_responses: list[dict[str, Any]]


class ErrorBody(msgspec.Struct, kw_only=True, omit_defaults=False):
    detail: str
    failure_kind: str | None


def _validation_detail(exc: msgspec.ValidationError) -> str:
    return f"invalid request body: {exc}"


def decode_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON body that must be an object; raises :class:`BadRequest` naming the problem."""
    try:
        obj = JSON_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(obj).__name__} at `$`")
    return obj


def decode_verify(raw: bytes, num_rollouts: int) -> VerifyMember:
    """Validate a ``/verify`` body.

    Raises :class:`BadRequest` (400) for malformed JSON or wrong types, naming the JSON path, and
    :class:`BadCoordinates` (422) for a missing or out-of-range rollout index or a negative
    attempt. Nothing is mutated; the returned ``body`` is the decoded dict as received.
    """
    body = decode_object(raw)
    view = body
    for alias, canonical in IDENTITY_ALIASES.items():
        if alias in body and canonical not in body:
            if view is body:
                view = dict(body)
            view[canonical] = view.pop(alias)
    try:
        fields = msgspec.convert(view, VerifyFields)
    except msgspec.ValidationError as exc:
        raise BadRequest(_validation_detail(exc)) from exc
    prompt_input = fields.responses_create_params.get("input")
    if not isinstance(prompt_input, (str, list)):
        raise BadRequest(
            "invalid request body: Expected `str | array`, got "
            f"`{_json_type(prompt_input)}` - at `$.responses_create_params.input`"
        )
    attempt = fields.group_attempt
    if attempt is not None and attempt < 0:
        raise BadCoordinates(f"_ng_group_attempt must be >= 0, got {attempt}")
    if num_rollouts > 1:
        index = fields.rollout_index
        if index is None:
            raise BadCoordinates(
                f"_ng_rollout_index is required when num_rollouts_per_prompt = {num_rollouts}"
            )
        if not 0 <= index < num_rollouts:
            raise BadCoordinates(
                f"_ng_rollout_index must be in [0, {num_rollouts}), got {index}"
            )
    return VerifyMember(
        body=body,
        fields=fields,
        attempt=attempt or 0,
        attempt_given=attempt is not None,
        size_bytes=len(raw),
    )


def decode_compare(raw: bytes) -> CompareRequest:
    """Validate a ``/compare`` body; raises :class:`BadRequest` naming the JSON path."""
    obj = decode_object(raw)
    try:
        return msgspec.convert(obj, CompareRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(_validation_detail(exc)) from exc


def decode_aggregate(raw: bytes) -> AggregateMetricsRequest:
    obj = decode_object(raw)
    try:
        return msgspec.convert(obj, AggregateMetricsRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(_validation_detail(exc)) from exc


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def bound_text(text: str, limit: int = MAX_FAILURE_TEXT) -> str:
    """Cut ``text`` to at most ``limit`` characters, marking the cut."""
    if len(text) <= limit:
        return text
    marker = " ...[cut]"
    return text[: limit - len(marker)] + marker


def identity_fields(member: VerifyMember) -> dict[str, Any]:
    f = member.fields
    return {
        "_ng_group_id": f.group_id,
        "_ng_group_attempt": member.attempt,
        "_ng_rollout_index": f.rollout_index,
    }


def success_body(member: VerifyMember, reward: float) -> dict[str, Any]:
    """The 200 answer for a rewarded member: its body (identity keys only under ``_ng_`` names)
    plus the reward and the unmasked markers."""
    if not math.isfinite(reward):  # guarded by the registry; never publish a non-finite reward
        raise ValueError("non-finite reward")
    out = {k: v for k, v in member.body.items() if k not in IDENTITY_ALIASES}
    out.update(identity_fields(member))
    out["reward"] = reward
    out["mask_sample"] = False
    out["failure_kind"] = None
    out["failure_reason"] = None
    return out


def masked_body(member: VerifyMember, reason: str) -> dict[str, Any]:
    """The masked judge-failure 200 (contract 3.3): the body as received plus the mask keys.
    The received dict is not mutated; ``instance_config`` is copied."""
    text = bound_text(reason)
    out = dict(member.body)
    instance_config = member.body.get("instance_config")
    merged = dict(instance_config) if isinstance(instance_config, dict) else {}
    merged["mask_sample"] = True
    out["reward"] = 0.0
    out["mask_sample"] = True
    out["failure_kind"] = "judge_failed"
    out["failure_reason"] = text
    out["instance_config"] = merged
    out["_ng_failure_class"] = "judge_failed"
    out["_ng_failure_judge_error"] = text
    return out


def error_body(detail: str, failure_kind: str | None) -> dict[str, Any]:
    return {"detail": detail, "failure_kind": failure_kind}
