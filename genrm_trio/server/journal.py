"""Durable terminal records, attempt watermarks and reusable verdicts (SQLite), used when
``state_dir`` is set.

The registry keeps its records in memory as always; the journal mirrors every insert and eviction
so that a restarted server reloads them: replay, failure records and attempt fencing survive a
restart. Expiry instants are stored as wall-clock times (the registry's clock is Trio's monotonic
clock, which restarts with the process).

**The journal degrades, it never kills.** Memory is the truth while the process lives; the journal
is a best-effort mirror for the next process. A write that fails for any reason (disk full, a
read-only or locked database, a value SQLite cannot store) is logged, counted and shown as
``degraded`` in ``/status`` and ``/metrics``; it never raises into the registry, so the cohort's
answers still go out. The journal stays degraded (a sticky flag with the last error) until the
process restarts, because a failed write means the file no longer mirrors memory.

**What survives.** Writes are small statements in autocommit mode on a WAL database. With
``state_sync: normal`` (SQLite ``synchronous=NORMAL``) a killed process (SIGKILL, OOM, crash) loses
nothing that was written: the WAL is in the OS page cache. A power loss or kernel crash can lose the
last commits before the most recent WAL checkpoint sync (records of cohorts that finished in the
last moments), never corrupt the file. ``state_sync: full`` fsyncs every commit (``synchronous=
FULL``), which survives power loss at the cost of one fsync per finished cohort.

**Reload validates.** Every row is checked on start (key shape, digests and rewards matching the
configured cohort size, finite rewards, a well-formed failure, a non-negative attempt; a partial
cohort's record, ``incomplete_cohort_policy: judge_present``, holds null for each slot it was
judged without, in both lists at the same places, and at least two members; for a verdict, a
sha256 key and finite scores within their scales); a bad row (a changed
``num_rollouts_per_prompt``, a hand-edited or foreign file) is skipped, never trusted, and the
number skipped is logged in one warning.

Writes are done inline on the Trio thread: about tens of microseconds each, once per finished
cohort (and once per verdict the judge returns, with ``verdict_reuse`` on), cheaper than handing
them to a thread. Work that touches many rows (a mass expiry) is one transaction. Written by hand
over the standard library's sqlite3: the schema is three tables.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from genrm_trio.errors import GenRMError
from genrm_trio.identity import CohortKey
from genrm_trio.scoring import RANKING_RANGE, SCORE_RANGE

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    key TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    expires_wall REAL,
    digests TEXT NOT NULL,
    rewards TEXT NOT NULL,
    failure TEXT
);
CREATE INDEX IF NOT EXISTS records_seq ON records (seq);
CREATE TABLE IF NOT EXISTS watermarks (
    group_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    prompt_digest TEXT NOT NULL,
    touched_wall REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS watermarks_seq ON watermarks (seq);
CREATE TABLE IF NOT EXISTS verdicts (
    key TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    expires_wall REAL,
    score_1 REAL NOT NULL,
    score_2 REAL NOT NULL,
    ranking REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS verdicts_seq ON verdicts (seq);
"""

FILE_NAME = "genrm-trio-state.sqlite3"

_MAX_ERROR_CHARS = 300
_FAILURE_FIELDS = MappingProxyType({"status": int, "kind": str, "detail": str, "masked": bool})


class JournalError(GenRMError):
    """The state directory or its database cannot be opened (raised at start only)."""


@dataclass(frozen=True, slots=True)
class StoredRecord:
    key: CohortKey
    expires_wall: float | None
    digests: tuple[str | None, ...]  # None: a slot a partial cohort was judged without
    rewards: tuple[float | None, ...]
    failure: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class StoredWatermark:
    group_id: str
    attempt: int
    prompt_digest: str
    touched_wall: float
    finished: bool


@dataclass(frozen=True, slots=True)
class StoredVerdict:
    key: bytes
    expires_wall: float | None
    score_1: float
    score_2: float
    ranking: float


def _key_text(key: CohortKey) -> str:
    return json.dumps([key.group_id, key.legacy_key, key.attempt], separators=(",", ":"))


def _key_from_text(text: str) -> CohortKey:
    group_id, legacy_key, attempt = json.loads(text)
    if not (group_id is None) ^ (legacy_key is None):
        raise ValueError("exactly one of group id and legacy key must be set")
    for part in (group_id, legacy_key):
        if part is not None and not isinstance(part, str):
            raise ValueError("key parts must be strings")
    if type(attempt) is not int or attempt < 0:
        raise ValueError(f"bad attempt {attempt!r}")
    return CohortKey(group_id=group_id, legacy_key=legacy_key, attempt=attempt)


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(
        c in "0123456789abcdef" for c in value)


