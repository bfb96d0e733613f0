"""The mock judge's model of an engine's prefix cache, deterministic and cheap.

Tokenizer rule: the prompt is rendered as one text (:func:`render_prompt`: every message as
``<|ROLE|>\\n`` + content + ``\\n``, in the order the engine would see them: the conversation,
then for GenRM roles ``principle``, ``response_1``, ``response_2``), encoded as UTF-8, and every
:data:`BYTES_PER_TOKEN` bytes are one token (the last, shorter piece too). The server's routing
estimates prompt tokens by the same kind of rule (body bytes / 4).

Block hashing as vLLM's automatic prefix caching does it: the prompt's tokens are cut into
blocks of :data:`BLOCK_TOKENS`; only full blocks are cached; a block's key is a hash chained
over its parent's key and its own bytes (sha256, truncated), so a block is found only when the
whole prefix before it is the same. A call's cached tokens are its leading blocks found in the
cache (at most ``prompt_tokens - 1``: an engine always computes the last prompt token). The
cache holds ``capacity_tokens`` (whole blocks) and evicts the least recently used block, a
prompt's blocks touched last one first (so a shared prefix outlives the tails, as in vLLM);
blocks of calls still in flight are not pinned (a simplification: a real engine pins them).

One :class:`PrefixCache` per mock judge process (one engine per endpoint). Pure, no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from types import MappingProxyType

BYTES_PER_TOKEN = 4
BLOCK_TOKENS = 16
BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK_TOKENS

#: Named capacities (tokens) of ``prefix_cache_tokens`` (mock settings, ``--prefix-cache``).
#: ``small`` holds about two cohorts of 8 answers of 200 tokens over a 1,500-token history;
#: ``large`` holds everything a bench step sends.
PREFIX_CACHE_SIZES = MappingProxyType({"off": 0, "small": 16_384, "large": 1_048_576})

#: The largest capacity the model accepts (tokens).
MAX_PREFIX_CACHE_TOKENS = 2**30


def parse_capacity(value: str) -> int:
    """A capacity as the mock's ``--prefix-cache`` and the economy preset's ``cache`` take it:
    ``off``, ``small``, ``large`` or a whole number of tokens in 0..:data:`MAX_PREFIX_CACHE_TOKENS`
    (digits only). Raises ``ValueError`` saying what is accepted. Pure."""
    text = value.strip()
    if text in PREFIX_CACHE_SIZES:
        return PREFIX_CACHE_SIZES[text]
    if not text.isdigit() or int(text) > MAX_PREFIX_CACHE_TOKENS:
        raise ValueError(f"must be off, small, large or a token count in "
                         f"0..{MAX_PREFIX_CACHE_TOKENS}, got {value!r}")
    return int(text)


def render_prompt(messages: Iterable[tuple[str, str]]) -> bytes:
    """The prompt the engine would tokenize: ``<|ROLE|>\\nCONTENT\\n`` per message, UTF-8."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    return "".join(parts).encode("utf-8", "surrogatepass")


def prompt_tokens(prompt: bytes) -> int:
    """Tokens of a rendered prompt: one per :data:`BYTES_PER_TOKEN` bytes, rounded up."""
    return -(-len(prompt) // BYTES_PER_TOKEN)


def block_keys(prompt: bytes) -> list[bytes]:
    """The chained keys of the prompt's full blocks, first block first."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(prompt) - BLOCK_BYTES + 1, BLOCK_BYTES):
        parent = hashlib.sha256(parent + prompt[start:start + BLOCK_BYTES]).digest()[:16]
        keys.append(parent)
    return keys


class PrefixCache:
    """Cached blocks in least-recently-used order; ``capacity_tokens`` 0 caches nothing.

    :meth:`lookup` is what an engine does when it schedules a call (find the cached prefix),
    :meth:`insert` what it does once the call's prefill is computed (its blocks become
    reusable). Counters: ``evicted_blocks``.
    """

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens!r}")
        self.capacity_blocks = capacity_tokens // BLOCK_TOKENS
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, keys: list[bytes], tokens: int) -> int:
        """Cached tokens of a prompt of ``tokens`` tokens whose full blocks are ``keys``: its
        leading blocks in the cache (those are touched), at most ``tokens - 1``."""
        hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            hits += 1
        for key in reversed(keys[:hits]):
            self._blocks.move_to_end(key)
        return max(0, min(hits * BLOCK_TOKENS, tokens - 1))

    def insert(self, keys: list[bytes]) -> None:
        """Keep every block of a computed prompt (most recently used), evicting the oldest."""
        if self.capacity_blocks == 0:
            return
        for key in reversed(keys):  # a prefix's first block is evicted last, as vLLM does
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
            self.evicted_blocks += 1

    def clear(self) -> None:
        self._blocks.clear()
