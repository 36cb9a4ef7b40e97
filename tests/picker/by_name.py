"""Deciding by a strategy's name, for the property tests: through the strategy the router
would call (``strategy_by_name``), with its one signature."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.picker.affinity import LoadPolicy
from extproc.picker.decide import Decision, Strategy
from extproc.picker.hosts import HostSet
from extproc.picker.strategy import NO_WEIGHTS, DecisionInput, strategy_by_name


def decide(
    digest: int,
    hosts: HostSet,
    loads: Mapping[str, int | float],
    strategy: Strategy,
    threshold: int,
    failover: int,
    rand: float,
    balance_factor: float | None = None,
    balance_min_in_flight: int = 2,
) -> Decision:
    """One request through the strategy ``strategy`` names, as the router calls it."""
    policy = LoadPolicy(threshold, balance_factor, balance_min_in_flight, overload_cost=0.5)
    request = DecisionInput(hosts, loads, NO_WEIGHTS, rand, now=0.0, digest=digest)
    return strategy_by_name(strategy, policy, failover)(request).decision
