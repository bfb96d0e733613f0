"""Verdict reuse: the verdicts the judge returned, kept by content key for later cohorts.

A verdict that parsed (never the default verdict: a comparison whose answers never parsed is
not kept; a truncated answer is no verdict at all) is kept under
:func:`genrm_trio.identity.verdict_key`: the judge configuration's fingerprint, the judge pass,
the principle, the conversation and both answers in order, within a scope
(:func:`genrm_trio.identity.verdict_scope`): ``verdict_reuse: group`` keeps a verdict for the
attempts and retries of the same group key, ``global`` for any cohort. ``off`` builds no
cache at all: every comparison is judged, NeMo Gym's call pattern.

A reused verdict is the same sample, not a new one: a replacement attempt of a group scores an
unchanged pair with the verdict its earlier attempt drew, so its rewards equal a fresh cohort's
given the same verdicts, and resampling a group with reuse does not re-draw the judge's noise.

Bounds: ``verdict_cache_max_entries`` entries, oldest first out, each expiring
``cohort_result_ttl_s`` after it was judged (the records' TTL). Entries live in an
insertion-ordered dict pruned from the old end, O(1) amortised, like the registry's records.
With a journal (``state_dir``) every kept verdict is written as it arrives and every eviction
deleted, so reuse survives a restart; reloaded rows are validated (server/journal.py).

Owned by the cohort registry; synchronous, no I/O besides the journal's (and reading the
``plain`` prompt's template file once, at construction).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any

from genrm_trio import identity, judge_prompt
from genrm_trio.config import Config, read_prompt_template
from genrm_trio.scoring import Verdict
from genrm_trio.server.journal import Journal

#: Integral verdict values (most judges give whole scores): one shared float object each, so a
#: kept entry holds no float of its own for them (memory: README, "Verdict reuse").
_WHOLE = tuple(float(i) for i in range(7))


def _shared(value: float) -> float:
    return _WHOLE[int(value)] if value.is_integer() and 0.0 <= value <= 6.0 else value


def _template(cfg: Config) -> judge_prompt.PlainPrompt | None:
    if cfg.judge.prompt != "plain":
        return None
    if cfg.judge.prompt_template_file:
        return read_prompt_template(cfg.judge.prompt_template_file)
    return judge_prompt.DEFAULT_PROMPT


class VerdictCache:
    """Kept verdicts by key, for one registry. Build it only when ``verdict_reuse`` is not
    ``off``. ``journal`` (optional, owned by the caller) mirrors every insert and eviction;
    call :meth:`reload` once at start to read it back."""

    __slots__ = ("mode", "cap", "ttl_s", "fingerprint", "_entries", "_journal")

    def __init__(self, cfg: Config, journal: Journal | None = None) -> None:
        self.mode = cfg.verdict_reuse
        self.cap = cfg.verdict_cache_max_entries
        self.ttl_s = cfg.cohort_result_ttl_s
        self.fingerprint = identity.judge_fingerprint(cfg, _template(cfg))
        # key -> (expires_at on trio's clock, score_1, score_2, ranking), oldest first: one
        # tuple per entry, the Verdict is built on a hit.
        self._entries: OrderedDict[bytes, tuple[float, float, float, float]] = OrderedDict()
        self._journal = journal

    def __len__(self) -> int:
        return len(self._entries)

    def prefix(self, key: identity.CohortKey, principle: str | None, history: Any) -> bytes:
        """What every verdict key of the cohort ``key`` starts with (build once per cohort)."""
        return identity.verdict_prefix(identity.verdict_scope(self.mode, key), self.fingerprint,
                                       principle, history)

    def get(self, key: bytes, now: float) -> Verdict | None:
        """The kept verdict for ``key``, or None (never kept, evicted or expired)."""
        entry = self._entries.get(key)
        if entry is None or entry[0] <= now:
            return None
        return Verdict(entry[1], entry[2], entry[3])

    def put(self, key: bytes, verdict: Verdict, now: float) -> bool:
        """Keep ``verdict`` (a parsed one: a defaulted verdict is refused) unless ``key`` is
        already kept: the first verdict of a pair stands, so every cohort that reuses it scores
        the same sample. The journal row is written before memory changes (a failed write
        degrades the journal; memory stays the truth). Returns whether it was kept."""
        if verdict.defaulted or key in self._entries:
            return False
        ttl = self.ttl_s
        if self._journal is not None:
            self._journal.put_verdict(key, None if ttl is None else time.time() + ttl,
                                      verdict.score_1, verdict.score_2, verdict.ranking)
        self._keep(key, math.inf if ttl is None else now + ttl, verdict.score_1,
                   verdict.score_2, verdict.ranking)
        self.prune(now)
        return True

    def prune(self, now: float) -> None:
        """Evict over-cap and expired entries from the old end; one journal transaction."""
        entries = self._entries
        evicted: list[bytes] = []
        while entries:
            key, (expires_at, *_) = next(iter(entries.items()))
            if len(entries) > self.cap or expires_at <= now:
                del entries[key]
                evicted.append(key)
            else:
                break
        if evicted and self._journal is not None:
            self._journal.delete_verdicts(evicted)

    def reload(self, journal: Journal, default_score: float, default_ranking: float,
               now: float) -> int:
        """Read the journal's valid verdict rows back (wall-clock expiries moved onto trio's
        clock), then prune. Returns how many are kept."""
        wall = time.time()
        for stored in journal.verdicts(default_score, default_ranking):
            expires_at = (math.inf if stored.expires_wall is None
                          else now + (stored.expires_wall - wall))
            self._keep(stored.key, expires_at, stored.score_1, stored.score_2, stored.ranking)
        self.prune(now)
        return len(self._entries)

    def _keep(self, key: bytes, expires_at: float, score_1: float, score_2: float,
              ranking: float) -> None:
        self._entries[key] = (expires_at, _shared(score_1), _shared(score_2), _shared(ranking))

    def status(self) -> dict[str, Any]:
        """For ``/status``: the mode, how many verdicts are kept, the cap and the TTL."""
        return {"mode": self.mode, "entries": len(self._entries), "cap": self.cap,
                "ttl_s": self.ttl_s}
