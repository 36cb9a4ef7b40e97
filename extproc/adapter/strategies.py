"""The router's routing strategies, one per (routing_strategy, prefix_match), in one table.

The table is built from a config (again on every hot reload), and the router looks its
strategy up there instead of branching per request; ``prefix-router replay`` decides
through the same table. Longest match lives here rather than in the picker: it reads and
records the prefix index. What it matched comes back in the ``Placement``, and the router
counts and logs it (a replay does neither).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from extproc.config import PrefixMatch, RouterConfig
from extproc.index.placer import place_longest
from extproc.index.popularity import PrefixPopularity
from extproc.index.prefill import PendingPrefill
from extproc.index.prefix import PrefixIndex
from extproc.picker.affinity import LoadPolicy
from extproc.picker.decide import Strategy
from extproc.picker.strategy import (
    DecisionInput,
    Placement,
    RoutingStrategy,
    strategy_by_name,
)

StrategyTable = Mapping[tuple[Strategy, PrefixMatch], RoutingStrategy]


@dataclass(frozen=True, slots=True)
class LongestMatchStrategy:
    """PREFIX_AWARE by longest match over the prefix index: look up, decide (pure), record."""

    index: PrefixIndex
    popularity: PrefixPopularity
    prefill: PendingPrefill | None
    policy: LoadPolicy
    hot_prefix_factor: float
    failover: int

    @property
    def strategy(self) -> Strategy:
        return Strategy.PREFIX_AWARE

    @property
    def by_chain(self) -> bool:
        return True

    def __call__(self, request: DecisionInput) -> Placement:
        blocks = request.blocks
        if blocks is None:
            raise ValueError("longest match places by the block chain, and was given none")
        placed = place_longest(
            blocks,
            request.hosts,
            request.loads,
            request.weights,
            self.policy,
            self.hot_prefix_factor,
            self.failover,
            self.index,
            self.popularity,
            self.prefill,
            request.now,
        )
        return Placement(placed.decision, placed.lookup, placed.matched_bytes, placed.heat)


def strategy_table(
    config: RouterConfig,
    policy: LoadPolicy,
    index: PrefixIndex,
    popularity: PrefixPopularity,
    prefill: PendingPrefill | None,
) -> StrategyTable:
    """A strategy for every pair a config can name, over the router's index and counts.

    Every pair, not only the config's: shedding takes the least loaded host whatever the
    config routes by. RANDOM and LEAST_OUTSTANDING_REQUESTS match no prefix, so both of
    their pairs hold the same strategy."""
    failover = config.failover_hosts
    table: dict[tuple[Strategy, PrefixMatch], RoutingStrategy] = {
        (Strategy.PREFIX_AWARE, PrefixMatch.LONGEST): LongestMatchStrategy(
            index, popularity, prefill, policy, config.hot_prefix_factor, failover
        ),
        (Strategy.PREFIX_AWARE, PrefixMatch.FIXED): strategy_by_name(
            Strategy.PREFIX_AWARE, policy, failover
        ),
    }
    for strategy in (Strategy.RANDOM, Strategy.LEAST_OUTSTANDING_REQUESTS):
        chosen = strategy_by_name(strategy, policy, failover)
        for match in PrefixMatch:
            table[strategy, match] = chosen
    return MappingProxyType(table)
