"""What a backend is (one attempt: request in, answer text out), and the two without HTTP:
a user's plugin and the built-in heuristic judge. The HTTP backend is :mod:`.http`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from genrm_trio import scoring
from genrm_trio.config import Config
from genrm_trio.errors import ConfigError
from genrm_trio.server import _aio
from genrm_trio.server.judge.answers import non_blank
from genrm_trio.server.judge.attempt import (
    MAX_ERROR_CHARS,
    AttemptFailed,
    JudgeRequest,
    PairState,
    timeout_fatal,
)
from genrm_trio.server.judge.bodies import base_params, resolved_principle

PluginFn = Callable[[dict[str, Any]], Awaitable[Any]]


class Backend(Protocol):
    kind: str

    async def call(self, request: JudgeRequest, attempt: int, state: PairState) -> str:
        """Attempt ``attempt`` (0-based) of the comparison whose shared state is ``state``,
        deadline included. Raises AttemptFailed / AttemptFatal."""
        ...

    def status(self) -> dict[str, Any]: ...


class PluginBackend:
    """A user's async callable, trio-flavoured or run on a trio-asyncio loop."""

    kind = "plugin"

    def __init__(self, cfg: Config, fn: PluginFn, bridge: _aio.AsyncioBridge | None) -> None:
        self._cfg = cfg
        self._fn = fn
        self._bridge = bridge
        self._params = base_params(cfg)

    async def call(self, request: JudgeRequest, attempt: int, state: PairState) -> str:
        payload: dict[str, Any] = {
            "history": [dict(m) for m in request.history],
            "response_1": request.response_1,
            "response_2": request.response_2,
            "principle": resolved_principle(self._cfg, request),
            "params": dict(self._params),
        }
        timeout_s = self._cfg.judge_request_timeout_s
        with trio.move_on_after(timeout_s) as deadline:
            try:
                if self._bridge is not None:
                    answer = await self._bridge.call(self._fn, payload)
                else:
                    answer = await self._fn(payload)
            except Exception as exc:
                # The plugin is a task boundary: any error it raises is one failed attempt.
                detail = str(exc)[:MAX_ERROR_CHARS] or type(exc).__name__
                raise AttemptFailed(
                    "plugin", f"judge plugin raised {type(exc).__name__}: {detail}"
                ) from exc
        if deadline.cancelled_caught:
            raise timeout_fatal(timeout_s)
        if not isinstance(answer, str):
            raise AttemptFailed(
                "unusable", f"judge plugin returned {type(answer).__name__}, not str"
            )
        return non_blank(answer)

    def status(self) -> dict[str, Any]:
        return {
            "plugin": self._cfg.judge.plugin,
            "plugin_flavor": self._cfg.judge.plugin_flavor,
            "endpoints": [],
        }


class BuiltinBackend:
    """The heuristic judge: deterministic, no network; rewards are synthetic."""

    kind = "builtin"

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg

    async def call(self, request: JudgeRequest, attempt: int, state: PairState) -> str:
        await trio.lowlevel.checkpoint()
        return scoring.heuristic_judge_text(
            request.history,
            request.response_1,
            request.response_2,
            resolved_principle(self._cfg, request),
        )

    def status(self) -> dict[str, Any]:
        return {"endpoints": []}


def load_plugin(spec: str) -> PluginFn:
    """Import ``module:function`` (attribute path may be dotted); raises ConfigError."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError("judge.plugin", f"{spec!r} is not of the form 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            "judge.plugin", f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for name in attr_path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError as exc:
            raise ConfigError("judge.plugin", f"{spec!r}: no attribute {name!r}") from exc
    is_async = inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(
        getattr(obj, "__call__", None)  # noqa: B004 - async callable objects are fine
    )
    if not callable(obj) or not is_async:
        raise ConfigError("judge.plugin", f"{spec!r} is not an async function")
    fn: PluginFn = obj
    return fn
