"""Log output: JSON lines off a terminal, key=value on one, bounded fields, no secrets, one
structured line per cohort disposition, rate-limited notes for disconnects and 429s."""

from __future__ import annotations

import io
import json
import logging
import time
from typing import Any

import httpx2
import pytest
import trio

from genrm_trio.config import Config, load_config
from genrm_trio.errors import ConfigError
from genrm_trio.logs import (
    MAX_FIELD_CHARS,
    MAX_MESSAGE_CHARS,
    JsonLineFormatter,
    KeyValueFormatter,
    RateLimitedNote,
    choose_format,
    setup_logging,
)
from tests.lifecycle_helpers import Outcomes, ScriptedJudge, member, open_registry
from tests.server_helpers import running_server


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def record(msg: str = "hello %s", args: tuple[Any, ...] = ("world",),
           **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord("genrm_trio.test", logging.INFO, __file__, 1, msg, args, None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_auto_is_json_off_a_terminal_and_text_on_one() -> None:
    assert choose_format("auto", io.StringIO()) == "json"
    assert choose_format("auto", Tty()) == "text"
    assert choose_format("json", Tty()) == "json"
    assert choose_format("text", io.StringIO()) == "text"


def test_json_line_has_fields_bounds_and_masks_secrets() -> None:
    rec = record("x" * 5000, (), kind="completed", attempt=3, collection_s=0.25, note=None,
                 api_key="sk-abc", auth_token="t0k", long="y" * 5000, nested={"a": [1, 2]})
    line = JsonLineFormatter().format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "INFO" and obj["logger"] == "genrm_trio.test"
    assert obj["ts"].endswith("Z") and "T" in obj["ts"]
    assert len(obj["msg"]) == MAX_MESSAGE_CHARS and obj["msg"].endswith("...")
    assert (obj["kind"], obj["attempt"], obj["collection_s"], obj["note"]) == (
        "completed", 3, 0.25, None)
    assert obj["api_key"] == obj["auth_token"] == "***"
    assert len(obj["long"]) == MAX_FIELD_CHARS
    assert obj["nested"] == '{"a":[1,2]}'
    assert "sk-abc" not in line and "t0k" not in line


def test_json_line_carries_a_bounded_traceback() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        import sys

        rec = logging.LogRecord("t", logging.ERROR, __file__, 1, "crashed", (), sys.exc_info())
    line = JsonLineFormatter().format(rec)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


def test_text_line_is_key_value() -> None:
    line = KeyValueFormatter().format(record(kind="completed", key="group 'a b' attempt 0",
                                             members=4))
    assert "INFO" in line and "genrm_trio.test: hello world" in line
    assert "kind=completed" in line and "members=4" in line
    assert "key=\"group 'a b' attempt 0\"" in line


def test_setup_logging_replaces_handlers_and_picks_the_format() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        out = io.StringIO()
        setup_logging("INFO", "auto", out)
        logging.getLogger("genrm_trio.x").info("one", extra={"n": 1})
        setup_logging("INFO", "text", out)
        logging.getLogger("genrm_trio.x").info("two", extra={"n": 2})
        first, second = out.getvalue().splitlines()
        assert json.loads(first)["n"] == 1
        assert second.endswith("genrm_trio.x: two n=2")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])


def test_log_format_key_is_validated() -> None:
    assert load_config(None, ["log_format=json"], {}).log_format == "json"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["log_format=xml"], {})
    assert info.value.key == "log_format"


def test_rate_limited_note_logs_once_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    note = RateLimitedNote(logging.getLogger("genrm_trio.test"), "client went away", 10.0,
                           clock=lambda: now[0])
    caplog.set_level(logging.INFO, "genrm_trio.test")
    logged = []
    for _step in range(25):  # one event per second for 25 s
        logged.append(note.note())
        now[0] += 1.0
    assert [i for i, x in enumerate(logged) if x] == [0, 10, 20]
    counts = [r.event_count for r in caplog.records]  # type: ignore[attr-defined]
    assert counts == [1, 10, 10]
    assert all("client went away" in r.getMessage() for r in caplog.records)


async def test_one_structured_line_per_cohort_disposition(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "genrm_trio.server.cohort")
    cfg = Config(num_rollouts_per_prompt=3, cohort_collection_timeout_s=5.0)
    judge = ScriptedJudge(latency_s=2.0)
    async with open_registry(cfg, judge) as registry, trio.open_nursery() as nursery:
        outcomes = Outcomes(registry, nursery)
        outcomes.send("a0", member(cfg, 0, group="done"))
        await trio.sleep(1.0)
        outcomes.send("a1", member(cfg, 1, group="done"))
        outcomes.send("a2", member(cfg, 2, group="done"))
        outcomes.send("b0", member(cfg, 0, group="x" * 500))  # never completes
    lines = [r for r in caplog.records if getattr(r, "event", None) == "cohort"]
    assert len(lines) == 2
    done = next(r for r in lines if r.kind == "completed")  # type: ignore[attr-defined]
    fields = {k: getattr(done, k) for k in ("attempt", "members", "size", "collection_s",
                                             "evaluation_s", "total_s", "judge_calls")}
    assert fields == {"attempt": 0, "members": 3, "size": 3, "collection_s": 1.0,
                      "evaluation_s": 2.0, "total_s": 3.0, "judge_calls": 3}
    assert done.key == "group 'done' attempt 0"  # type: ignore[attr-defined]
    incomplete = next(r for r in lines if r.kind == "cohort_incomplete")  # type: ignore[attr-defined]
    assert incomplete.members == 1 and incomplete.evaluation_s is None  # type: ignore[attr-defined]
    assert incomplete.collection_s == 5.0  # type: ignore[attr-defined]
    assert len(incomplete.key) < 120  # type: ignore[attr-defined]
    obj = json.loads(JsonLineFormatter().format(incomplete))
    assert obj["kind"] == "cohort_incomplete" and obj["judge_calls"] == 0


async def test_429s_and_disconnects_are_logged_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "genrm_trio.server.app")
    cfg = Config(num_rollouts_per_prompt=2, port=0, max_active_cohorts=1)
    from tests.lifecycle_helpers import body

    started = time.monotonic()
    async with running_server(cfg) as url, httpx2.AsyncClient(base_url=url) as client:
        async with trio.open_nursery() as nursery:
            # Holds the one cohort slot until the test cancels it (a client disconnect).
            async def hold() -> None:
                await client.post("/verify", json=body(0, group="holder"))

            nursery.start_soon(hold)
            with trio.fail_after(10):
                while (await client.get("/status")).json()["cohorts"]["waiters"] < 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            for i in range(6):
                answer = await client.post("/verify", json=body(0, group=f"new-{i}"))
                assert answer.status_code == 429
            nursery.cancel_scope.cancel()
        with trio.fail_after(10):
            while (await client.get("/status")).json()["cohorts"]["waiters"] > 0:  # noqa: ASYNC110
                await trio.sleep(0.01)
    elapsed = time.monotonic() - started
    ours = [r for r in caplog.records if r.name == "genrm_trio.server.app"]
    overloaded = [r for r in ours if "429" in r.getMessage()]
    gone = [r for r in ours if "went away" in r.getMessage()]
    if elapsed < 9.0:  # a slower run may legitimately log a second line
        assert len(overloaded) == 1 and len(gone) == 1
    assert overloaded[0].event_count == 1  # type: ignore[attr-defined]
