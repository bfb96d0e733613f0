"""The judge client: one comparison in, one :class:`~genrm_trio.scoring.Verdict` out.

Its files show its parts, top down::

    retry.py            Judge.judge_pair(request): retry budget, backoff, parsing, default
        |               verdict, stats; open_judge() picks the backend and owns its lifetime
        |  per attempt: global OrderedLimiter(judge_max_concurrency, judge_order)
        v
    backends.py         Backend.call(request) -> text: one attempt under the per-request
        |               deadline; PluginBackend ("module:function", trio or asyncio via _aio),
        |               BuiltinBackend (scoring.heuristic_judge_text, no network)
        +-- http_backend.py   HttpBackend: body, endpoint, one POST, classification
              bodies.py         request bodies per API (responses, chat)
              answers.py        answer text out of each API's JSON answer
              retry_after.py    the judge's Retry-After hint
              endpoints.py      endpoint choice (least_loaded, cohort_affinity) and cool-down
              transport.py      what a transport is; two of them:
                h11_pool.py       trio + h11 keep-alive pool (default; the only h11 user)
                httpx_transport.py  httpx2 client shards (the only httpx2 user)
    attempt.py          JudgeRequest, AttemptFailed (retried), AttemptFatal (not retried)
    order.py            OrderedLimiter: which waiting comparison gets the next free slot

A backend attempt either returns the answer text or raises :class:`AttemptFailed`
(transient: retried within the budget) or :class:`AttemptFatal` (not retried). Third-party
errors (``httpx2``, ``h11``, plugin exceptions) are translated into those two at the boundary
of the file that owns the library. Every message that leaves the judge passes through one
redaction step that removes the api key, and URLs are shown without user info.
"""

from genrm_trio.server.judge.answers import chat_answer, responses_answer
from genrm_trio.server.judge.attempt import AttemptFailed, AttemptFatal, JudgeRequest
from genrm_trio.server.judge.backends import PluginFn, load_plugin
from genrm_trio.server.judge.bodies import base_params, chat_body, responses_body
from genrm_trio.server.judge.endpoints import Affinity, Crowd
from genrm_trio.server.judge.h11_pool import H11Pool
from genrm_trio.server.judge.order import JUDGE_ORDERS, GroupProgress, JudgeOrder, OrderedLimiter
from genrm_trio.server.judge.retry import CLOSE_BOUND_S, Judge, JudgeStats, open_judge
from genrm_trio.server.judge.retry_after import MAX_HINT_S, parse_retry_after

__all__ = [
    "Affinity",
    "Crowd",
    "CLOSE_BOUND_S",
    "MAX_HINT_S",
    "AttemptFailed",
    "AttemptFatal",
    "GroupProgress",
    "H11Pool",
    "JUDGE_ORDERS",
    "Judge",
    "JudgeOrder",
    "JudgeRequest",
    "JudgeStats",
    "OrderedLimiter",
    "PluginFn",
    "base_params",
    "chat_answer",
    "chat_body",
    "load_plugin",
    "open_judge",
    "parse_retry_after",
    "responses_answer",
    "responses_body",
]
