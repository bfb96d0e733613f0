"""Inbound bearer auth (``auth_token_env``): every endpoint but the probes needs the token, the
401 is JSON ``unauthorized``, keep-alive survives a refusal, the token never leaks, and a missing
variable stops ``serve`` with exit 2 naming the key."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import httpx2
import pytest
import trio

from genrm_trio.config import Config, load_config
from genrm_trio.errors import ConfigError
from genrm_trio.server.auth import BearerAuth, read_auth_token
from tests.lifecycle_helpers import body
from tests.server_helpers import raw_http, running_server

TOKEN = "s3cret-token-value-0123456789"
ENV = "GENRM_TEST_AUTH_TOKEN"


def auth_cfg(**kw: object) -> Config:
    return Config(num_rollouts_per_prompt=2, port=0, auth_token_env=ENV, **kw)  # type: ignore[arg-type]


def test_bearer_check_is_exact() -> None:
    auth = BearerAuth(TOKEN.encode())
    ok = [(b"authorization", f"Bearer {TOKEN}".encode())]
    assert auth.allows("/verify", ok)
    assert auth.allows("/verify", [(b"authorization", f"bearer  {TOKEN} ".encode())])
    for headers in (
        [],
        [(b"authorization", f"Basic {TOKEN}".encode())],
        [(b"authorization", f"Bearer {TOKEN}x".encode())],
        [(b"authorization", f"Bearer {TOKEN[:-1]}".encode())],
        [(b"authorization", b"Bearer")],
        [*ok, (b"authorization", b"Bearer other")],
    ):
        assert not auth.allows("/verify", headers), headers
    for open_path in ("/", "/health", "/healthz", "/livez", "/readyz"):
        assert auth.allows(open_path, [])
    assert not auth.allows("/metrics", [])


def test_token_read_from_the_named_variable() -> None:
    assert read_auth_token(Config(), {}) is None
    assert read_auth_token(auth_cfg(), {ENV: f" {TOKEN}\n"}) == TOKEN.encode()
    for env in ({}, {ENV: "  "}):
        with pytest.raises(ConfigError) as info:
            read_auth_token(auth_cfg(), env)
        assert info.value.key == "auth_token_env" and TOKEN not in str(info.value)


@pytest.mark.parametrize("value", ["", "A=b", "GENRM_TRIO_TOKEN"])
def test_auth_token_env_must_be_a_plain_variable_name(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"auth_token_env={value!r}"], {})
    assert info.value.key == "auth_token_env"


async def test_every_endpoint_but_the_probes_needs_the_token(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(ENV, TOKEN)
    caplog.set_level(logging.DEBUG)
    good = {"authorization": f"Bearer {TOKEN}"}
    bad = {"authorization": "Bearer wrong-guess"}
    async with running_server(auth_cfg()) as url, httpx2.AsyncClient(base_url=url) as client:
        for path in ("/health", "/healthz", "/readyz"):
            assert (await client.get(path)).status_code == 200
        refused = [
            ("GET", "/status"), ("GET", "/metrics"), ("GET", "/openapi.json"),
            ("GET", "/reverify_mode"), ("POST", "/seed_session"), ("POST", "/close_session"),
            ("POST", "/compare"), ("POST", "/aggregate_metrics"), ("POST", "/verify"),
            ("GET", "/verify"), ("GET", "/no-such-path"),
        ]
        seen: list[str] = []
        for method, path in refused:
            for headers in ({}, bad):
                answer = await client.request(method, path, json={"x": 1}, headers=headers)
                assert answer.status_code == 401, (method, path, answer.text)
                assert answer.json() == {
                    "detail": answer.json()["detail"], "failure_kind": "unauthorized"}
                assert answer.headers["www-authenticate"].startswith("Bearer")
                seen.append(answer.text)
        # With the token the routes behave as without auth.
        assert (await client.get("/status", headers=good)).status_code == 200
        assert (await client.get("/reverify_mode", headers=good)).json() == "unsupported"
        answers: list[httpx2.Response] = []

        async def member(slot: int) -> None:
            answers.append(await client.post("/verify", json=body(slot, group="authed"),
                                             headers=good))

        async with trio.open_nursery() as nursery:
            for slot in (0, 1):
                nursery.start_soon(member, slot)
        assert [a.status_code for a in answers] == [200, 200]
        status = (await client.get("/status", headers=good)).text
        metrics = (await client.get("/metrics", headers=good)).text
    for text in (*seen, status, metrics, *(r.getMessage() for r in caplog.records),
                 *(json.dumps(vars(r), default=str) for r in caplog.records)):
        assert TOKEN not in text
        assert "wrong-guess" not in text
    assert "genrm_http_unauthorized_total 22.0" in metrics


async def test_refused_body_is_drained_so_keep_alive_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, TOKEN)
    payload = json.dumps(body(0, group="ka")).encode()
    async with running_server(auth_cfg()) as url:
        answers = await raw_http(url, [
            ("POST", "/verify", payload), ("POST", "/compare", payload),
            ("GET", "/healthz", b""),
        ])
        assert [status for status, _h, _b in answers] == [401, 401, 200]
        assert all(h.get("connection") != "close" for _s, h, _b in answers)
        # A body past the drain bound is not read: the answer closes the connection.
        big = b"x" * (200 * 1024)
        answers = await raw_http(url, [("POST", "/verify", big), ("GET", "/healthz", b"")])
        assert [status for status, _h, _b in answers] == [401]
        assert answers[0][1]["connection"] == "close"


def test_serve_exits_2_naming_the_key_when_the_variable_is_missing() -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != ENV}
    result = subprocess.run(
        [sys.executable, "-m", "genrm_trio.cli", "serve", "--port", "0",
         "--set", f"auth_token_env={ENV}"],
        capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "auth_token_env" in lines[0] and ENV in lines[0], result.stderr


async def test_the_torture_fuzzer_sends_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from genrm_trio.torture.fuzz import run_http_fuzz

    monkeypatch.setenv(ENV, TOKEN)
    async with running_server(auth_cfg()) as url:
        with_token = await run_http_fuzz(url, bodies=20, seed=3, token=TOKEN)
        without = await run_http_fuzz(url, bodies=20, seed=3)
    assert with_token.violations == [] and set(with_token.statuses) <= {400, 422}
    assert set(without.statuses) == {401} and without.violations
