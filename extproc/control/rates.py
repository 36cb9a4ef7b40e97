"""How fast each engine takes in prompt tokens, smoothed: the load feed's cache pressure.

Every scrape round carries each vLLM host's cumulative ``vllm:prefix_cache_queries_total``
(prompt tokens looked up in its prefix cache). Their rate, smoothed over
``time_constant_s``, says how much of the fleet's traffic a host takes in, and so how hard
its cache is pressed. The control plane computes it once and publishes it with each host's
load, so every router replica, and a router that has just restarted, reads the same
numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from extproc.control.model import HostLoad


class PromptRates:
    def __init__(self, time_constant_s: float = 10.0) -> None:
        self.time_constant_s = time_constant_s
        self._last: dict[str, tuple[float, float]] = {}  # host -> (scraped_at, queries)
        self._rates: dict[str, float] = {}  # prompt tokens per second, smoothed

    def update(self, loads: Mapping[str, HostLoad]) -> Mapping[str, float]:
        """Take one round of scrapes; returns the smoothed rate of every host known."""
        for host, load in loads.items():
            previous = self._last.get(host)
            self._last[host] = (load.scraped_at, load.prefix_cache_queries)
            if previous is None:
                continue
            elapsed = load.scraped_at - previous[0]
            added = load.prefix_cache_queries - previous[1]
            if elapsed <= 0:
                continue  # the same round again
            if added < 0:  # the engine restarted: its counters began again
                self._rates[host] = 0.0
                continue
            alpha = 1.0 - math.exp(-elapsed / self.time_constant_s)
            rate = self._rates.get(host, 0.0)
            self._rates[host] = rate + alpha * (added / elapsed - rate)
        return dict(self._rates)

    def retain(self, hosts: Iterable[str]) -> None:
        keep = set(hosts)
        for table in (self._last, self._rates):
            for host in [h for h in table if h not in keep]:
                del table[host]


MIN_WEIGHT, MAX_WEIGHT = 0.25, 4.0
# How far from the fleet's mean rate a host must be to draw or repel new prefixes. 1.5
# steered more new prefixes, but the weights then changed often enough that two router
# replicas, seeing one prefix seconds apart, placed it apart (docs/architecture.md).
PRESSURE_FACTOR = 2.0
# Below this mean rate (prompt tokens a second) the fleet is idle: every weight is 1, so the
# pressure of traffic long gone does not steer the next prefixes.
IDLE_TOKENS_PER_S = 50.0


def placement_weights(
    rates: Mapping[str, float], hosts: Iterable[str], factor: float = PRESSURE_FACTOR
) -> dict[str, float]:
    """Weights for the two-choice placement of new prefixes: hosts whose rate is not
    known yet weigh 1 and do not count in the mean; empty (all equal) when no rate is.

    Three levels, so that everyday fluctuation moves nothing: a host taking in less than
    1/``factor`` of the fleet's mean rate (a new or idle host) weighs MAX_WEIGHT and draws
    new prefixes; one taking in more than ``factor`` times the mean weighs MIN_WEIGHT;
    every other host weighs 1.
    """
    addresses = list(hosts)
    known = [rates[h] for h in addresses if h in rates]
    if not known:
        return {}
    mean = sum(known) / len(known)
    if mean < IDLE_TOKENS_PER_S:
        return {}
    weights = {}
    for host in addresses:
        rate = rates.get(host)
        if rate is None:
            weights[host] = 1.0
        elif rate * factor < mean:
            weights[host] = MAX_WEIGHT
        elif rate > mean * factor:
            weights[host] = MIN_WEIGHT
        else:
            weights[host] = 1.0
    return weights


class CachePressure:
    """Rates every round; placement weights recomputed every ``weights_interval_s`` only, so
    they stay put between changes and routers that see a prefix at different moments of
    one interval place it alike."""

    def __init__(
        self,
        time_constant_s: float = 10.0,
        weights_interval_s: float = 0.5,
        factor: float | None = PRESSURE_FACTOR,
    ) -> None:
        self.rates = PromptRates(time_constant_s)
        self.weights_interval_s = weights_interval_s
        # None: every weight stays 1.
        self.factor = factor
        self._weights: dict[str, float] = {}
        self._weighed_at: float | None = None

    def update(
        self, loads: Mapping[str, HostLoad], now: float, hosts: Iterable[str] | None = None
    ) -> dict[str, tuple[float, float]]:
        """One round of scrapes (``now`` on the scrapes' clock) of the fleet ``hosts`` (by
        default, those in the round): (rate, weight) per host scraped. A host whose scrape
        failed this round keeps its rate and its weight."""
        fleet = set(loads if hosts is None else hosts)
        self.rates.retain(fleet)
        rates = self.rates.update(loads)
        due = self._weighed_at is None or now - self._weighed_at >= self.weights_interval_s
        if self.factor is not None and (due or set(self._weights) - fleet):
            self._weights = placement_weights(rates, fleet, self.factor)
            self._weighed_at = now
        return {host: (rates.get(host, 0.0), self._weights.get(host, 1.0)) for host in loads}
