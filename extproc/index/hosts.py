"""Per-host LRU sets of prompt blocks: what each engine's prefix cache should still hold.

Every block a request carries is touched when the request is routed, its last block first
and its first block last. So within a host the first blocks of a prompt are always at
least as recent as its later ones, eviction takes a prompt's deepest blocks first, and the
set a host holds is closed under prefixes: if block k of a chain is there, blocks 0..k-1
are too. That makes the matched depth a binary search, about log2(depth) set lookups a
host, instead of a walk down the chain.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from extproc.picker.blocks import held_depth


class HostBlocks:
    """One host's blocks, least recently routed first, at most ``capacity`` of them."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def matched_depth(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` this host holds."""
        return held_depth(self._blocks, hashes)

    def touch(self, hashes: Sequence[int], held: int) -> int:
        """Record a request carrying ``hashes`` of which the first ``held`` are here already
        (``matched_depth`` of the same hashes); returns how many blocks were evicted."""
        blocks = self._blocks
        for block in reversed(hashes[held:]):
            blocks[block] = None
        move = blocks.move_to_end
        try:
            for block in reversed(hashes[:held]):
                move(block)
        except KeyError:  # ``held`` overstated what is here: add the missing ones too
            for block in reversed(hashes[:held]):
                blocks[block] = None
                move(block)
        return self.shrink(self.capacity)

    def shrink(self, capacity: int) -> int:
        """Evict the least recent blocks down to ``capacity``; returns how many went."""
        self.capacity = capacity
        excess = len(self._blocks) - capacity
        pop = self._blocks.popitem
        for _ in range(max(0, excess)):
            pop(last=False)
        return max(0, excess)
