"""Block-level prefix cache that mimics vLLM's automatic prefix caching.

Pure: no I/O and no clock. Recency is the order of calls, nothing else.

Two ways to use it. `lookup_and_insert` is the fixed-timing simulator's: a request's
blocks are cached at once and never held. The engine model (`engine.py`) instead
`acquire`s a running request's blocks, which pins them, and `release`s them when it
ends; only unreferenced blocks are ever evicted, as in vLLM's block pool.

A `CacheListener`, when given, hears what vLLM's block pool queues as KV-cache events: a
block cached for the first time, an eviction, a reset. Blocks already cached and touched
again are not reported (vLLM stores nothing for a hit). The methods that take hashes
also take the text they were hashed from (``text``, block ``i`` being its ``i``-th
``block_chars`` characters) and the request's ``salt``, for the listener's sake only:
without a listener they are unused, and the hot path pays one ``is None`` test.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from extproc.picker.blocks import held_depth

# Seed of the hash chain: the "previous block hash" of the first block.
_ROOT_HASH = 0
# Between a chain's first block and its salt in the hashed bytes: 0xFF never occurs in
# UTF-8, so no (block, salt) pair hashes the bytes of another.
_SALT_SEPARATOR = b"\xff"


@dataclass(frozen=True)
class CacheResult:
    """Outcome of one prompt's lookup, in (approximate) tokens."""

    query_tokens: int
    hit_tokens: int


class CacheListener(Protocol):
    """Hears a `PrefixCache`'s changes, as vLLM's block pool queues KV-cache events.

    Called synchronously from inside the cache's methods, in the order the changes happen;
    it must not call back into the cache."""

    def stored(
        self, hashes: Sequence[int], parent: int | None, text: str, salt: str | None
    ) -> None:
        """`hashes`, consecutive blocks of one chain, were cached for the first time.

        `parent` is the block before the first of them, None when that is the chain's first
        block; `text` their characters, ``block_chars`` per block (empty when the caller
        gave no text); `salt` the ``cache_salt`` that entered the first block's hash, given
        only when `parent` is None."""

    def removed(self, hashes: Sequence[int]) -> None:
        """`hashes` left the cache: evicted, or dropped by a reset that spared held blocks."""

    def cleared(self) -> None:
        """Every block left the cache (``clear_unreferenced`` with no block held)."""


