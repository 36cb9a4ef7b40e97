"""The router's strategy table: one strategy per (routing_strategy, prefix_match), chosen
once per config and again on a hot reload."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from extproc.adapter.routing import Router
from extproc.adapter.settings import index_sizing, load_policy
from extproc.adapter.strategies import LongestMatchStrategy, strategy_table
from extproc.config import PrefixMatch, RouterConfig
from extproc.index.popularity import PrefixPopularity
from extproc.index.prefix import PrefixIndex
from extproc.picker.decide import Outcome, Strategy
from extproc.picker.hosts import HostSet
from extproc.picker.strategy import (
    NO_WEIGHTS,
    DecisionInput,
    KeyStrategy,
    LeastLoadedStrategy,
    RandomStrategy,
)

HOSTS = tuple(f"127.0.0.{71 + i}:8000" for i in range(4))
PAIRS = list(itertools.product(Strategy, PrefixMatch))
EXPECTED = {
    (Strategy.PREFIX_AWARE, PrefixMatch.LONGEST): LongestMatchStrategy,
    (Strategy.PREFIX_AWARE, PrefixMatch.FIXED): KeyStrategy,
    (Strategy.RANDOM, PrefixMatch.LONGEST): RandomStrategy,
    (Strategy.RANDOM, PrefixMatch.FIXED): RandomStrategy,
    (Strategy.LEAST_OUTSTANDING_REQUESTS, PrefixMatch.LONGEST): LeastLoadedStrategy,
    (Strategy.LEAST_OUTSTANDING_REQUESTS, PrefixMatch.FIXED): LeastLoadedStrategy,
}


def body(n: int) -> bytes:
    content = f"document {n}: " + "a shared system prompt, long enough to fill blocks. " * 40
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def table_for(config: RouterConfig):  # type: ignore[no-untyped-def]
    index = PrefixIndex(index_sizing(config))
    return strategy_table(config, load_policy(config), index, PrefixPopularity(), None)


def test_every_pair_a_config_can_name_has_its_strategy() -> None:
    table = table_for(RouterConfig(hosts=HOSTS))
    assert set(table) == set(PAIRS)
    for pair, strategy in table.items():
        assert isinstance(strategy, EXPECTED[pair])
        assert strategy.strategy is pair[0]
        assert strategy.by_chain == (pair == (Strategy.PREFIX_AWARE, PrefixMatch.LONGEST))


@pytest.mark.parametrize(("routing_strategy", "prefix_match"), PAIRS)
def test_the_router_routes_by_its_configs_pair(routing_strategy, prefix_match) -> None:
    router = Router(
        RouterConfig(hosts=HOSTS, routing_strategy=routing_strategy, prefix_match=prefix_match),
        random.Random(5),
    )
    assert isinstance(router.strategy, EXPECTED[routing_strategy, prefix_match])
    placement = router.place({}, body(1))
    router.finish(placement.decision)
    assert placement.decision.strategy is routing_strategy
    # Only longest match looks the prompt up in the index.
    assert (placement.lookup is not None) == router.strategy.by_chain
    assert router.ledger.in_flight.total() == 0


def test_longest_match_needs_the_chain() -> None:
    longest = table_for(RouterConfig(hosts=HOSTS))[Strategy.PREFIX_AWARE, PrefixMatch.LONGEST]
    with pytest.raises(ValueError, match="block chain"):
        longest(DecisionInput(HostSet.of(HOSTS), {}, NO_WEIGHTS, 0.5, now=0.0, digest=1))


def test_a_hot_reload_switches_the_strategy() -> None:
    router = Router(RouterConfig(hosts=HOSTS, routing_strategy="PREFIX_AWARE"), random.Random(5))
    assert isinstance(router.strategy, LongestMatchStrategy)
    router.config = router.config.replace(routing_strategy=Strategy.LEAST_OUTSTANDING_REQUESTS)
    assert isinstance(router.strategy, LeastLoadedStrategy)
    decision = router.route({}, body(2))
    router.finish(decision)
    assert decision.strategy is Strategy.LEAST_OUTSTANDING_REQUESTS
    assert decision.outcome is Outcome.LEAST_LOADED
    router.config = router.config.replace(
        routing_strategy=Strategy.PREFIX_AWARE, prefix_match=PrefixMatch.FIXED
    )
    assert isinstance(router.strategy, KeyStrategy)
    placement = router.place({}, body(3))
    router.finish(placement.decision)
    assert placement.decision.outcome is Outcome.PLACED
    assert placement.lookup is None


def test_a_hot_reload_rebuilds_the_strategies_from_the_new_settings() -> None:
    router = Router(RouterConfig(hosts=HOSTS, failover_hosts=0), random.Random(5))
    first = router.route({}, body(4))
    router.finish(first)
    assert len(first.targets) == 1
    router.config = router.config.replace(failover_hosts=2, prefill_tokens_per_s=10_000)
    longest = router.strategy
    assert isinstance(longest, LongestMatchStrategy)
    # Over the router's own index and counts, and its new pending prefill.
    assert longest.index is router.index and longest.popularity is router.popularity
    assert longest.prefill is router.prefill is not None
    again = router.route({}, body(4))
    router.finish(again)
    assert again.primary == first.primary  # the index held on (its settings did not change)
    assert len(again.targets) == 3


@pytest.mark.parametrize("routing_strategy", list(Strategy))
def test_shedding_takes_the_least_loaded_entry_whatever_the_config_routes_by(
    routing_strategy,
) -> None:
    router = Router(RouterConfig(hosts=HOSTS, routing_strategy=routing_strategy), random.Random(5))
    for host in HOSTS[:3]:
        router.ledger.acquire(host)
    shed = router.route_shed()
    assert shed is not None
    assert shed.primary == HOSTS[3]
    assert shed.strategy is Strategy.LEAST_OUTSTANDING_REQUESTS
    assert shed.outcome is Outcome.SHED
    assert router.ledger.in_flight.snapshot()[HOSTS[3]] == 1