def _failure_from_text(text: str) -> dict[str, Any]:
    failure = json.loads(text)
    if not isinstance(failure, dict):
        raise ValueError("failure is not an object")
    for name, kind in _FAILURE_FIELDS.items():
        if type(failure.get(name)) is not kind:
            raise ValueError(f"failure.{name} is not {kind.__name__}")
    retry = failure.get("retry_after_s")
    if retry is not None and not (isinstance(retry, (int, float)) and math.isfinite(retry)):
        raise ValueError("failure.retry_after_s is not a finite number")
    unknown = set(failure) - set(_FAILURE_FIELDS) - {"retry_after_s"}
    if unknown:
        raise ValueError(f"failure has unknown fields {sorted(unknown)}")
    return failure


class Journal:
    """One SQLite file in ``state_dir``. Owned by ``serve`` (opened before the registry, closed
    after it). Writes never raise (see the module docstring); :meth:`open` raises
    :class:`JournalError` when the file cannot be opened at all."""

    def __init__(self, connection: sqlite3.Connection, path: str) -> None:
        self._db = connection
        self.path = path
        self.degraded = False
        self.failed_writes = 0
        self.last_error: str | None = None
        self.skipped_rows = 0
        row = self._db.execute(
            "SELECT max(s) FROM (SELECT max(seq) AS s FROM records "
            "UNION ALL SELECT max(seq) FROM watermarks UNION ALL SELECT max(seq) FROM verdicts)"
        ).fetchone()
        self._seq = int(row[0] or 0)

    @classmethod
    def open(cls, state_dir: str, sync: str = "normal") -> Journal:
        """Open (creating) the database in ``state_dir``. ``sync`` is ``normal`` or ``full``."""
        try:
            os.makedirs(state_dir, exist_ok=True)
            path = os.path.join(state_dir, FILE_NAME)
            # timeout=0: a locked database fails the write at once (degraded) instead of
            # stalling the event loop in SQLite's busy wait.
            connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                         timeout=0)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
            connection.executescript(SCHEMA)
            columns = {r[1] for r in connection.execute("PRAGMA table_info(watermarks)")}
            if "finished" not in columns:  # files written before result_expired existed
                connection.execute(
                    "ALTER TABLE watermarks ADD COLUMN finished INTEGER NOT NULL DEFAULT 0")
            return cls(connection, path)
        except (OSError, sqlite3.Error) as exc:
            raise JournalError(f"cannot open state_dir {state_dir!r}: {exc}") from exc

    def close(self) -> None:
        try:
            self._db.close()
        except sqlite3.Error as exc:  # closing must not turn a clean stop into a crash
            self._degrade(exc)

    def status(self) -> dict[str, Any]:
        """For ``/status`` and ``/metrics``: no secrets, bounded text."""
        return {
            "path": self.path,
            "degraded": self.degraded,
            "failed_writes": self.failed_writes,
            "last_error": self.last_error,
            "skipped_rows_at_reload": self.skipped_rows,
        }

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _degrade(self, exc: BaseException) -> None:
        self.failed_writes += 1
        text = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
        if not self.degraded:
            logger.error("state journal %s degraded, memory stays the truth: %s", self.path, text)
        self.degraded = True
        self.last_error = text

    def _write(self, statements: Iterable[tuple[str, tuple[Any, ...]]]) -> bool:
        """Run ``statements`` as one transaction. Never raises: a failure degrades the journal
        (logged once, counted) and returns False."""
        db = self._db
        try:
            db.execute("BEGIN")
            try:
                for sql, params in statements:
                    db.execute(sql, params)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except Exception as exc:  # any failure: disk, lock, read-only, a value SQLite refuses
            self._degrade(exc)
            return False
        return True

    def _rows(self, query: str) -> list[Any]:
        """All rows of a reload query; none (and the journal degraded) when the file cannot
        be read."""
        try:
            return self._db.execute(query).fetchall()
        except sqlite3.Error as exc:
            self._degrade(exc)
            return []

    # records -----------------------------------------------------------------------------

    def records(self, cohort_size: int) -> Iterator[StoredRecord]:
        """Stored records, oldest first; rows that do not fit ``cohort_size`` or are malformed
        are skipped and counted in ``skipped_rows``."""
        rows = self._rows(
            "SELECT key, expires_wall, digests, rewards, failure FROM records ORDER BY seq")
        for key, expires_wall, digests, rewards, failure in rows:
            try:
                parsed_key = _key_from_text(key)
                if expires_wall is not None and not isinstance(expires_wall, (int, float)):
                    raise ValueError("bad expiry")
                parsed_failure = _failure_from_text(failure) if failure is not None else None
                digest_list = json.loads(digests)
                reward_list = json.loads(rewards)
                if parsed_failure is None:
                    if parsed_key.group_id is None:
                        raise ValueError("a completed legacy cohort is never retained")
                    if not (isinstance(digest_list, list) and len(digest_list) == cohort_size
                            and all(d is None or _is_digest(d) for d in digest_list)):
                        raise ValueError(f"digests do not fit a cohort of {cohort_size}")
                    if not (isinstance(reward_list, list) and len(reward_list) == cohort_size
                            and all(r is None or (type(r) in (int, float) and math.isfinite(r))
                                    for r in reward_list)):
                        raise ValueError(f"rewards do not fit a cohort of {cohort_size}")
                    missing = [d is None for d in digest_list]
                    if missing != [r is None for r in reward_list]:
                        raise ValueError("digests and rewards miss different slots")
                    if missing.count(False) < 2:
                        raise ValueError("a partial cohort holds at least two members")
                elif digest_list != [] or reward_list != []:
                    raise ValueError("a failure record holds no digests or rewards")
            except (ValueError, TypeError) as exc:
                self.skipped_rows += 1
                logger.debug("journal row skipped: %s", exc)
                continue
            yield StoredRecord(parsed_key, expires_wall, tuple(digest_list),
                               tuple(None if r is None else float(r) for r in reward_list),
                               parsed_failure)

    def put_record(self, key: CohortKey, expires_wall: float | None,
                   digests: tuple[str | None, ...], rewards: tuple[float | None, ...],
                   failure: dict[str, Any] | None) -> bool:
        return self._write([(
            "INSERT OR REPLACE INTO records (key, seq, expires_wall, digests, rewards, failure) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (_key_text(key), self._next_seq(), expires_wall, json.dumps(list(digests)),
             json.dumps(list(rewards)), json.dumps(failure) if failure is not None else None),
        )])

    def delete_records(self, keys: Iterable[CohortKey]) -> bool:
        """Delete many records in one transaction (a mass expiry)."""
        return self._write(
            ("DELETE FROM records WHERE key = ?", (_key_text(key),)) for key in keys)

    # watermarks --------------------------------------------------------------------------

    def watermarks(self) -> Iterator[StoredWatermark]:
        """Stored watermarks, least recently written first; malformed rows are skipped."""
        rows = self._rows("SELECT group_id, attempt, prompt_digest, touched_wall, finished "
                          "FROM watermarks ORDER BY seq")
        for group_id, attempt, prompt_digest, touched_wall, finished in rows:
            if not (isinstance(group_id, str) and type(attempt) is int and attempt >= 0
                    and _is_digest(prompt_digest) and isinstance(touched_wall, (int, float))
                    and math.isfinite(touched_wall) and finished in (0, 1)):
                self.skipped_rows += 1
                continue
            yield StoredWatermark(group_id, attempt, prompt_digest, float(touched_wall),
                                  bool(finished))

    def put_watermark(self, group_id: str, attempt: int, prompt_digest: str,
                      touched_wall: float, finished: bool = False) -> bool:
        return self._write([(
            "INSERT OR REPLACE INTO watermarks (group_id, seq, attempt, prompt_digest, "
            "touched_wall, finished) VALUES (?, ?, ?, ?, ?, ?)",
            (group_id, self._next_seq(), attempt, prompt_digest, touched_wall, int(finished)),
        )])

    def delete_watermarks(self, group_ids: Iterable[str]) -> bool:
        return self._write(
            ("DELETE FROM watermarks WHERE group_id = ?", (group_id,)) for group_id in group_ids)

    # verdicts ----------------------------------------------------------------------------

    def verdicts(self, default_score: float, default_ranking: float) -> Iterator[StoredVerdict]:
        """Stored reusable verdicts, oldest first. A row is trusted only when its key is a
        sha256 hex digest, its expiry null or finite, and each value a finite number within
        its scale (a verdict's missing field may hold ``default_score`` / ``default_ranking``);
        any other row is skipped and counted in ``skipped_rows``."""
        rows = self._rows(
            "SELECT key, expires_wall, score_1, score_2, ranking FROM verdicts ORDER BY seq")
        for key, expires_wall, score_1, score_2, ranking in rows:
            checks = ((score_1, SCORE_RANGE, default_score),
                      (score_2, SCORE_RANGE, default_score),
                      (ranking, RANKING_RANGE, default_ranking))
            if not (_is_digest(key)
                    and (expires_wall is None or _finite(expires_wall))
                    and all(_finite(value) and (low <= value <= high or value == default)
                            for value, (low, high), default in checks)):
                self.skipped_rows += 1
                continue
            yield StoredVerdict(bytes.fromhex(key),
                                None if expires_wall is None else float(expires_wall),
                                float(score_1), float(score_2), float(ranking))

    def put_verdict(self, key: bytes, expires_wall: float | None, score_1: float,
                    score_2: float, ranking: float) -> bool:
        return self._write([(
            "INSERT OR REPLACE INTO verdicts (key, seq, expires_wall, score_1, score_2, ranking) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (key.hex(), self._next_seq(), expires_wall, score_1, score_2, ranking),
        )])

    def delete_verdicts(self, keys: Iterable[bytes]) -> bool:
        """Delete many verdicts in one transaction (evicted or expired together)."""
        return self._write(
            ("DELETE FROM verdicts WHERE key = ?", (key.hex(),)) for key in keys)


def _finite(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]
