"""The prefix index: which hosts recently received which prompt prefixes.

Each host has an LRU set of block hashes (``HostBlocks``), sized like the host's own KV
cache: ``num_gpu_blocks x block_size`` tokens from ``vllm:cache_config_info`` (carried by
the load feed), at ``chars_per_token`` characters a token, in index blocks of
``block_bytes``. When an engine must have evicted a prefix, the index has too. The sum over
hosts never exceeds ``max_blocks``: when the engines together hold more, every host's share
is scaled down alike. A host that leaves the fleet, restarts or clears its cache loses its
entries.

A host whose engine publishes KV events has a precise view too (``precise.py``): what its
events say it holds, plus this router's speculative entries. While its stream is live the
lookup reads that view for the host instead of the LRU set, which keeps recording all the
same, so a stream that falls silent falls back to what this router knows.

The decision reads a ``PrefixLookup`` (the matched depth on each host), an immutable value;
only ``record`` (and ``record_hashes``, a sibling router's decisions), the fleet changes
and the event streams mutate the index.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from extproc.index.hosts import HostBlocks
from extproc.index.precise import PreciseHost, SpeculativeBlocks
from extproc.picker.blocks import PrefixLookup, PromptBlocks


@dataclass(frozen=True, slots=True)
class IndexSizing:
    """How big the index may grow."""

    block_bytes: int
    # Upper bound on blocks held, over all hosts: the index's memory bound.
    max_blocks: int
    # A host whose cache size is unknown is assumed to hold this many tokens.
    default_host_tokens: int
    chars_per_token: float

    def blocks_for_tokens(self, tokens: float) -> int:
        return max(1, math.floor(tokens * self.chars_per_token / self.block_bytes))


class PrefixIndex:
    def __init__(self, sizing: IndexSizing, clock: Callable[[], float] = time.monotonic) -> None:
        self.sizing = sizing
        self._clock = clock
        self._hosts: dict[str, HostBlocks] = {}
        # Hosts whose engines publish KV events (``precise.py``), and, while any may
        # (``speculative_ttl_s`` set), this router's recent decisions for every host.
        self._precise: dict[str, PreciseHost] = {}
        self._speculative: dict[str, SpeculativeBlocks] = {}
        self.speculative_ttl_s: float | None = None
        # Engine cache sizes in tokens, as published; absent: unknown.
        self._cache_tokens: dict[str, float] = {}
        # Blocks dropped, by reason: capacity (LRU), host_left, host_reset.
        self.evicted: dict[str, int] = {"capacity": 0, "host_left": 0, "host_reset": 0}
        # Told of each decision ``record`` notes (the host, the prompt's chain): the
        # decision exchange (``adapter/decision_exchange.py``) passes it on to sibling
        # routers. None: nobody.
        self.on_record: Callable[[str, Sequence[int]], None] | None = None

    # --- what the decision reads

    def lookup(self, blocks: PromptBlocks, hosts: Iterable[str]) -> PrefixLookup:
        matched = {}
        hashes = blocks.hashes
        if hashes:
            precise, now = self._precise, 0.0
            for host in hosts:
                view = precise.get(host) if precise else None
                if view is not None and view.live:
                    now = now or self._clock()
                    depth = view.matched_depth(hashes, now)
                    if depth:
                        matched[host] = depth
                    continue
                held = self._hosts.get(host)
                if held is not None:
                    depth = held.matched_depth(hashes)
                    if depth:
                        matched[host] = depth
        return PrefixLookup(blocks, MappingProxyType(matched))

    def tail_bytes(self, host: str, blocks: PromptBlocks, depth: int) -> int:
        """Bytes past ``blocks``' first ``depth`` router blocks that ``host``'s engine holds
        too, by its events (0 where they are not read): the start of the block the match
        stopped in, which the engine caches in its own, smaller blocks."""
        view = self._precise.get(host) if self._precise else None
        if view is None or not view.live:
            return 0
        start = depth * blocks.block_bytes
        if start >= len(blocks.key):
            return 0
        # Less than a router block: the whole of the next one would have matched.
        rest = blocks.key[start : start + blocks.block_bytes - 1]
        return view.confirmed.tail_bytes(blocks.prefix_hash(depth), rest)

    # --- what changes it

    def record(self, host: str, lookup: PrefixLookup) -> None:
        """``host`` received the prompt of ``lookup`` (made by ``lookup`` just before)."""
        hashes = lookup.blocks.hashes
        if not hashes:
            return
        self._record(host, hashes, lookup.depth_on(host))
        if self.on_record is not None:
            self.on_record(host, hashes)

    def record_hashes(self, host: str, hashes: Sequence[int]) -> None:
        """A sibling router sent ``host`` a prompt whose chain is ``hashes``: recorded as
        this router's own decision is (speculative where the host's events are read), but
        not passed on to ``on_record``, so no decision travels twice."""
        if not hashes:
            return
        held = self._hosts.get(host)
        self._record(host, hashes, held.matched_depth(hashes) if held is not None else 0)

    def _record(self, host: str, hashes: Sequence[int], depth: int) -> None:
        held = self._hosts.get(host)
        if held is None:
            held = self._hosts[host] = HostBlocks(self._capacity_of(host))
            self.resize()  # a new host's share may shrink the others'
        self.evicted["capacity"] += held.touch(hashes, depth)
        if self.speculative_ttl_s is not None:
            now = self._clock()
            view = self._precise.get(host)
            if view is not None:
                view.expire(now)
                view.record(hashes, now)
            else:  # kept until the host's events are read: its view starts from them
                speculative = self.speculative_of(host)
                speculative.expire(now)
                speculative.record(hashes, now)

    # --- the precise views (hosts that publish KV events)

    def set_precise(self, host: str, view: PreciseHost | None) -> None:
        """Read ``view`` for ``host`` from now on (None: its approximate blocks again)."""
        if view is None:
            self._precise.pop(host, None)
        else:
            self._precise[host] = view

    def precise(self, host: str) -> PreciseHost | None:
        return self._precise.get(host)

    def speculative_of(self, host: str) -> SpeculativeBlocks:
        """This router's recent decisions for ``host``, recorded whether or not its events
        are read yet, so that a view set up after a decision still counts it."""
        speculative = self._speculative.get(host)
        if speculative is None:
            ttl = self.speculative_ttl_s or 0.0
            speculative = self._speculative[host] = SpeculativeBlocks(ttl, self._capacity_of(host))
        return speculative

    def retain(self, hosts: Iterable[str]) -> None:
        """Forget every host not in ``hosts`` (the newly published fleet)."""
        keep = set(hosts)
        for host in [h for h in self._hosts if h not in keep]:
            self.evicted["host_left"] += len(self._hosts.pop(host))
        for host in [h for h in self._cache_tokens if h not in keep]:
            del self._cache_tokens[host]
        for host in [h for h in self._precise if h not in keep]:
            del self._precise[host]
        for host in [h for h in self._speculative if h not in keep]:
            del self._speculative[host]
        self.resize()

    def forget(self, host: str) -> None:
        """``host`` restarted or cleared its cache: nothing it held is there any more."""
        held = self._hosts.pop(host, None)
        if held is not None:
            self.evicted["host_reset"] += len(held)
        speculative = self._speculative.get(host)
        if speculative is not None:
            speculative.clear()

    def set_cache_sizes(self, tokens: Mapping[str, float]) -> None:
        """Engine cache sizes in tokens (0 or absent: unknown); shrinks hosts as needed."""
        known = {h: t for h, t in tokens.items() if t > 0}
        if known != self._cache_tokens:
            self._cache_tokens = known
            self.resize()

    def clear(self) -> None:
        """Forget everything (the routing settings the index depends on changed)."""
        for host in list(self._hosts):
            self.forget(host)

    # --- sizes, for metrics and tests

    def __len__(self) -> int:
        return sum(len(h) for h in self._hosts.values())

    def host_sizes(self) -> Mapping[str, int]:
        return {host: len(held) for host, held in self._hosts.items()}

    def capacity_of(self, host: str) -> int:
        return self._capacity_of(host)

    def capacity_tokens(self, host: str) -> float:
        """The host's KV cache in tokens, as published (or as assumed)."""
        return self._cache_tokens.get(host, self.sizing.default_host_tokens)

    def _engine_blocks(self, host: str) -> int:
        tokens = self._cache_tokens.get(host, self.sizing.default_host_tokens)
        return self.sizing.blocks_for_tokens(tokens)

    def _capacity_of(self, host: str) -> int:
        hosts = set(self._hosts) | set(self._cache_tokens) | {host}
        total = sum(self._engine_blocks(h) for h in hosts)
        own = self._engine_blocks(host)
        if total <= self.sizing.max_blocks:
            return own
        return max(1, math.floor(own * self.sizing.max_blocks / total))

    def resize(self) -> None:
        """Apply the current sizing to every host (after a config or fleet change)."""
        for host, held in self._hosts.items():
            self.evicted["capacity"] += held.shrink(self._capacity_of(host))
