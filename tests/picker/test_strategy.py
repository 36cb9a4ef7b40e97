"""The pure strategies behind the one signature: each decides as its pure function does, and
``strategy_by_name`` finds each by its name."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.picker.affinity import LoadPolicy
from extproc.picker.decide import Strategy, at_random, by_key, least_loaded
from extproc.picker.hosts import HostSet
from extproc.picker.strategy import (
    NO_WEIGHTS,
    DecisionInput,
    KeyStrategy,
    LeastLoadedStrategy,
    RandomStrategy,
    RoutingStrategy,
    strategy_by_name,
)

ADDRESSES = [f"127.0.0.{i}:8000" for i in range(1, 20)]

host_sets = st.lists(st.sampled_from(ADDRESSES), min_size=1, max_size=8, unique=True).map(
    HostSet.of
)
loads = st.dictionaries(st.sampled_from(ADDRESSES), st.integers(0, 12), max_size=8)
digests = st.integers(min_value=0, max_value=2**64 - 1)
rands = st.floats(min_value=0, max_value=1, exclude_max=True)
balance_factors = st.none() | st.floats(min_value=1.0, max_value=3.0)


@given(host_sets, loads, digests, rands, st.integers(1, 10), st.integers(0, 3), balance_factors)
def test_each_strategy_decides_as_its_function_does_and_is_found_by_its_name(
    hosts, load, digest, rand, threshold, failover, balance_factor
):
    policy = LoadPolicy(threshold, balance_factor, 2, overload_cost=0.5)
    strategies: list[RoutingStrategy] = [
        KeyStrategy(policy, failover),
        RandomStrategy(failover),
        LeastLoadedStrategy(failover),
    ]
    request = DecisionInput(hosts, load, NO_WEIGHTS, rand, now=0.0, digest=digest)
    for strategy in strategies:
        assert not strategy.by_chain
        placement = strategy(request)
        assert placement.lookup is None
        expected = {
            Strategy.PREFIX_AWARE: by_key(
                digest,
                hosts,
                load,
                threshold,
                failover,
                balance_factor,
                policy.balance_min_in_flight,
            ),
            Strategy.RANDOM: at_random(hosts, failover, rand),
            Strategy.LEAST_OUTSTANDING_REQUESTS: least_loaded(hosts, load, failover, rand),
        }[strategy.strategy]
        assert placement.decision == expected
        assert strategy_by_name(strategy.strategy, policy, failover) == strategy
        assert placement.decision.strategy is strategy.strategy


def test_every_strategy_but_longest_match_is_named_once():
    policy = LoadPolicy(4, None, 2, overload_cost=0.5)
    named = {
        s.strategy for s in (KeyStrategy(policy, 0), RandomStrategy(0), LeastLoadedStrategy(0))
    }
    assert named == set(Strategy)


def test_a_strategy_reads_nothing_but_its_input():
    # The same input, the same decision: no clock, randomness or state of its own.
    hosts = HostSet.of(ADDRESSES[:5])
    request = DecisionInput(hosts, {ADDRESSES[0]: 3}, NO_WEIGHTS, 0.37, now=1.0, digest=42)
    for strategy in (
        KeyStrategy(LoadPolicy(2, None, 2, overload_cost=0.5), 2),
        RandomStrategy(2),
        LeastLoadedStrategy(2),
    ):
        assert {strategy(request) for _ in range(20)} == {strategy(request)}
