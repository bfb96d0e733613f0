"""Inbound bearer-token auth (``auth_token_env``).

The token is read once, at start, from the environment variable the config names
(:func:`read_auth_token`); it lives only in the :class:`BearerAuth` object the app holds. Every
endpoint except :data:`OPEN_PATHS` (liveness and readiness, which load balancers and
orchestrators probe without credentials; also under NeMo Gym's ``/ng-rollout/<id>/`` prefix,
which the app strips before asking) needs ``Authorization: Bearer <token>``. The comparison
is :func:`hmac.compare_digest` over bytes, so its time does not depend on how much of a guess is
right. Nothing here logs, formats or echoes the token or what a client sent.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

from genrm_trio.config import Config
from genrm_trio.errors import ConfigError

OPEN_PATHS: frozenset[str] = frozenset({"/", "/health", "/healthz", "/livez", "/readyz"})
UNAUTHORIZED_DETAIL = (
    "missing or invalid bearer token: send 'Authorization: Bearer <token>' with the token from "
    "the server's auth_token_env variable"
)


def read_auth_token(cfg: Config, env: Mapping[str, str]) -> bytes | None:
    """The configured token, or None when ``auth_token_env`` is not set.

    Raises :class:`~genrm_trio.errors.ConfigError` (key ``auth_token_env``) when the variable is
    missing or blank: a server that was asked to require a token must not start open.
    """
    name = cfg.auth_token_env
    if name is None:
        return None
    value = env.get(name, "")
    if not value.strip():
        raise ConfigError("auth_token_env", f"environment variable {name!r} is not set or empty")
    return value.strip().encode("utf-8")


class BearerAuth:
    """Checks ASGI request headers against one token. Immutable after construction."""

    __slots__ = ("_token",)

    def __init__(self, token: bytes) -> None:
        self._token = token

    def allows(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """True if the request may go on: an open path, or exactly one Authorization header
        carrying ``Bearer <token>`` (scheme case-insensitive, RFC 9110)."""
        if path in OPEN_PATHS:
            return True
        found: bytes | None = None
        for name, value in headers:
            if name.lower() == b"authorization":
                if found is not None:
                    return False  # two credentials: refuse rather than pick one
                found = value
        if found is None:
            return False
        scheme, _, credential = found.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(credential.strip(), self._token)


__all__ = ["OPEN_PATHS", "UNAUTHORIZED_DETAIL", "BearerAuth", "read_auth_token"]