def _require_positive_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a capacity is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class PrefixCache:
    """LRU set of full blocks, each identified by the hash of its whole prefix.

    A block's hash covers the previous block's hash and its own text, so a
    block can only match when everything before it matches too, as in vLLM.
    """

    def __init__(
        self,
        capacity_blocks: int,
        block_size_tokens: int = 16,
        chars_per_token: int = 4,
        listener: CacheListener | None = None,
    ) -> None:
        self._capacity_blocks = _require_positive_int("capacity_blocks", capacity_blocks)
        self._block_size_tokens = _require_positive_int("block_size_tokens", block_size_tokens)
        self._chars_per_token = _require_positive_int("chars_per_token", chars_per_token)
        self._block_chars = block_size_tokens * chars_per_token
        # Cached blocks no request holds: the eviction candidates, oldest first. The
        # values are unused, the dict is an ordered set.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Cached blocks running requests hold, with how many hold each.
        self._referenced: dict[int, int] = {}
        # Unhashed blocks running requests hold: a prompt's partial last block and the
        # room for its output. Never shared, never cached.
        self._private_blocks = 0
        self._listener = listener

    @property
    def capacity_blocks(self) -> int:
        return self._capacity_blocks

    @property
    def block_size_tokens(self) -> int:
        return self._block_size_tokens

    @property
    def chars_per_token(self) -> int:
        return self._chars_per_token

    @property
    def block_chars(self) -> int:
        """Characters per block: ``block_size_tokens * chars_per_token``."""
        return self._block_chars

    @property
    def blocks_used(self) -> int:
        """Every block in the cache, held or not."""
        return len(self._evictable) + self.blocks_referenced

    @property
    def blocks_referenced(self) -> int:
        """Blocks held by running requests; vLLM's KV usage counts only these."""
        return len(self._referenced) + self._private_blocks

    def __len__(self) -> int:
        return self.blocks_used

    def __contains__(self, block_hash: object) -> bool:
        """Whether the block `block_hash` is cached, held or not."""
        return block_hash in self._evictable or block_hash in self._referenced

    def query_tokens(self, text: str) -> int:
        """Approximate token count of `text` (a partial token counts as one)."""
        return -(-len(text) // self._chars_per_token)

    def block_hashes(self, text: str, salt: str | None = None) -> list[int]:
        """Chained hashes of the full blocks of `text`; a trailing partial block has none.

        A `salt` (vLLM's ``cache_salt``) enters the first block's hash, as vLLM adds it to
        that block's extra keys, and through the chain every later one: requests share
        cached blocks only when their salts match. An empty salt is no salt, as in vLLM."""
        hashes: list[int] = []
        previous = _ROOT_HASH
        chars = self._block_chars
        first = 0
        if salt and len(text) >= chars:
            # surrogatepass: JSON can carry lone surrogates, which strict UTF-8 rejects.
            data = previous.to_bytes(8, "little") + text[:chars].encode("utf-8", "surrogatepass")
            data += _SALT_SEPARATOR + salt.encode("utf-8", "surrogatepass")
            previous = xxhash.xxh3_64_intdigest(data)
            hashes.append(previous)
            first = chars
        for start in range(first, len(text) - chars + 1, chars):
            chunk = text[start : start + chars]
            data = previous.to_bytes(8, "little") + chunk.encode("utf-8", "surrogatepass")
            previous = xxhash.xxh3_64_intdigest(data)
            hashes.append(previous)
        return hashes

    def lookup_and_insert(self, text: str, salt: str | None = None) -> CacheResult:
        """Count the cached leading blocks of `text`, then cache all its full blocks."""
        hit_blocks = self.touch(self.block_hashes(text, salt), text, salt)
        return CacheResult(
            query_tokens=self.query_tokens(text),
            hit_tokens=hit_blocks * self._block_size_tokens,
        )

    def touch(self, hashes: Sequence[int], text: str = "", salt: str | None = None) -> int:
        """``cached_prefix_blocks`` of `hashes`, then ``insert`` them; returns the former.

        With no block referenced (the fixed-timing simulator, a replay), the cached blocks
        of any chain form a prefix of it (every insert touches a block's ancestors after
        the block itself, so a parent is never older than its child), so the count is a
        binary search, and only the cached blocks need moving; the new ones are appended
        in one call."""
        if self._referenced:
            hit = self.cached_prefix_blocks(hashes)
            self.insert(hashes, text, salt)
            return hit
        evictable = self._evictable
        hit = held_depth(evictable, hashes)
        if hit < len(hashes):
            evictable.update(dict.fromkeys(reversed(hashes[hit:])))
            if self._listener is not None:
                # The cached blocks being a prefix, the rest are all new.
                self._report_stored(hashes, range(hit, len(hashes)), text, salt)
        move = evictable.move_to_end
        for block_hash in reversed(hashes[:hit]):
            move(block_hash)
        self._evict_to_capacity()
        return hit

    def insert(self, hashes: Sequence[int], text: str = "", salt: str | None = None) -> None:
        """Cache the blocks `hashes` unreferenced (most recent: the first of them)."""
        new = self._new_blocks(hashes) if self._listener is not None else ()
        # Touch the tail first so the head ends up most recent: eviction then
        # takes a prompt's deepest blocks first and never strands a child
        # block whose parent is gone (vLLM frees blocks in that order too).
        for block_hash in reversed(hashes):
            if block_hash not in self._referenced:
                self._evictable[block_hash] = None
                self._evictable.move_to_end(block_hash)
        if new:
            self._report_stored(hashes, new, text, salt)
        self._evict_to_capacity()

    def sequence_text(self, prompt: str, output: str) -> str:
        """What a finished request has computed KV for: its prompt and its output, but for
        the last output token, which the engine samples and never computes KV for."""
        return prompt + output[: max(0, len(output) - self._chars_per_token)]

    def sequence_hashes(self, prompt: str, output: str, salt: str | None = None) -> list[int]:
        """The full blocks a finished request leaves cached: those of ``sequence_text``."""
        return self.block_hashes(self.sequence_text(prompt, output), salt)

    def insert_output(self, prompt: str, output: str, salt: str | None = None) -> None:
        """Cache what generating ``output`` after ``prompt`` computed (as vLLM caches the
        blocks of generated tokens, so the next turn of a conversation hits them)."""
        text = self.sequence_text(prompt, output)
        self.insert(self.block_hashes(text, salt), text, salt)

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached; changes nothing."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._evictable and block_hash not in self._referenced:
                break
            count += 1
        return count

    def acquire(
        self, hashes: Sequence[int], private_blocks: int, text: str = "", salt: str | None = None
    ) -> bool:
        """Hold the blocks `hashes` (cached or new) plus `private_blocks` unshared ones.

        Returns False, changing nothing, when they cannot fit even after evicting every
        unreferenced block. New hashed blocks become visible to later lookups at once,
        as vLLM V1 registers a step's blocks when it schedules them.
        """
        newly_held = {h for h in hashes if h not in self._referenced}
        held_after = self.blocks_referenced + len(newly_held) + private_blocks
        if private_blocks < 0 or held_after > self._capacity_blocks:
            return False
        new = self._new_blocks(hashes) if self._listener is not None else ()
        for block_hash in hashes:
            self._evictable.pop(block_hash, None)
            self._referenced[block_hash] = self._referenced.get(block_hash, 0) + 1
        self._private_blocks += private_blocks
        if new:
            self._report_stored(hashes, new, text, salt)
        self._evict_to_capacity()
        return True

    def release(
        self,
        hashes: Sequence[int],
        private_blocks: int,
        computed: Sequence[int] = (),
        text: str = "",
        salt: str | None = None,
    ) -> None:
        """Drop one hold on `hashes` and free `private_blocks`; the hashed blocks stay cached,
        and so do the blocks `computed` beyond them (the output's full blocks). `text`
        covers both: `computed`'s first block is its block ``len(hashes)``."""
        chain: Sequence[int] = ()
        new: Sequence[int] = ()
        if self._listener is not None and computed:
            chain = [*hashes, *computed]
            new = self._new_blocks(chain, start=len(hashes))
        self._private_blocks -= private_blocks
        # Tail first, so the prompt's head is the most recent and is evicted last.
        for block_hash in reversed(computed):
            if block_hash not in self._referenced:
                self._evictable[block_hash] = None
                self._evictable.move_to_end(block_hash)
        for block_hash in reversed(hashes):
            holders = self._referenced[block_hash] - 1
            if holders:
                self._referenced[block_hash] = holders
            else:
                del self._referenced[block_hash]
                self._evictable[block_hash] = None
                self._evictable.move_to_end(block_hash)
        if new:
            self._report_stored(chain, new, text, salt)
        self._evict_to_capacity()

    def clear_unreferenced(self) -> int:
        """Forget every block no request holds (vLLM's reset_prefix_cache); returns how many.

        The listener hears ``cleared`` when no block was held, as vLLM, whose reset only
        succeeds then; vLLM refuses a reset while blocks are held, this cache drops the
        unheld ones anyway and reports them ``removed``."""
        dropped = list(self._evictable)
        self._evictable.clear()
        if self._listener is not None:
            if self._referenced or self._private_blocks:
                if dropped:
                    self._listener.removed(dropped)
            else:
                self._listener.cleared()
        return len(dropped)

    def _new_blocks(self, hashes: Sequence[int], start: int = 0) -> list[int]:
        """Indices (from `start` on) of the blocks of `hashes` not cached yet."""
        evictable, referenced = self._evictable, self._referenced
        return [
            index
            for index in range(start, len(hashes))
            if hashes[index] not in evictable and hashes[index] not in referenced
        ]

    def _report_stored(
        self, chain: Sequence[int], new: Sequence[int], text: str, salt: str | None
    ) -> None:
        """Tell the listener of the blocks `chain[i]` for i in `new` (ascending): one call
        per run of consecutive indices, as vLLM sends one BlockStored per run."""
        listener = self._listener
        assert listener is not None
        chars = self._block_chars
        run_start = new[0]
        for position, index in enumerate(new):
            last = position + 1 == len(new)
            if last or new[position + 1] != index + 1:
                parent = chain[run_start - 1] if run_start else None
                listener.stored(
                    chain[run_start : index + 1],
                    parent,
                    text[run_start * chars : (index + 1) * chars],
                    None if run_start else salt,
                )
                if not last:
                    run_start = new[position + 1]

    def _evict_to_capacity(self) -> None:
        # Bounded: each pass removes one evictable block.
        evictable = self._evictable
        excess = self.blocks_used - self._capacity_blocks
        if excess <= 0:
            return
        pop = evictable.popitem
        if self._listener is None:
            while excess > 0 and evictable:
                pop(last=False)
                excess -= 1
            return
        evicted: list[int] = []
        while excess > 0 and evictable:
            evicted.append(pop(last=False)[0])
            excess -= 1
        if evicted:
            self._listener.removed(evicted)
