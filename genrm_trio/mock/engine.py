"""The mock judge's batched engine: one compute shared by every call, as a serving engine has.

``engine: per_call`` (the default) times each call on its own: ``prompt_token_s`` per computed
prompt token then ``output_token_s`` per output token, so calls running together never slow
each other. That is a pool of independent servers, not an engine: on a real one (vLLM, SGLang,
llama.cpp with slots) the calls that run together share one forward pass per step, so their
prefills compete for the same compute while their decoding is batched. Measured here on two
llama.cpp servers of 4 slots each (bench/README.md, "Judge economy"), least_loaded's duplicate
prefills cost it as much wall time as with one slot.

``engine: batched`` (:class:`BatchedEngine`) models continuous batching (iteration-level
scheduling, as vLLM v1's scheduler does it): the engine runs steps; a call joins the running
batch at the next step, finding its cached prefix then (:meth:`PrefixCache.lookup`); each step
every decoding call computes one token and every call still prefilling up to what is left of a
per-step token budget (``engine_step_tokens``, vLLM's ``max_num_batched_tokens``; chunked
prefill, in the order the calls came). The full blocks a call computes in a step enter the
cache when the step is planned, as vLLM registers a block when it schedules it, so a call that
joins in the same step or later finds them: within one engine a shared prefix is computed once
even by calls that arrive together (unless the cache evicted it). A step costs
``output_token_s`` (the forward pass itself: reading the weights, whatever the batch) plus
``prompt_token_s`` per prompt token computed in it. The step that finishes a call's prefill
yields its first output token; a call leaves the batch after its last output token. So
decoding costs a step per token however many calls decode together, and prefill is paid in
the shared steps. The batch holds at most ``capacity`` calls (the mock's limiter).
Deterministic: the order calls join is the only input besides the settings.

The engine's loop is one task, owned by :func:`genrm_trio.mock.judge.run_mock_judge`'s nursery;
a call waits in :meth:`BatchedEngine.serve` and, if cancelled (its client went away), leaves the
batch at the next step. Pure trio, no I/O.
"""

from __future__ import annotations

import trio

from genrm_trio.mock.prefix_cache import BLOCK_TOKENS, PrefixCache

#: The mock judge's time models (``engine`` setting; the economy preset's ``engine``).
ENGINE_KINDS = ("per_call", "batched")


class _Call:
    __slots__ = ("keys", "tokens", "decode_left", "prefill_left", "cached", "done", "gone")

    def __init__(self, keys: list[bytes], tokens: int, decode_tokens: int) -> None:
        self.keys = keys
        self.tokens = tokens
        self.decode_left = max(1, decode_tokens)
        self.prefill_left = -1  # set when the call joins the batch
        self.cached = 0
        self.done = trio.Event()
        self.gone = False


class BatchedEngine:
    """Continuous batching over one :class:`PrefixCache` (module docstring). ``batch_peak``:
    the most calls one step has run."""

    def __init__(self, cache: PrefixCache, prompt_token_s: float, output_token_s: float,
                 step_tokens: int) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens!r}")
        self.cache = cache
        self.prompt_token_s = prompt_token_s
        self.output_token_s = output_token_s
        self.step_tokens = step_tokens
        self._joining: list[_Call] = []
        self._running: list[_Call] = []
        self._wake = trio.Event()
        self.batch_peak = 0

    @property
    def running(self) -> int:
        """Calls in the batch now (joined, not yet done, not gone)."""
        return sum(1 for c in self._running if not c.gone)

    async def serve(self, keys: list[bytes], tokens: int, decode_tokens: int) -> int:
        """Run one call through the engine: prefill its ``tokens`` prompt tokens (full blocks
        ``keys``) less what the cache holds, then ``decode_tokens`` output tokens. Returns the
        cached prompt tokens. Cancellation takes the call out of the batch."""
        call = _Call(keys, tokens, decode_tokens)
        self._joining.append(call)
        self._wake.set()
        try:
            await call.done.wait()
        except BaseException:
            call.gone = True
            raise
        return call.cached

    async def run(self) -> None:
        """The engine's step loop; runs until cancelled (the mock judge's nursery owns it)."""
        while True:
            if not self._joining and not self._running:
                self._wake = trio.Event()
                await self._wake.wait()
            taken = self._plan()
            if not self._running:
                continue
            seconds = self.output_token_s + sum(taken.values()) * self.prompt_token_s
            self.batch_peak = max(self.batch_peak, len(self._running))
            await trio.sleep(seconds)
            self._advance(taken)

    def _plan(self) -> dict[_Call, int]:
        """This step's prompt tokens per prefilling call, as vLLM's scheduler plans a step:
        running decodes first (a token of the budget each), then running prefills, then the
        calls that join, each in the order it came. A joining call finds its cached prefix now,
        and every call registers the full blocks it computes in this step as it is planned
        (vLLM caches a block when it is scheduled: its key is the tokens, and the forward pass
        writes each layer's KV before attending), so a call planned after another in the same
        step finds what that one computes."""
        budget = self.step_tokens - sum(1 for c in self._running if c.prefill_left == 0)
        taken: dict[_Call, int] = {}

        def take(call: _Call) -> None:
            nonlocal budget
            if call.prefill_left > 0 and budget > 0:
                tokens = min(call.prefill_left, budget)
                taken[call] = tokens
                budget -= tokens
                done = call.tokens - call.prefill_left + tokens
                self.cache.insert(call.keys[:done // BLOCK_TOKENS])

        for call in self._running:
            take(call)
        for call in self._joining:
            if call.gone:
                continue
            call.cached = self.cache.lookup(call.keys, call.tokens)
            call.prefill_left = call.tokens - call.cached
            self._running.append(call)
            take(call)
        self._joining.clear()
        return taken

    def _advance(self, taken: dict[_Call, int]) -> None:
        still: list[_Call] = []
        for call in self._running:
            if call.gone:
                continue
            if call.prefill_left == 0:
                call.decode_left -= 1
            elif call in taken:
                call.prefill_left -= taken[call]
                if call.prefill_left == 0:  # the prefill's last step yields the first token
                    call.decode_left -= 1
            if call.prefill_left == 0 and call.decode_left <= 0:
                call.done.set()
            else:
                still.append(call)
        self._running = still
