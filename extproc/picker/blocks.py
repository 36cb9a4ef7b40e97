"""Chained block hashes of the canonical prompt: the prefix index's keys.

The prompt (as ``keys.extract_key`` renders it) is cut into fixed-size blocks of bytes,
and block ``i``'s hash is xxh3 of its bytes seeded with block ``i - 1``'s hash, so one
hash names the whole prefix up to the end of its block. The chain's seed mixes in the
model (or LoRA adapter) and the tenant salt, so equal prompts of two tenants or two
adapters never share an entry. Boundaries fall every ``block_bytes`` bytes from the
start, whatever follows: turn k+1 of a conversation, which resends turn k, shares every
full block of turn k. A trailing partial block has no hash of its own.

Pure: bytes in, integers out.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

import xxhash

_hash = xxhash.xxh3_64_intdigest
# Mixed into the seed of a whole-prompt hash, so it never equals a block's hash.
_WHOLE = 0x9E3779B97F4A7C15


def chain_seed(model: str | None, salt: str | None) -> int:
    """The seed of a prompt's chain: what must match before any text can."""
    if model is None and salt is None:
        return 0
    # A separator no model name or (printable ASCII) salt contains keeps the pair apart.
    return _hash(f"{model or ''}\x00{salt or ''}".encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt as the prefix index sees it."""

    seed: int
    # Chained hashes of the full blocks, first block first.
    hashes: tuple[int, ...]
    block_bytes: int
    # The (capped) prompt itself, and the byte offsets where its messages end.
    key: bytes
    segments: tuple[int, ...] = ()
    # A hash of the whole (capped) prompt, partial last block included.
    whole: int = 0

    @property
    def counted(self) -> tuple[int, ...]:
        """What popularity counts: every block, then the whole prompt, so that a prompt
        repeated as it is can be told from a prefix continued in many ways."""
        return (*self.hashes, self.whole)

    @property
    def depth(self) -> int:
        return len(self.hashes)

    @property
    def length(self) -> int:
        """Bytes of the (capped) prompt, partial tail included."""
        return len(self.key)

    def prefix_hash(self, depth: int) -> int:
        """The hash naming the first ``depth`` blocks (the seed for depth 0)."""
        return self.hashes[depth - 1] if depth else self.seed

    def anchor(self, depth: int) -> int:
        """A hash of what follows the first ``depth`` blocks that every prompt continuing
        this one shares: what a new prefix is placed by.

        If the message that continues past those blocks has a whole block left, that
        block's hash: a document names itself with its first block past a shared preamble.
        Otherwise the rest of that message is too short to tell prompts apart (the tail of
        a shared system prompt), so the anchor runs to the end of the next message: the
        first user turn names a conversation, in every later turn too.
        """
        start = depth * self.block_bytes
        length = len(self.key)
        ends = [end for end in self.segments if end > start]
        end = ends[0] if ends else length
        if end - start >= self.block_bytes:
            return self.hashes[depth]
        stop = ends[1] if len(ends) > 1 else length
        return _hash(self.key[start:stop], self.prefix_hash(depth))

    def anchors(self) -> list[int]:
        """``anchor(depth)`` for every depth from 0 to ``depth``, in one pass."""
        block, key, segments, hashes = self.block_bytes, self.key, self.segments, self.hashes
        length = len(key)
        result = []
        at = 0  # segments[at] is the first message end past the depth's start
        for depth in range(len(hashes) + 1):
            start = depth * block
            while at < len(segments) and segments[at] <= start:
                at += 1
            end = segments[at] if at < len(segments) else length
            if end - start >= block:
                result.append(hashes[depth])
                continue
            stop = segments[at + 1] if at + 1 < len(segments) else length
            result.append(_hash(key[start:stop], self.prefix_hash(depth)))
        return result


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """What the prefix index knows of one prompt: the matched depth (in blocks) on each
    host that holds any of it."""

    blocks: PromptBlocks
    matched: Mapping[str, int]

    def depth_on(self, host: str) -> int:
        return self.matched.get(host, 0)


def chain_hashes(data: bytes, block_bytes: int, seed: int) -> tuple[int, ...]:
    """The chained hashes of the full blocks of ``data`` from ``seed``; a trailing partial
    block has none. The one definition of the chain: ``prompt_blocks`` cuts a request's
    key with it, and ``events.mirror`` an engine's decoded blocks, so the two agree."""
    hashes = []
    previous = seed
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        previous = _hash(data[start : start + block_bytes], previous)
        hashes.append(previous)
    return tuple(hashes)


def prompt_blocks(
    key: bytes, block_bytes: int, seed: int, segments: tuple[int, ...] = ()
) -> PromptBlocks:
    """Cut ``key`` into blocks of ``block_bytes`` and chain their hashes from ``seed``."""
    hashes = chain_hashes(key, block_bytes, seed)
    previous = hashes[-1] if hashes else seed
    whole = _hash(key[len(hashes) * block_bytes :], previous ^ _WHOLE)
    return PromptBlocks(seed, hashes, block_bytes, key, segments, whole)


def held_depth(held: Container[int], hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` of a chain are in ``held``, a set closed under prefixes
    (if block k of a chain is held, so are blocks 0..k-1): a binary search, about
    log2(depth) lookups instead of a walk down the chain."""
    if not hashes or hashes[0] not in held:
        return 0
    if hashes[-1] in held:
        return len(hashes)
    low, high = 1, len(hashes) - 1  # hashes[low - 1] is held, hashes[high] is not
    while low < high:
        middle = (low + high) // 2
        if hashes[middle] in held:
            low = middle + 1
        else:
            high = middle
    return low
