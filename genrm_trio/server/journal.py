"""Durable terminal records and attempt watermarks (SQLite), used when ``state_dir`` is set.

The registry keeps its records in memory as always; the journal mirrors every insert and eviction
so that a restarted server reloads them: replay, failure records and attempt fencing survive a
restart. Expiry instants are stored as wall-clock times (the registry's clock is Trio's monotonic
clock, which restarts with the process).

Writes are small single-row statements in autocommit mode on a WAL database with
``synchronous=NORMAL`` (no fsync per commit), so they are done inline on the Trio thread: about
tens of microseconds each, once per finished cohort, cheaper than handing them to a thread.
Written by hand over the standard library's sqlite3: the schema is two tables.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from genrm_trio.errors import GenRMError
from genrm_trio.identity import CohortKey

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
"""

FILE_NAME = "genrm-trio-state.sqlite3"


class JournalError(GenRMError):
    """The state directory or its database cannot be used."""


@dataclass(frozen=True, slots=True)
class StoredRecord:
    key: CohortKey
    expires_wall: float | None
    digests: tuple[str, ...]
    rewards: tuple[float, ...]
    failure: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class StoredWatermark:
    group_id: str
    attempt: int
    prompt_digest: str
    touched_wall: float


def _key_text(key: CohortKey) -> str:
    return json.dumps([key.group_id, key.legacy_key, key.attempt], separators=(",", ":"))


def _key_from_text(text: str) -> CohortKey:
    group_id, legacy_key, attempt = json.loads(text)
    return CohortKey(group_id=group_id, legacy_key=legacy_key, attempt=int(attempt))


class Journal:
    """One SQLite file in ``state_dir``. Owned by ``serve`` (opened before the registry, closed
    after it). Every method blocks briefly on local disk and raises :class:`JournalError`."""

    def __init__(self, connection: sqlite3.Connection, path: str) -> None:
        self._db = connection
        self.path = path
        self._seq = 0
        row = self._db.execute(
            "SELECT max(s) FROM (SELECT max(seq) AS s FROM records "
            "UNION ALL SELECT max(seq) FROM watermarks)"
        ).fetchone()
        self._seq = int(row[0] or 0)

    @classmethod
    def open(cls, state_dir: str) -> Journal:
        try:
            os.makedirs(state_dir, exist_ok=True)
            path = os.path.join(state_dir, FILE_NAME)
            connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise JournalError(f"cannot open state_dir {state_dir!r}: {exc}") from exc
        return cls(connection, path)

    def close(self) -> None:
        self._db.close()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _run(self, sql: str, params: tuple[Any, ...]) -> None:
        try:
            self._db.execute(sql, params)
        except sqlite3.Error as exc:
            raise JournalError(f"state journal write failed: {exc}") from exc

    # records -----------------------------------------------------------------------------

    def records(self) -> Iterator[StoredRecord]:
        """Stored records, oldest first."""
        rows = self._db.execute(
            "SELECT key, expires_wall, digests, rewards, failure FROM records ORDER BY seq"
        )
        for key, expires_wall, digests, rewards, failure in rows:
            yield StoredRecord(
                _key_from_text(key), expires_wall, tuple(json.loads(digests)),
                tuple(float(r) for r in json.loads(rewards)),
                json.loads(failure) if failure is not None else None,
            )

    def put_record(self, key: CohortKey, expires_wall: float | None, digests: tuple[str, ...],
                   rewards: tuple[float, ...], failure: dict[str, Any] | None) -> None:
        self._run(
            "INSERT OR REPLACE INTO records (key, seq, expires_wall, digests, rewards, failure) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (_key_text(key), self._next_seq(), expires_wall, json.dumps(list(digests)),
             json.dumps(list(rewards)), json.dumps(failure) if failure is not None else None),
        )

    def delete_record(self, key: CohortKey) -> None:
        self._run("DELETE FROM records WHERE key = ?", (_key_text(key),))

    # watermarks --------------------------------------------------------------------------

    def watermarks(self) -> Iterator[StoredWatermark]:
        """Stored watermarks, least recently written first."""
        rows = self._db.execute(
            "SELECT group_id, attempt, prompt_digest, touched_wall FROM watermarks ORDER BY seq"
        )
        for group_id, attempt, prompt_digest, touched_wall in rows:
            yield StoredWatermark(group_id, int(attempt), prompt_digest, float(touched_wall))

    def put_watermark(self, group_id: str, attempt: int, prompt_digest: str,
                      touched_wall: float) -> None:
        self._run(
            "INSERT OR REPLACE INTO watermarks (group_id, seq, attempt, prompt_digest, "
            "touched_wall) VALUES (?, ?, ?, ?, ?)",
            (group_id, self._next_seq(), attempt, prompt_digest, touched_wall),
        )

    def delete_watermark(self, group_id: str) -> None:
        self._run("DELETE FROM watermarks WHERE group_id = ?", (group_id,))
