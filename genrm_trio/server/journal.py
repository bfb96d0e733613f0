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

**The loop never waits for the disk.** Every write (``put_*``, ``delete_*``) is queued on the
Trio thread and returns at once; the writer (:meth:`Journal.writing`, run by ``serve`` around the
registry) takes everything queued, writes it as one transaction in a worker thread and commits
it (group commit: one commit, and with ``state_sync: full`` one sync, for everything that queued
while the previous commit ran), then wakes what waited for it. WAL checkpoints run in the writer
too, after every :data:`CHECKPOINT_COMMITS` commits (SQLite's automatic checkpoint, which runs
inside a commit, is off). The queue is bounded (:data:`MAX_QUEUED_STATEMENTS`).

**What survives.** The waiters of a cohort whose record is kept are released once the commit
holding that record is confirmed (``CohortRegistry._release``), and a member answered from a
record or a watermark waits for whatever is still queued: an answer never goes out before its
record is committed. With ``state_sync: normal`` (SQLite ``synchronous=NORMAL``) a commit is in
the WAL, in the OS page cache: a killed process (SIGKILL, OOM, crash) loses no answered record,
only what was queued and not yet committed (records of cohorts whose waiters had not been
answered yet). A power loss or kernel crash can lose the last commits before the most recent
checkpoint sync, never corrupt the file. With ``state_sync: full`` (``synchronous=FULL``) each
commit is synced, so an answered record survives power loss too; a client waits for one group
commit: the one in progress when its record was queued (if any), then its own, i.e. one to two
sync latencies (plus a checkpoint's when one runs), shared by everything queued meanwhile.

**A stalled or full writer degrades, never the serving.** An answer waits at most
:data:`STALL_S` for its commit: then the journal degrades ("the disk is stalled") and everything
waiting is released, and from then on nothing waits for the journal (it no longer mirrors
memory). A write that finds the queue full is dropped and degrades the journal at once. When
the writer stops (shutdown), it drains the queue and closes the file within the bound its owner
gives (``serve``: the shutdown deadline's cleanup allowance); past it the worker thread is
abandoned (it holds the connection until the process ends) and what was still queued or being
committed is lost, as a ``kill -9`` at that moment would lose it, and counted in the degraded
journal's last error. The promises above hold while the journal is not degraded: once it is,
answers no longer wait for it, and records answered since may be missing from the file
(``degraded`` in ``/status`` says so; restart once the disk is fixed).

**Reload validates.** Every row is checked on start (key shape, digests and rewards matching the
configured cohort size, finite rewards, a well-formed failure, a non-negative attempt; a partial
cohort's record, ``incomplete_cohort_policy: judge_present``, holds null for each slot it was
judged without, in both lists at the same places, and at least two members; for a verdict, a
sha256 key and finite scores within their scales); a bad row (a changed
``num_rollouts_per_prompt``, a hand-edited or foreign file) is skipped, never trusted, and the
number skipped is logged in one warning.

Without a running writer (tools, tests) each write is one transaction at once on the caller's
thread. Reads (the reload) happen on the Trio thread before the writer has anything to write;
the connection is then only the writer's, one call at a time (``check_same_thread=False``).
Written by hand over the standard library's sqlite3 (the schema is three tables), with
``trio.to_thread`` for the worker thread: no library does group commit for us.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any

import trio

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

MAX_QUEUED_STATEMENTS = 16_384
"""At most this many statements wait for the disk; past it a write is dropped and the journal
degrades (a few MB of queued rows: minutes of a 20-cohorts-a-second load)."""
STALL_S = 5.0
"""An answer waits at most this long for the commit of its record; past it the journal degrades
(stalled) and everything waiting is released."""
CHECKPOINT_COMMITS = 64
"""The writer checkpoints the WAL (PASSIVE) after this many commits (SQLite's own automatic
checkpoint, which would run inside a commit, is off)."""
FLUSH_S = 5.0
"""How long :meth:`Journal.writing` drains the queue on leaving, unless told otherwise."""
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


class JournalStalled(GenRMError):
    """A commit was not confirmed within :data:`STALL_S` (the disk is stalled)."""


class JournalQueueFull(GenRMError):
    """More than :data:`MAX_QUEUED_STATEMENTS` statements waited for the disk."""


Statements = list[tuple[str, tuple[Any, ...]]]
RunSync = Callable[..., Awaitable[Any]]
"""How the writer runs a blocking call: ``await run_sync(fn, *args)``. The default runs it in a
worker thread of the journal's own (one-thread) limiter; tests may run it inline (a seam)."""


class Journal:
    """One SQLite file in ``state_dir``. Owned by ``serve`` (opened before the registry, its
    writer run by :meth:`writing` around the registry, closed after it). Writes never raise
    and never block (see the module docstring); :meth:`open` raises :class:`JournalError`
    when the file cannot be opened at all.

    Every ``put_*`` / ``delete_*`` call appends one group of statements to the queue (the
    Trio thread only) and returns its ticket; :meth:`after_commit` runs a callback once
    everything queued so far is committed. Without a running writer (:meth:`writing`),
    each group is written at once on the caller's thread (tools, tests)."""

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
        # The queue (touched by the Trio thread only): groups of statements by ticket.
        self._queue: deque[tuple[int, Statements]] = deque()
        self._queued_statements = 0
        self._ticket = 0  # the last ticket handed out
        self._committed = 0  # every ticket up to this one is committed (or its write failed)
        # Callbacks waiting for a commit: (ticket, stall deadline, callback), ticket order.
        self._gates: deque[tuple[int, float, Callable[[], None]]] = deque()
        self._queued = trio.Event()  # set when the queue gains a group (wakes the writer)
        self._gated = trio.Event()  # set when a callback starts to wait (wakes the watch)
        self._in_thread = False  # a call of the writer runs in its worker thread
        self._in_flight = 0  # statements of the commit in progress
        self._writing = False  # a writer runs (inside `writing`)
        self._closing = False  # the writer drains the queue and ends
        self._abandoned = False  # the writer's thread was left behind at the deadline
        self._closed = False
        self.commits = 0
        self.checkpoints = 0
        self.largest_batch = 0

    @classmethod
    def open(cls, state_dir: str, sync: str = "normal") -> Journal:
        """Open (creating) the database in ``state_dir``. ``sync`` is ``normal`` or ``full``."""
        try:
            os.makedirs(state_dir, exist_ok=True)
            path = os.path.join(state_dir, FILE_NAME)
            # check_same_thread=False: the writer's worker thread uses it, one call at a time,
            # after the reload's reads on the Trio thread. timeout=0: a locked database fails
            # the write at once (degraded) instead of waiting in SQLite's busy loop.
            connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                         timeout=0)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
            # Checkpoints are the writer's, after a commit is confirmed (CHECKPOINT_COMMITS),
            # never inside a commit that answers wait for.
            connection.execute("PRAGMA wal_autocheckpoint=0")
            connection.executescript(SCHEMA)
            columns = {r[1] for r in connection.execute("PRAGMA table_info(watermarks)")}
            if "finished" not in columns:  # files written before result_expired existed
                connection.execute(
                    "ALTER TABLE watermarks ADD COLUMN finished INTEGER NOT NULL DEFAULT 0")
            return cls(connection, path)
        except (OSError, sqlite3.Error) as exc:
            raise JournalError(f"cannot open state_dir {state_dir!r}: {exc}") from exc

    def close(self) -> None:
        """Close the file (synchronous; once :meth:`writing` has ended, when it did not close
        it). Does nothing once the writer's thread was abandoned (it still holds the
        connection) or the writer closed it."""
        if self._closed or self._abandoned:
            return
        self._closed = True
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
            "queued_statements": self._queued_statements,
            "commits": self.commits,
            "checkpoints": self.checkpoints,
            "largest_batch": self.largest_batch,
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
        if self._gates:  # nothing waits for a journal that no longer mirrors memory
            self._release_all()

    # the queue (Trio thread) -------------------------------------------------------------

    def _write(self, statements: Iterable[tuple[str, tuple[Any, ...]]]) -> int | None:
        """Queue ``statements`` as one group (written in the writer's next commit, in order).
        Never raises, never blocks: a full queue degrades the journal (logged once, counted)
        and the group is dropped (None); otherwise returns its ticket. Without a running
        writer the group is written at once, on the caller's thread."""
        group = list(statements)
        if not group:
            return None
        if self._queued_statements + len(group) > MAX_QUEUED_STATEMENTS:
            self._degrade(JournalQueueFull(
                f"more than {MAX_QUEUED_STATEMENTS} statements waiting for the disk: "
                f"{len(group)} dropped"))
            return None
        if self._abandoned:  # its thread may still hold the connection: never wait for it
            self._degrade(JournalStalled("the writer's thread was abandoned: write dropped"))
            return None
        self._ticket += 1
        if not self._writing:  # no writer (tools, tests): written inline, as one transaction
            error = self._transaction(group)
            if error is not None:
                self._degrade(error)
            self._committed = self._ticket
            return self._ticket
        self._queue.append((self._ticket, group))
        self._queued_statements += len(group)
        self._queued.set()
        return self._ticket

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (synchronous, on the Trio thread) once everything queued so far is
        committed: at once when it already is, when no writer runs, or when the journal is
        degraded; at the latest :data:`STALL_S` from now (then the journal degrades: stalled).
        The commit is synced to disk with ``state_sync: full``."""
        if self._committed >= self._ticket or not self._writing or self.degraded:
            callback()
            return
        self._gates.append((self._ticket, trio.current_time() + STALL_S, callback))
        self._gated.set()

    async def committed(self) -> None:
        """Wait until everything queued so far is committed (see :meth:`after_commit`);
        returns without a checkpoint when nothing is pending."""
        if self._committed >= self._ticket or not self._writing or self.degraded:
            return
        event = trio.Event()
        self.after_commit(event.set)
        await event.wait()

    def _release_committed(self) -> None:
        gates = self._gates
        while gates and gates[0][0] <= self._committed:
            gates.popleft()[2]()

    def _release_all(self) -> None:
        gates = self._gates
        while gates:
            gates.popleft()[2]()

    # the writer ----------------------------------------------------------------------------

    @asynccontextmanager
    async def writing(self, flush_bound_s: Callable[[], float] = lambda: FLUSH_S, *,
                      close: bool = False, run_sync: RunSync | None = None,
                      ) -> AsyncIterator[Journal]:
        """Run the journal's writer for the lifetime of the block: one task (in a nursery of
        its own) that takes everything queued, commits it as one transaction in a worker
        thread (one sync with ``state_sync: full``), then releases what waited for it; and a
        second that degrades the journal when a commit is not confirmed within
        :data:`STALL_S`. On leaving, the writer drains the queue (and closes the file, with
        ``close``) within ``flush_bound_s()`` seconds, read then: past it the worker thread
        is abandoned (it holds the connection until the process ends) and what was still
        queued or being committed is lost, as a ``kill -9`` then would lose it. ``run_sync``
        (a seam for tests) runs each blocking call; by default a worker thread."""
        if run_sync is None:
            limiter = trio.CapacityLimiter(1)  # one call at a time, apart from other threads
            run_sync = partial(trio.to_thread.run_sync, abandon_on_cancel=True, limiter=limiter)
        assert not self._writing, "one writer per journal"
        scope: trio.CancelScope | None = None
        try:
            async with trio.open_nursery() as nursery:
                scope = nursery.cancel_scope
                self._writing = True
                self._closing = False
                nursery.start_soon(self._write_queued, run_sync, close)
                watch = trio.CancelScope()
                nursery.start_soon(self._watch_stalls, watch)
                try:
                    yield self
                finally:
                    watch.cancel()
                    self._closing = True
                    self._queued.set()
                    # The drain runs even when the block was left by a cancellation.
                    scope.shield = True
                    scope.deadline = trio.current_time() + max(0.0, flush_bound_s())
        finally:
            self._writing = False
            if scope is not None and scope.cancelled_caught:
                self._abandoned = self._in_thread
                lost = self._queued_statements + self._in_flight
                self._queue.clear()
                self._queued_statements = 0
                if lost:
                    self._degrade(JournalStalled(
                        f"the writer did not finish within its shutdown bound: {lost} "
                        "statements not yet durable are lost"))
                else:
                    logger.warning("state journal %s: not closed within its shutdown bound",
                                   self.path)
            self._release_all()  # nothing will confirm them any more

    async def _call(self, run_sync: RunSync, fn: Callable[..., Any], *args: Any) -> Any:
        # Left set when the call is cancelled: its thread, abandoned, may still use the
        # connection (`close` then leaves it alone).
        self._in_thread = True
        result = await run_sync(fn, *args)
        self._in_thread = False
        return result

    async def _write_queued(self, run_sync: RunSync, close: bool) -> None:
        """The writer task: commit everything queued, one transaction at a time, until the
        block of :meth:`writing` is left and the queue is empty; then close (``close``)."""
        since_checkpoint = 0
        while True:
            if not self._queue:
                if self._closing:
                    break
                self._queued = trio.Event()
                await self._queued.wait()
                continue
            batch = list(self._queue)
            self._queue.clear()
            self._queued_statements = 0
            self._in_flight = sum(len(group) for _, group in batch)
            errors = await self._call(run_sync, self._commit, batch)
            self._in_flight = 0
            self.commits += 1
            self.largest_batch = max(self.largest_batch, len(batch))
            for exc in errors:
                self._degrade(exc)
            self._committed = batch[-1][0]
            self._release_committed()
            since_checkpoint += 1
            if since_checkpoint >= CHECKPOINT_COMMITS:
                since_checkpoint = 0
                error = await self._call(run_sync, self._checkpoint)
                self.checkpoints += 1
                if error is not None:
                    self._degrade(error)
        if close and not self._closed:
            self._closed = True
            error = await self._call(run_sync, self._close_db)
            if error is not None:
                self._degrade(error)

    async def _watch_stalls(self, scope: trio.CancelScope) -> None:
        """Degrade the journal (stalled) when the oldest waiting callback's commit is not
        confirmed by its deadline; the callbacks then run at once. Ends when ``scope`` is
        cancelled (the writer drains)."""
        with scope:
            while True:
                if not self._gates:
                    self._gated = trio.Event()
                    await self._gated.wait()
                    continue
                ticket, deadline, _ = self._gates[0]
                await trio.sleep_until(deadline)
                if self._gates and self._gates[0][0] == ticket and self._committed < ticket:
                    self._degrade(JournalStalled(
                        f"no commit confirmed within {STALL_S:g} s: the disk is stalled"))

    # the writer's thread: no Trio, no shared state but the connection ------------------------

    def _commit(self, batch: list[tuple[int, Statements]]) -> list[BaseException]:
        """Write ``batch`` as one transaction; if that fails, each group in its own (so one
        bad group fails alone, as it did when each was written on its own). Returns the
        errors, one per failed group (the Trio thread degrades the journal with them)."""
        error = self._transaction([s for _, group in batch for s in group])
        if error is None:
            return []
        if len(batch) == 1:
            return [error]
        return [exc for _, group in batch if (exc := self._transaction(group)) is not None]

    def _transaction(self, statements: Statements) -> BaseException | None:
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
            return exc
        return None

    def _checkpoint(self) -> BaseException | None:
        try:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            return exc
        return None

    def _close_db(self) -> BaseException | None:
        try:
            self._db.close()
        except sqlite3.Error as exc:
            return exc
        return None

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
                   failure: dict[str, Any] | None) -> int | None:
        return self._write([(
            "INSERT OR REPLACE INTO records (key, seq, expires_wall, digests, rewards, failure) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (_key_text(key), self._next_seq(), expires_wall, json.dumps(list(digests)),
             json.dumps(list(rewards)), json.dumps(failure) if failure is not None else None),
        )])

    def delete_records(self, keys: Iterable[CohortKey]) -> int | None:
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
                      touched_wall: float, finished: bool = False) -> int | None:
        return self._write([(
            "INSERT OR REPLACE INTO watermarks (group_id, seq, attempt, prompt_digest, "
            "touched_wall, finished) VALUES (?, ?, ?, ?, ?, ?)",
            (group_id, self._next_seq(), attempt, prompt_digest, touched_wall, int(finished)),
        )])

    def delete_watermarks(self, group_ids: Iterable[str]) -> int | None:
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
                    score_2: float, ranking: float) -> int | None:
        return self._write([(
            "INSERT OR REPLACE INTO verdicts (key, seq, expires_wall, score_1, score_2, ranking) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (key.hex(), self._next_seq(), expires_wall, score_1, score_2, ranking),
        )])

    def delete_verdicts(self, keys: Iterable[bytes]) -> int | None:
        """Delete many verdicts in one transaction (evicted or expired together)."""
        return self._write(
            ("DELETE FROM verdicts WHERE key = ?", (key.hex(),)) for key in keys)


def _finite(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]
