"""The OpenAPI 3.1 document served at ``GET /openapi.json``.

Built from the msgspec structs of :mod:`genrm_trio.wire` (``msgspec.json.schema_components``),
so the published schema and the decoder that enforces it cannot drift apart. Pure: no I/O, no
trio; the document is rebuilt per call (it is small and the route is rarely hit).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from genrm_trio import wire
from genrm_trio.server.cohort import BODY_RESERVE_FACTOR, BODY_ROOM_WAIT_S, REFUSABLE_BODY_BYTES

_REF = "#/components/schemas/{name}"

#: Failure kinds of contract 3.4, by status, for the error responses of ``/verify``.
VERIFY_ERRORS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "400": ("bad_request",),
    "408": ("request_timeout",),
    "409": ("conflict", "prompt_mismatch", "stale_attempt", "result_expired", "cohort_closed"),
    "413": ("too_large",),
    "415": ("bad_request",),
    "422": ("bad_coordinates",),
    "425": ("draining",),
    "429": ("overloaded",),
    "503": (
        "cohort_incomplete", "superseded", "shutdown", "evaluation_error", "cancelled",
    ),
})


def _error(description: str, kinds: tuple[str, ...] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"$ref": _REF.format(name="ErrorBody")}
    if kinds:
        schema = {
            "allOf": [
                schema,
                {"type": "object", "properties": {"failure_kind": {"enum": list(kinds)}}},
            ]
        }
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _json_body(name: str) -> dict[str, Any]:
    return {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}},
    }


def _verify_request_schema() -> dict[str, Any]:
    """VerifyFields plus what the decoder checks beyond types, and open to unknown keys."""
    return {
        "allOf": [{"$ref": _REF.format(name="VerifyFields")}],
        "type": "object",
        "additionalProperties": True,
        "properties": {
            "responses_create_params": {
                "type": "object",
                "required": ["input"],
                "properties": {"input": {"anyOf": [{"type": "string"}, {"type": "array"}]}},
            },
            "_ng_group_attempt": {"anyOf": [
                {"type": "integer", "minimum": 0, "maximum": wire.INT64_MAX}, {"type": "null"}]},
            "_ng_rollout_index": {"anyOf": [
                {"type": "integer", "minimum": 0, "maximum": wire.INT64_MAX}, {"type": "null"}]},
        },
    }


def bounds() -> dict[str, Any]:
    """The bounds every request body is held to (also in the README), for ``/openapi.json``'s
    ``x-bounds``: the ones JSON Schema cannot express on one field."""
    return {
        "max_json_depth": wire.MAX_JSON_DEPTH,
        "integer_range": [wire.INT64_MIN, wire.INT64_MAX],
        "max_identity_chars": wire.MAX_IDENTITY_CHARS,
        "rollout_id": f"/ng-rollout/<rollout_id>/...: {wire.ROLLOUT_ID_PATTERN}, at most "
        f"{wire.MAX_ROLLOUT_ID_CHARS} characters: else 404",
        "max_request_bytes": "config max_request_bytes (default 16 MiB): 413",
        "max_json_values": "config max_json_values (default "
        f"{wire.DEFAULT_MAX_JSON_VALUES:,}): JSON values, counted on the bytes before the body "
        f"is decoded, outside strings; an object or array counts {wire.CONTAINER_WEIGHT}, a "
        f"number with an exponent {wire.EXPONENT_WEIGHT}: 413 too_large naming max_json_values",
        "max_compare_responses": "config max_compare_responses (default 128): 400",
        "request_read_timeout_s": "config request_read_timeout_s (default 60): 408",
        "verify_body_budget": f"a /verify body reserves {BODY_RESERVE_FACTOR} times its length "
        "of config max_active_bytes while it is read and processed; one over "
        f"{REFUSABLE_BODY_BYTES} bytes whose reservation would pass it (another such body "
        f"reserved) waits unread up to {BODY_ROOM_WAIT_S:g} s for room (at most "
        "request_read_timeout_s), then gets 429 overloaded with Retry-After before it is "
        "read, the connection closed (chunked: at once); released once the member waits in "
        "its cohort or its answer is handed to the connection",
        "send_timeout_s": "config send_timeout_s (default 60): a client that takes none of its "
        "answer for this long is disconnected",
        "duplicated_keys": "an interpreted top-level /verify key given twice: 400",
        "content_type": "absent or application/json (charset utf-8): else 415",
        "get_reward_samples": f"/get_reward: at most {wire.MAX_GET_REWARD_SAMPLES} samples; "
        "query, prompts and labels of one length: else 400",
        "get_reward_label_chars": f"/get_reward: each label at most {wire.MAX_LABEL_CHARS} "
        "characters as JSON: else 400",
    }


def build_openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the HTTP API, as a JSON-ready dict. Never blocks or raises."""
    _refs, components = msgspec.json.schema_components(
        [wire.VerifyFields, wire.CompareRequest, wire.AggregateMetricsRequest, wire.AggregateRow,
         wire.ErrorBody, wire.GetRewardRequest],
        ref_template=_REF,
    )
    components = dict(components)
    components["VerifyRequest"] = _verify_request_schema()
    components["VerifyAnswer"] = {
        "type": "object",
        "description": "The member's body plus the reward; masked judge failures set "
        "mask_sample true, failure_kind 'judge_failed' and reward 0.0.",
        "required": ["reward", "mask_sample", "failure_kind"],
        "additionalProperties": True,
        "properties": {
            "reward": {"type": "number"},
            "mask_sample": {"type": "boolean"},
            "failure_kind": {"anyOf": [{"const": "judge_failed"}, {"type": "null"}]},
            "failure_reason": {"anyOf": [{"type": "string", "maxLength": 2000},
                                         {"type": "null"}]},
            "_ng_group_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "_ng_group_attempt": {"type": "integer"},
            "_ng_rollout_index": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            wire.DEFAULTED_COMPARISONS_KEY: {
                "anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}],
                "description": "Rewarded answers only: how many of the cohort's comparisons "
                "used the default verdict because no judge answer parsed (null: unknown, a "
                "record reloaded from state_dir).",
            },
            wire.COHORT_EXPECTED_KEY: {
                "type": "integer", "minimum": 1,
                "description": "Rewarded answers only: the cohort's size N "
                "(num_rollouts_per_prompt).",
            },
            wire.COHORT_SCORED_KEY: {
                "type": "integer", "minimum": 1,
                "description": "Rewarded answers only: how many of the cohort's members were "
                "judged; below genrm_cohort_expected only for a partial cohort "
                "(incomplete_cohort_policy: judge_present), whose rewards are relative to the "
                "members present.",
            },
            wire.REUSED_COMPARISONS_KEY: {
                "anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}],
                "description": "Rewarded answers only: how many of the cohort's comparisons "
                "were scored with a verdict kept from an earlier judge call of the same pair "
                "(verdict_reuse; the same sample, not a new one) instead of calling the judge "
                "(null: unknown, a record reloaded from state_dir).",
            },
        },
    }
    components["CompareAnswer"] = {
        "type": "object",
        "required": ["rewards", "comparison_results", "metrics"],
        "properties": {
            "rewards": {"type": "array", "items": {"type": "number"}},
            "comparison_results": {"anyOf": [{"type": "array", "items": {"type": "object"}},
                                             {"type": "null"}]},
            "metrics": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        },
    }
    ok_json: dict[str, Any] = {"description": "OK", "content": {"application/json": {}}}
    paths: dict[str, Any] = {
        "/verify": {
            "post": {
                "summary": "One cohort member; blocks until the cohort's outcome",
                "operationId": "verify",
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {
                        "schema": {"$ref": _REF.format(name="VerifyRequest")}}},
                },
                "responses": {
                    "200": {
                        "description": "Reward, or a masked judge failure",
                        "content": {"application/json": {
                            "schema": {"$ref": _REF.format(name="VerifyAnswer")}}},
                    },
                    **{
                        status: _error(f"failure_kind: {', '.join(kinds)}", kinds)
                        for status, kinds in VERIFY_ERRORS.items()
                    },
                },
            }
        },
        "/compare": {
            "post": {
                "summary": "Stateless batch: judge the given responses now",
                "operationId": "compare",
                "requestBody": _json_body("CompareRequest"),
                "responses": {
                    "200": {
                        "description": "Rewards in input order",
                        "content": {"application/json": {
                            "schema": {"$ref": _REF.format(name="CompareAnswer")}}},
                    },
                    "400": _error("bad_request (also more than max_compare_responses)",
                                  ("bad_request",)),
                    "408": _error("request_timeout", ("request_timeout",)),
                    "413": _error("too_large", ("too_large",)),
                    "415": _error("bad_request: Content-Type is not JSON", ("bad_request",)),
                    "503": _error("judge_failed or evaluation_error",
                                  ("judge_failed", "evaluation_error")),
                },
            }
        },
        "/get_reward": {
            "post": {
                "operationId": "get_reward",
                "summary": "OpenRLHF's remote reward protocol: samples join prompt-keyed "
                           "cohorts by arrival; rewards in sample order",
                "requestBody": _json_body("GetRewardRequest"),
                "responses": {
                    "200": {"description": "{rewards, scores, extra_logs, "
                                           "genrm_failure_reason}, one entry per sample"},
                    "400": _error("bad_request", ("bad_request",)),
                    "408": _error("request_timeout", ("request_timeout",)),
                    "413": _error("too_large", ("too_large",)),
                    "429": _error("overloaded", ("overloaded",)),
                    "503": _error("shutdown", ("shutdown",)),
                },
            }
        },
        "/aggregate_metrics": {
            "post": {
                "operationId": "aggregate_metrics",
                "requestBody": _json_body("AggregateMetricsRequest"),
                "responses": {"200": ok_json, "400": _error("bad_request", ("bad_request",)),
                              "413": _error("too_large", ("too_large",))},
            }
        },
        "/seed_session": {"post": {"operationId": "seed_session", "responses": {
            "200": ok_json, "413": _error("too_large", ("too_large",))}}},
        "/close_session": {"post": {"operationId": "close_session", "responses": {
            "200": ok_json, "413": _error("too_large", ("too_large",))}}},
        "/": {"get": {"operationId": "root", "responses": {"200": ok_json}}},
        "/health": {"get": {"operationId": "health", "responses": {"200": ok_json}}},
        "/healthz": {"get": {"operationId": "healthz", "responses": {"200": ok_json}}},
        "/livez": {"get": {"operationId": "livez", "responses": {"200": ok_json}}},
        "/readyz": {"get": {"operationId": "readyz", "responses": {
            "200": ok_json, "503": _error("shutting down", ("shutdown",))}}},
        "/status": {"get": {"operationId": "status", "responses": {"200": ok_json}}},
        "/reverify_mode": {"get": {"operationId": "reverify_mode", "responses": {"200": ok_json}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    paths.update(_rollout_prefixed(paths))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "genrm-trio",
            "version": _version(),
            "description": "GenRM cohort judging, wire-compatible with NeMo Gym genrm_compare. "
            "Every body is bounded: see x-bounds (nesting depth, integers within int64, "
            "identity string lengths, sizes and counts); a violation is a 4xx naming the field.",
        },
        "x-bounds": bounds(),
        "paths": paths,
        "components": {"schemas": components},
    }


def _rollout_prefixed(paths: dict[str, Any]) -> dict[str, Any]:
    """Every path again under NeMo Gym's rollout prefix, ``/ng-rollout/{rollout_id}/...``
    (same operations, same bodies and bounds; a malformed id is a 404)."""
    parameter = {
        "name": "rollout_id", "in": "path", "required": True,
        "description": "NeMo Gym's rollout id (sent with observability_enabled); kept with "
        "the member. An id breaking the pattern or the length is answered 404.",
        "schema": {"type": "string", "pattern": wire.ROLLOUT_ID_PATTERN,
                   "maxLength": wire.MAX_ROLLOUT_ID_CHARS},
    }
    prefixed: dict[str, Any] = {}
    for path, item in paths.items():
        prefixed[f"/ng-rollout/{{rollout_id}}{path}"] = {
            method: {**operation, "operationId": f"{operation['operationId']}_ng_rollout",
                     "parameters": [parameter]}
            for method, operation in item.items()
        }
    return prefixed


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("genrm-trio")
    except PackageNotFoundError:
        return "0.0.0"
