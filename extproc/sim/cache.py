"""Block-level prefix cache that mimics vLLM's automatic prefix caching.

Pure: no I/O and no clock. Recency is the order of calls, nothing else.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import xxhash

# Seed of the hash chain: the "previous block hash" of the first block.
_ROOT_HASH = 0


@dataclass(frozen=True)
class CacheResult:
    """Outcome of one prompt's lookup, in (approximate) tokens."""

    query_tokens: int
    hit_tokens: int


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
    ) -> None:
        self._capacity_blocks = _require_positive_int("capacity_blocks", capacity_blocks)
        self._block_size_tokens = _require_positive_int("block_size_tokens", block_size_tokens)
        self._chars_per_token = _require_positive_int("chars_per_token", chars_per_token)
        self._block_chars = block_size_tokens * chars_per_token
        # Oldest first; the values are unused, the dict is an ordered set.
        self._blocks: OrderedDict[int, None] = OrderedDict()

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
    def blocks_used(self) -> int:
        return len(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def query_tokens(self, text: str) -> int:
        """Approximate token count of `text` (a partial token counts as one)."""
        return -(-len(text) // self._chars_per_token)

    def block_hashes(self, text: str) -> list[int]:
        """Chained hashes of the full blocks of `text`; a trailing partial block has none."""
        hashes: list[int] = []
        previous = _ROOT_HASH
        for start in range(0, len(text) - self._block_chars + 1, self._block_chars):
            chunk = text[start : start + self._block_chars]
            # surrogatepass: JSON can carry lone surrogates, which strict UTF-8 rejects.
            data = previous.to_bytes(8, "little") + chunk.encode("utf-8", "surrogatepass")
            previous = xxhash.xxh3_64_intdigest(data)
            hashes.append(previous)
        return hashes

    def lookup_and_insert(self, text: str) -> CacheResult:
        """Count the cached leading blocks of `text`, then cache all its full blocks."""
        hashes = self.block_hashes(text)
        hit_blocks = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            hit_blocks += 1

        # Touch the tail first so the head ends up most recent: eviction then
        # takes a prompt's deepest blocks first and never strands a child
        # block whose parent is gone (vLLM frees blocks in that order too).
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self._capacity_blocks:
            self._blocks.popitem(last=False)

        return CacheResult(
            query_tokens=self.query_tokens(text),
            hit_tokens=hit_blocks * self._block_size_tokens,
        )
