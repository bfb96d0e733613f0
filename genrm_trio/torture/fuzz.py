"""HTTP fuzzing: malformed ``/verify`` and ``/compare`` bodies built from the server's OpenAPI
schemas; a quiet server's ``/status`` must not change."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgspec

from genrm_trio.torture.contract import VERIFY_FAILURE_STATUS, response_object, verify_body

_WRONG_VALUES: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "string": ("text", ""),
    "integer": (7, -3),
    "number": (2.5, -0.125),
    "boolean": (True, False),
    "array": ([], [1, "x"]),
    "object": ({}, {"k": [None]}),
    "null": (None,),
})


@dataclass(slots=True)
class FuzzSummary:
    bodies: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


def _allowed(prop: dict[str, Any]) -> set[str]:
    kinds = {o["type"] for o in prop.get("anyOf", [prop]) if "type" in o}
    if "number" in kinds:
        kinds.add("integer")
    return kinds


def fuzz_case(rng: random.Random, schemas: dict[str, Any], n: int
              ) -> tuple[str, bytes, tuple[int, ...], str | None]:
    """One malformed request: ``(path, raw body, allowed statuses, text the detail must
    contain)``. Field names and types come from the OpenAPI ``schemas``. Pure."""
    roll = rng.random()
    if roll < 0.15:
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        if raw.strip().startswith(b"{"):
            raw = b"[" + raw
        return "/verify", raw, (400,), None
    if roll < 0.25:
        value = rng.choice([[], "x", 3, None, True, [{"a": 1}]])
        return rng.choice(["/verify", "/compare"]), msgspec.json.encode(value), (400,), "$"
    if roll < 0.75:
        fields = schemas["VerifyFields"]
        body = verify_body(0, 0, 0, 0, 0, ["fuzz-never-opened"])
        name = rng.choice(sorted(fields["properties"]))
        if rng.random() < 0.2 and name in fields["required"]:
            del body[name]
            return "/verify", msgspec.json.encode(body), (400,), name
        allowed = _allowed(fields["properties"][name])
        wrong = [v for kind, values in _WRONG_VALUES.items() if kind not in allowed
                 for v in values]
        body[name] = rng.choice(wrong)
        return "/verify", msgspec.json.encode(body), (400,), f"$.{name}"
    if roll < 0.87:
        body = verify_body(0, 0, 0, 0, 0, ["fuzz-never-opened"])
        if rng.random() < 0.5:
            body["_ng_rollout_index"] = rng.choice([-1, n, n + 5, -(2**40)])
            return "/verify", msgspec.json.encode(body), (422,), "_ng_rollout_index"
        body["_ng_group_attempt"] = rng.choice([-1, -(2**40)])
        return "/verify", msgspec.json.encode(body), (422,), "_ng_group_attempt"
    fields = schemas["CompareRequest"]
    body = {"conversation_history": [{"role": "user", "content": "hi"}],
            "response_objs": [response_object("a"), response_object("b")]}
    name = rng.choice(sorted(fields["properties"]))
    allowed = _allowed(fields["properties"][name])
    wrong = [v for kind, values in _WRONG_VALUES.items() if kind not in allowed for v in values]
    body[name] = rng.choice(wrong)
    return "/compare", msgspec.json.encode(body), (400,), f"$.{name}"


def bearer_headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


async def run_http_fuzz(url: str, *, bodies: int = 200, seed: int = 0,
                        token: str | None = None) -> FuzzSummary:
    """Send ``bodies`` malformed ``/verify`` and ``/compare`` requests, one at a time.

    Checks: never a 5xx; the expected 400/422 with a JSON ``detail`` that names the field and a
    contract ``failure_kind``; and, when the server has ``GET /status``, its cohort counts are
    identical before and after (run it against a quiet server). Field names and types come from
    the server's ``GET /openapi.json``, or genrm-trio's own document when it has none. Blocks
    until done; raises ``httpx2.HTTPError`` when the server cannot be reached.
    """
    import httpx2

    from genrm_trio.server.openapi import build_openapi

    rng = random.Random(seed)
    summary = FuzzSummary()
    async with httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(30.0),
                                  trust_env=False, headers=bearer_headers(token)) as client:
        schemas = build_openapi()["components"]["schemas"]
        served = await client.get("/openapi.json")
        if served.status_code == 200:
            try:
                schemas = served.json()["components"]["schemas"]
            except (ValueError, KeyError, TypeError):
                pass

        async def cohorts() -> Any:
            answer = await client.get("/status")
            return answer.json().get("cohorts") if answer.status_code == 200 else None

        n = 2
        status = await client.get("/status")
        if status.status_code == 200:
            n = int(status.json().get("config", {}).get("num_rollouts_per_prompt", 2) or 2)
        before = await cohorts()
        for i in range(bodies):
            path, raw, statuses, names = fuzz_case(rng, schemas, n)
            answer = await client.post(path, content=raw,
                                       headers={"content-type": "application/json"})
            summary.bodies += 1
            summary.statuses[answer.status_code] += 1
            where = f"fuzz {i} POST {path} {raw[:120]!r}"
            if answer.status_code >= 500:
                summary.violations.append(f"{where}: HTTP {answer.status_code}")
                continue
            try:
                body = answer.json()
            except ValueError:
                summary.violations.append(f"{where}: HTTP {answer.status_code}, not JSON")
                continue
            if answer.status_code not in statuses or not isinstance(body, dict):
                summary.violations.append(f"{where}: HTTP {answer.status_code} (expected "
                                          f"{statuses}): {str(body)[:200]}")
                continue
            detail = body.get("detail")
            kind = body.get("failure_kind")
            expected = VERIFY_FAILURE_STATUS.get(kind) if isinstance(kind, str) else None
            if not isinstance(detail, str) or expected != answer.status_code:
                summary.violations.append(f"{where}: error body {str(body)[:200]}")
            elif names is not None and names not in detail:
                summary.violations.append(f"{where}: detail does not name {names!r}: "
                                          f"{detail[:200]}")
        after = await cohorts()
        if before != after:
            summary.violations.append(f"registry changed under malformed requests: "
                                      f"{before} -> {after}")
    return summary
