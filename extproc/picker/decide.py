"""The decision core: strategy + placement + overflow, with no I/O, clock or randomness.

One pure function per strategy (``by_key``, ``at_random``, ``least_loaded``); the
strategies behind the router's one signature call them (``strategy.py``). Randomness is
injected as a number in [0, 1),
and load is a snapshot mapping host address to requests in flight. Longest match, which
reads the prefix index, is ``affinity.decide_prefix``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from extproc.errors import NoHostsError
from extproc.picker.hosts import Host, HostSet
from extproc.picker.placement import placement_order


class Strategy(StrEnum):
    RANDOM = "RANDOM"
    LEAST_OUTSTANDING_REQUESTS = "LEAST_OUTSTANDING_REQUESTS"
    PREFIX_AWARE = "PREFIX_AWARE"


class Outcome(StrEnum):
    """How the primary host was chosen; a metric label."""

    # PREFIX_AWARE: the key's first host, under the threshold.
    PLACED = "placed"
    # PREFIX_AWARE: the first host was at the threshold; a later host in the order took it.
    OVERFLOW = "overflow"
    # PREFIX_AWARE: every host was at the threshold; the least-loaded one took it.
    SATURATED = "saturated"
    # PREFIX_AWARE (longest match): a host holding more of the prompt than the anchor's
    # first host took it.
    MATCHED = "matched"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"
    # Decided on the headers alone, the least loaded host, because the router was running
    # too far behind to read the body in time (see adapter/lag.py).
    SHED = "shed"


# The outcomes in which the key's first host did not take the request (a metric's and a
# prediction's "overflow").
OVERFLOWED = frozenset({Outcome.OVERFLOW, Outcome.SATURATED})


@dataclass(frozen=True, slots=True)
class Decision:
    """An ordered list of targets (primary first, then failover) and how it was chosen."""

    targets: tuple[str, ...]
    outcome: Outcome
    strategy: Strategy

    @property
    def primary(self) -> str:
        return self.targets[0]


def _load(loads: Mapping[str, int | float], host: Host) -> int | float:
    return loads.get(host.address, 0)


def _with_failover(primary: Host, order: tuple[Host, ...], failover: int) -> tuple[str, ...]:
    rest = [h.address for h in order if h is not primary][:failover]
    return (primary.address, *rest)


def load_bound(
    hosts: HostSet,
    loads: Mapping[str, int | float],
    concurrency_threshold: int,
    balance_factor: float | None,
    min_in_flight: int = 2,
) -> float:
    """The in-flight count at which a host overflows.

    Always ``concurrency_threshold``; with ``balance_factor`` also ``balance_factor`` times
    the mean load including this request (consistent hashing with bounded loads), but never
    below ``min_in_flight``, so a few requests for one prefix at an idle fleet stay
    together. This keeps a hot prefix from piling onto one host while the fleet is busy.
    """
    if balance_factor is None or not hosts.hosts:
        return concurrency_threshold
    total = sum(_load(loads, h) for h in hosts.hosts) + 1
    bounded = max(float(min_in_flight), math.ceil(balance_factor * total / len(hosts.hosts)))
    return min(float(concurrency_threshold), bounded)


def by_key(
    digest: int,
    hosts: HostSet,
    loads: Mapping[str, int | float],
    concurrency_threshold: int,
    failover: int,
    balance_factor: float | None = None,
    balance_min_in_flight: int = 2,
) -> Decision:
    """PREFIX_AWARE by a fixed-length key: the first host in the digest's placement order
    under the load bound, else the least loaded."""
    if not hosts.hosts:
        raise NoHostsError("the published host set is empty")
    strategy = Strategy.PREFIX_AWARE
    order = placement_order(digest, hosts)
    bound = load_bound(hosts, loads, concurrency_threshold, balance_factor, balance_min_in_flight)
    for position, host in enumerate(order):
        if _load(loads, host) < bound:
            outcome = Outcome.PLACED if position == 0 else Outcome.OVERFLOW
            return Decision(_with_failover(host, order, failover), outcome, strategy)
    # All saturated: the least loaded, earliest in the key's order on ties.
    least = min(order, key=lambda h: _load(loads, h))
    return Decision(_with_failover(least, order, failover), Outcome.SATURATED, strategy)


def at_random(hosts: HostSet, failover: int, rand: float) -> Decision:
    """RANDOM: the host ``rand`` falls on, then the hosts after it for failover."""
    rotated = _rotated(hosts, rand)
    return Decision(_with_failover(rotated[0], rotated, failover), Outcome.RANDOM, Strategy.RANDOM)


def least_loaded(
    hosts: HostSet, loads: Mapping[str, int | float], failover: int, rand: float
) -> Decision:
    """LEAST_OUTSTANDING_REQUESTS: the least loaded host, ``rand`` breaking ties."""
    by_load = tuple(sorted(_rotated(hosts, rand), key=lambda h: _load(loads, h)))  # stable
    strategy = Strategy.LEAST_OUTSTANDING_REQUESTS
    return Decision(_with_failover(by_load[0], by_load, failover), Outcome.LEAST_LOADED, strategy)


def _rotated(hosts: HostSet, rand: float) -> tuple[Host, ...]:
    """The hosts rotated by ``rand``, so that ties (and RANDOM) do not always favour the
    same host."""
    count = len(hosts.hosts)
    if not count:
        raise NoHostsError("the published host set is empty")
    start = min(int(rand * count), count - 1)
    return hosts.hosts[start:] + hosts.hosts[:start]
