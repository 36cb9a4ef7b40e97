"""One signature for every routing strategy, and the strategies that need no index.

A strategy takes a ``DecisionInput`` (one request, with the state it is placed over read
for it alone) and returns a ``Placement``. The router chooses one from a table once per
config (``adapter/strategies.py``) and calls it per request, whatever it is. The ones here
are pure: what varies (loads, the random draw, the time) arrives in the input. Longest
match, which reads and records the prefix index, sits above the index
(``adapter/strategies.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from extproc.picker.affinity import LoadPolicy, PrefixHeat
from extproc.picker.blocks import PrefixLookup, PromptBlocks
from extproc.picker.decide import Decision, Strategy, at_random, by_key, least_loaded
from extproc.picker.hosts import HostSet

# No placement weights: every host weighs the same. Shared, so a request allocates none.
NO_WEIGHTS: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class DecisionInput:
    """One request, as every strategy sees it."""

    # The candidates: the hosts that serve the request's model.
    hosts: HostSet
    # Requests in flight per host, by the strategy's own measure (``LoadLedger.loads``).
    loads: Mapping[str, int | float]
    # Placement weights (cache pressure), read only by strategies that place by the chain.
    weights: Mapping[str, float]
    # A draw in [0, 1): breaks ties, and drives RANDOM.
    rand: float
    # The router's clock, for what drains with time (the pending prefill).
    now: float
    # The fixed-length key's salted digest: what strategies not by the chain place by.
    digest: int = 0
    # The prompt's block chain: what strategies by the chain place by; None for the rest.
    blocks: PromptBlocks | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """A decision and the index lookup it was made on (None outside longest match)."""

    decision: Decision
    lookup: PrefixLookup | None = None
    # Bytes of the prompt the chosen host holds, by the index (longest match only): the
    # router's estimate of the hit (prefix_router_matched_bytes_total).
    matched_bytes: int = 0
    # The prompt's heat as the decision read it (longest match only).
    heat: PrefixHeat | None = None


class RoutingStrategy(Protocol):
    """Where a request goes, by one of the config's routing modes."""

    @property
    def strategy(self) -> Strategy:
        """What it implements: the decisions' label, and the loads it reads."""

    @property
    def by_chain(self) -> bool:
        """True: it places by the prompt's block chain and reads the placement weights, and
        draws nothing. False: by the fixed-length key's digest and a random draw."""

    def __call__(self, request: DecisionInput) -> Placement: ...


@dataclass(frozen=True, slots=True)
class KeyStrategy:
    """PREFIX_AWARE by the fixed-length key: the digest's placement order under the load
    bound (consistent hashing with bounded loads)."""

    policy: LoadPolicy
    failover: int

    @property
    def strategy(self) -> Strategy:
        return Strategy.PREFIX_AWARE

    @property
    def by_chain(self) -> bool:
        return False

    def __call__(self, request: DecisionInput) -> Placement:
        policy = self.policy
        return Placement(
            by_key(
                request.digest,
                request.hosts,
                request.loads,
                policy.concurrency_threshold,
                self.failover,
                policy.balance_factor,
                policy.balance_min_in_flight,
            )
        )


@dataclass(frozen=True, slots=True)
class RandomStrategy:
    """RANDOM: where the draw falls."""

    failover: int

    @property
    def strategy(self) -> Strategy:
        return Strategy.RANDOM

    @property
    def by_chain(self) -> bool:
        return False

    def __call__(self, request: DecisionInput) -> Placement:
        return Placement(at_random(request.hosts, self.failover, request.rand))


@dataclass(frozen=True, slots=True)
class LeastLoadedStrategy:
    """LEAST_OUTSTANDING_REQUESTS: the least loaded host, the draw breaking ties."""

    failover: int

    @property
    def strategy(self) -> Strategy:
        return Strategy.LEAST_OUTSTANDING_REQUESTS

    @property
    def by_chain(self) -> bool:
        return False

    def __call__(self, request: DecisionInput) -> Placement:
        return Placement(least_loaded(request.hosts, request.loads, self.failover, request.rand))


def strategy_by_name(strategy: Strategy, policy: LoadPolicy, failover: int) -> RoutingStrategy:
    """The strategy ``strategy`` names among those that need no index: PREFIX_AWARE here
    places by the fixed-length key (longest match reads the index: ``adapter/strategies.py``)."""
    if strategy is Strategy.PREFIX_AWARE:
        return KeyStrategy(policy, failover)
    if strategy is Strategy.RANDOM:
        return RandomStrategy(failover)
    return LeastLoadedStrategy(failover)
