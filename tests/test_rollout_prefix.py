"""NeMo Gym's rollout prefix: with ``observability_enabled`` its client sends every call as
``/ng-rollout/<rollout_id>/<path>``. Every route answers there exactly as on the plain path
(auth included), a malformed id is a 404 like NeMo Gym's, and a member's rollout id reaches its
cohort's disposition line."""

from __future__ import annotations

import json
import logging

import httpx2
import pytest
import trio

from genrm_trio import wire
from genrm_trio.config import Config
from genrm_trio.server.openapi import build_openapi
from tests.lifecycle_helpers import body
from tests.server_helpers import raw_http, running_server
from tests.test_server import post_all


@pytest.mark.parametrize(("path", "expected"), [
    ("/verify", ("/verify", None)),
    ("/ng-rollout/3-1/verify", ("/verify", "3-1")),
    ("/ng-rollout/3-1-a2/seed_session", ("/seed_session", "3-1-a2")),
    ("/ng-rollout/A.b_c-9/", ("/", "A.b_c-9")),
    ("/ng-rollout/x/verify/extra", ("/verify/extra", "x")),
    # Taken off once only: the rest is routed as it is (and 404s).
    ("/ng-rollout/a/ng-rollout/b/verify", ("/ng-rollout/b/verify", "a")),
    ("/ng-rollout/" + "r" * wire.MAX_ROLLOUT_ID_CHARS + "/verify",
     ("/verify", "r" * wire.MAX_ROLLOUT_ID_CHARS)),
    ("/ng-rollout", ("/ng-rollout", None)),  # not the prefix: an unknown path, routed as is
])
def test_prefix_is_stripped_once(path: str, expected: tuple[str, str | None]) -> None:
    assert wire.strip_rollout_prefix(path) == expected


@pytest.mark.parametrize("path", [
    "/ng-rollout/",
    "/ng-rollout/3-1",                # no path after the id
    "/ng-rollout//verify",            # empty id
    "/ng-rollout/.hidden/verify",     # leading dot
    "/ng-rollout/-x/verify",
    "/ng-rollout/a b/verify",
    "/ng-rollout/a%2Fb/verify",
    "/ng-rollout/r\u00e9/verify",
    "/ng-rollout/" + "r" * (wire.MAX_ROLLOUT_ID_CHARS + 1) + "/verify",
])
def test_malformed_rollout_ids_are_refused(path: str) -> None:
    assert wire.strip_rollout_prefix(path) is None


async def test_every_route_answers_under_the_prefix(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "genrm_trio.server.cohort")
    cfg = Config(num_rollouts_per_prompt=3, port=0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        # A cohort whose members come in by both spellings is one cohort.
        bodies = [body(s, group="prefixed", attempt=0) for s in range(3)]
        results: list[httpx2.Response] = []

        async def one(slot: int) -> None:
            path = "/verify" if slot == 2 else f"/ng-rollout/7-{slot}/verify"
            results.append(await client.post(path, json=bodies[slot]))

        async with trio.open_nursery() as nursery:
            for slot in range(3):
                nursery.start_soon(one, slot)
        assert sorted(r.status_code for r in results) == [200, 200, 200]
        rewards = {r.json()["_ng_rollout_index"]: r.json()["reward"] for r in results}
        assert set(rewards) == {0, 1, 2}
        # The same member again replays its reward under either spelling.
        again = await client.post("/ng-rollout/7-0-a1/verify", json=bodies[0])
        assert again.status_code == 200 and again.json()["reward"] == rewards[0]

        for path in ("/", "/health", "/healthz", "/livez"):
            for prefixed in (path, f"/ng-rollout/9-9{path}"):
                answer = await client.get(prefixed)
                assert (answer.status_code, answer.json()) == (200, {"status": "ok"}), prefixed
        assert (await client.get("/ng-rollout/9-9/readyz")).json() == {"status": "ready"}
        assert (await client.get("/ng-rollout/9-9/reverify_mode")).json() == "unsupported"
        for hook in ("seed_session", "close_session"):
            answer = await client.post(f"/ng-rollout/9-9/{hook}",
                                       json={"resources_session_id": "s-1"})
            assert answer.json() == {"resources_session_id": "s-1"}
        metrics = await client.post("/ng-rollout/9-9/aggregate_metrics", json={
            "verify_responses": [{"_ng_task_index": 0, "reward": 1.0}]})
        assert metrics.status_code == 200 and "agent_metrics" in metrics.json()
        compared = await client.post("/ng-rollout/9-9/compare", json={
            "conversation_history": [{"role": "user", "content": "q"}],
            "response_objs": [bodies[0]["response"], bodies[1]["response"]]})
        assert compared.status_code == 200 and len(compared.json()["rewards"]) == 2
        # Bounds hold under the prefix as on the plain path.
        bad = await client.post("/ng-rollout/9-9/verify", content=b"[1]")
        assert bad.status_code == 400 and bad.json()["failure_kind"] == "bad_request"
        wrong = await client.get("/ng-rollout/9-9/verify")
        assert wrong.status_code == 405
    lines = [r for r in caplog.records if getattr(r, "event", None) == "cohort"]
    assert len(lines) == 1
    assert lines[0].rollout_ids == "7-0,7-1,-"  # type: ignore[attr-defined]


async def test_plain_cohorts_log_no_rollout_ids(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "genrm_trio.server.cohort")
    cfg = Config(num_rollouts_per_prompt=2, port=0)
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        answers = await post_all(client, [body(s, group="plain", attempt=0) for s in range(2)])
        assert [a.status_code for a in answers] == [200, 200]
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "cohort"]
    assert not hasattr(line, "rollout_ids")


