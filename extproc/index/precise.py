"""The precise view of one host: what its engine's KV events say it holds, plus what this
router has just sent it and the events have not confirmed yet.

An engine publishes ``BlockStored`` once it has computed a prompt's blocks, a moment after
the router decided. A burst of one new prompt must not scatter in that moment, so every
decision is recorded at once as *speculative* blocks with a time to live
(``kv_events_speculative_ttl_s``), those the engine holds already excepted. An event that
stores the same blocks confirms them, and ends their speculation: from then on the
engine's events alone say whether they are held, so an eviction a second later counts at
once (a speculative entry that outlived it sent the prompt's next requests to a host that
had dropped it, while router replicas that had not sent it there placed it again
elsewhere). A speculative block no event confirmed before its TTL was never cached (the
request failed, or its tail was a partial engine block, which vLLM does not store) and
stops counting.

The events themselves come through ``extproc/events/`` (``HostMirror``: the engine's blocks
mapped onto the router's text blocks). Every router process subscribes to every engine,
so every router holds the same confirmed view: replicas and workers agree on what each
cache holds, and differ only in their own last few seconds of speculative entries.

No I/O; the clock is the caller's (``now``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class CacheView(Protocol):
    """What the precise view reads of an engine's confirmed blocks (``HostMirror``)."""

    def __contains__(self, router_hash: int, /) -> bool: ...

    def __len__(self) -> int: ...

    def tail_bytes(self, chain: int, rest: bytes, /) -> int:
        """Leading bytes of ``rest`` (past the router block ``chain`` names) held too."""
        ...


@dataclass(slots=True)
class SpeculationStats:
    """What became of this router's speculative blocks on one host."""

    recorded: int = 0
    # Expired blocks the engine's events had stored by then, and those it had not.
    confirmed: int = 0
    unconfirmed: int = 0


class SpeculativeBlocks:
    """Blocks this router sent a host, each until ``ttl_s`` after it was last sent there.

    Oldest first, so expiry pops from the front; bounded by ``max_blocks``."""

    __slots__ = ("_expiry", "max_blocks", "ttl_s")

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._expiry: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def held(self, block: int, now: float) -> bool:
        expiry = self._expiry.get(block)
        return expiry is not None and expiry > now

    def record(self, hashes: Sequence[int], now: float) -> None:
        expiry, until = self._expiry, now + self.ttl_s
        for block in hashes:
            expiry[block] = until
            expiry.move_to_end(block)
        while len(expiry) > self.max_blocks:
            expiry.popitem(last=False)

    def discard(self, hashes: Sequence[int]) -> int:
        """Drop ``hashes`` (the engine confirmed them); returns how many were here."""
        expiry, dropped = self._expiry, 0
        for block in hashes:
            dropped += expiry.pop(block, None) is not None
        return dropped

    def expire(self, now: float) -> list[int]:
        """Drop and return the blocks whose time ran out."""
        expired, expiry = [], self._expiry
        while expiry:
            block, until = next(iter(expiry.items()))
            if until > now:
                break
            expiry.popitem(last=False)
            expired.append(block)
        return expired

    def clear(self) -> None:
        self._expiry.clear()


@dataclass(slots=True)
class PreciseHost:
    """One host whose engine publishes KV events: its confirmed blocks and this router's
    speculative ones. ``live`` is False while its event stream is silent or broken: the
    index then reads the host's approximate blocks instead."""

    confirmed: CacheView
    speculative: SpeculativeBlocks
    live: bool = True
    stats: SpeculationStats = field(default_factory=SpeculationStats)

    def matched_depth(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of ``hashes`` the engine holds or was just sent.

        A walk, not a binary search: the engine evicts on its own terms, so what it holds
        need not be closed under prefixes, and a block past a missing one is no hit (vLLM
        matches a prefix, and stops at the first block it lacks)."""
        confirmed, speculative = self.confirmed, self.speculative
        depth = 0
        for block in hashes:
            if block not in confirmed and not speculative.held(block, now):
                break
            depth += 1
        return depth

    def record(self, hashes: Sequence[int], now: float) -> None:
        """This router sent ``hashes`` here: speculative until the engine confirms them,
        but for those it holds already, which its events go on answering for."""
        confirmed = self.confirmed
        new = [block for block in hashes if block not in confirmed]
        self.stats.recorded += len(new)
        self.speculative.record(new, now)

    def confirm(self, hashes: Sequence[int]) -> None:
        """The engine stored ``hashes``: their speculation is over."""
        self.stats.confirmed += self.speculative.discard(hashes)

    def expire(self, now: float) -> None:
        for block in self.speculative.expire(now):
            if block in self.confirmed:
                self.stats.confirmed += 1
            else:
                self.stats.unconfirmed += 1
