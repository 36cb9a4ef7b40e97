"""Shadow mode: what PREFIX_AWARE by longest match would decide, beside the live strategy.

While the router serves with any strategy, the shadow places every request too, over its
own prefix index, popularity counts and pending prefill, with its own in-flight counts (a
request counts on its shadow host until the real request ends): a model of each host's
prefix cache under PREFIX_AWARE, sized like the real index from the capacity vLLM
publishes (``vllm:cache_config_info``). From it, cumulatively, it predicts what
PREFIX_AWARE would get: the prompt bytes its host would have held (the hit rate, replies
counted as ``ServedPrompts`` counts them), each host's requests (the share), and the
decisions that overflowed. The live figures to set them against come from vLLM's own
counters (the load feed) and the router's decisions; ``adapter/metrics.py`` exports both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from extproc.index.placer import place_longest
from extproc.index.popularity import PrefixPopularity
from extproc.index.prefill import PendingPrefill
from extproc.index.prefix import IndexSizing, PrefixIndex
from extproc.index.replies import ServedPrompts
from extproc.picker.affinity import LoadPolicy
from extproc.picker.blocks import PromptBlocks
from extproc.picker.decide import OVERFLOWED
from extproc.picker.hosts import HostSet


class Shadow:
    def __init__(
        self,
        sizing: IndexSizing,
        policy: LoadPolicy,
        hot_prefix_factor: float,
        prefill_bytes_per_s: float | None,
    ) -> None:
        self.policy = policy
        self.hot_prefix_factor = hot_prefix_factor
        self.index = PrefixIndex(sizing)
        self.popularity = PrefixPopularity()
        self.prefill = None if prefill_bytes_per_s is None else PendingPrefill(prefill_bytes_per_s)
        # No reply is assumed where a prompt's messages are not known.
        self.replies = ServedPrompts(sizing.chars_per_token, reply_tokens=1)
        self.in_flight: Counter[str] = Counter()
        # What it predicts, since it started.
        self.requests: Counter[str] = Counter()
        self.overflows = 0
        self.prompt_bytes = 0
        self.matched_bytes = 0

    def place(
        self, blocks: PromptBlocks, hosts: HostSet, weights: Mapping[str, float], now: float
    ) -> str:
        """Where PREFIX_AWARE would send this prompt; counts it in flight there until
        ``release``."""
        placed = place_longest(
            blocks,
            hosts,
            self.in_flight,
            weights,
            self.policy,
            self.hot_prefix_factor,
            0,
            self.index,
            self.popularity,
            self.prefill,
            now,
        )
        host = placed.decision.primary
        hashes = blocks.hashes
        depth = self.replies.matched(
            host, hashes, placed.lookup.depth_on(host), blocks.segments, blocks.block_bytes
        )
        if hashes:
            self.replies.note(host, hashes[-1], blocks.length, self.index.capacity_of(host))
        self.requests[host] += 1
        self.in_flight[host] += 1
        if placed.decision.outcome in OVERFLOWED:
            self.overflows += 1
        self.prompt_bytes += blocks.length
        self.matched_bytes += min(blocks.length, depth * blocks.block_bytes)
        return host

    def release(self, host: str) -> None:
        held = self.in_flight[host] - 1
        if held > 0:
            self.in_flight[host] = held
        else:
            del self.in_flight[host]

    # --- the fleet, as the router learns it

    def retain(self, hosts: Iterable[str]) -> None:
        keep = set(hosts)
        self.index.retain(keep)
        self.replies.retain(keep)
        if self.prefill is not None:
            self.prefill.retain(keep)
        for table in (self.requests, self.in_flight):
            for host in [h for h in table if h not in keep]:
                del table[host]

    def forget(self, host: str) -> None:
        """``host``'s engine restarted: its cache, and so the shadow's, is empty."""
        self.index.forget(host)
        self.replies.forget(host)

    def set_cache_sizes(self, tokens: Mapping[str, float]) -> None:
        self.index.set_cache_sizes(tokens)