async def test_malformed_id_is_a_json_404_and_keep_alive_survives() -> None:
    cfg = Config(num_rollouts_per_prompt=2, port=0)
    member = json.dumps(body(0, group="g", attempt=0)).encode()
    async with running_server(cfg) as url:
        answers = await raw_http(url, [
            ("POST", "/ng-rollout/.bad/verify", member),
            ("POST", "/ng-rollout/" + "r" * 600 + "/seed_session", b"{}"),
            ("GET", "/health", b""),
        ])
    assert [a[0] for a in answers] == [404, 404, 200]
    for _status, _headers, data in answers[:2]:
        detail = json.loads(data)
        assert detail["failure_kind"] == "bad_request"
        assert wire.ROLLOUT_ID_PATTERN in detail["detail"] and "512" in detail["detail"]


async def test_auth_applies_to_prefixed_paths_as_to_plain_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENRM_TEST_PREFIX_TOKEN", "tok-123")
    cfg = Config(num_rollouts_per_prompt=1, port=0, auth_token_env="GENRM_TEST_PREFIX_TOKEN")
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        member = body(0, group="g", attempt=0)
        for method, path in (("POST", "/ng-rollout/1-0/verify"), ("GET", "/ng-rollout/1-0/status"),
                             ("POST", "/ng-rollout/1-0/seed_session")):
            refused = await client.request(method, path, json=member)
            assert refused.status_code == 401, path
            assert refused.json()["failure_kind"] == "unauthorized"
        for probe in ("/", "/livez", "/health", "/healthz", "/readyz"):
            assert (await client.get(f"/ng-rollout/1-0{probe}")).status_code == 200, probe
            assert (await client.get(probe)).status_code == 200, probe
        good = await client.post("/ng-rollout/1-0/verify", json=member,
                                 headers={"Authorization": "Bearer tok-123"})
        assert good.status_code == 200 and good.json()["reward"] == cfg.default_score


def test_openapi_lists_every_path_under_the_prefix() -> None:
    paths = build_openapi()["paths"]
    plain = [p for p in paths if not p.startswith("/ng-rollout/")]
    assert {"/", "/livez", "/verify", "/compare", "/seed_session"} <= set(plain)
    for path in plain:
        prefixed = paths[f"/ng-rollout/{{rollout_id}}{path}"]
        assert prefixed.keys() == paths[path].keys()
        for method, operation in prefixed.items():
            (parameter,) = operation["parameters"]
            assert parameter["schema"] == {"type": "string", "pattern": wire.ROLLOUT_ID_PATTERN,
                                           "maxLength": wire.MAX_ROLLOUT_ID_CHARS}
            assert operation.get("requestBody") == paths[path][method].get("requestBody")
    ids = [op["operationId"] for item in paths.values() for op in item.values()]
    assert len(ids) == len(set(ids))
