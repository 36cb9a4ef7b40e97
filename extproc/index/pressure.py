"""Cache pressure per host, from the load feed: how fast each engine takes in prompt.

Every load-feed round carries each vLLM host's cumulative prefix-cache counters
(``vllm:prefix_cache_queries_total``, in tokens) and the control plane's scrape time. The
rate of prompt tokens a host receives, smoothed over ``time_constant_s``, says how much of
the fleet's traffic it holds, and so how hard its cache is pressed. New prefixes are then
placed by weighted rendezvous hashing with weights that fall as a host's rate rises above
the fleet's mean: they spread by pressure as well as by hash.

The inputs are the feed's own values (counters and the control plane's clock), which
every router replica receives alike, so replicas compute the same weights without talking
to each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from extproc.control.model import HostLoad

_MIN_WEIGHT, _MAX_WEIGHT = 0.25, 4.0


class CachePressure:
    def __init__(self, time_constant_s: float = 10.0, strength: float = 2.0) -> None:
        self.time_constant_s = time_constant_s
        # How strongly a busy host repels new prefixes: its weight is
        # (mean rate / its rate) ** strength, between 1/4 and 4: an idle (new) host draws
        # new prefixes first without taking every one of a burst.
        self.strength = strength
        self._last: dict[str, tuple[float, float]] = {}  # host -> (scraped_at, queries)
        self._rates: dict[str, float] = {}  # prompt tokens per second, smoothed

    def update(self, loads: Mapping[str, HostLoad]) -> None:
        for host, load in loads.items():
            previous = self._last.get(host)
            self._last[host] = (load.scraped_at, load.prefix_cache_queries)
            if previous is None:
                continue
            elapsed = load.scraped_at - previous[0]
            added = load.prefix_cache_queries - previous[1]
            if elapsed <= 0 or added < 0:  # a repeated round, or the engine restarted
                continue
            alpha = 1.0 - math.exp(-elapsed / self.time_constant_s)
            rate = self._rates.get(host, 0.0)
            self._rates[host] = rate + alpha * (added / elapsed - rate)

    def retain(self, hosts: Iterable[str]) -> None:
        keep = set(hosts)
        for table in (self._last, self._rates):
            for host in [h for h in table if h not in keep]:
                del table[host]

    def rates(self) -> Mapping[str, float]:
        return dict(self._rates)

    def weights(self, hosts: Iterable[str]) -> Mapping[str, float]:
        """Placement weights, 1 for a host at the fleet's mean rate; empty (all equal)
        until rates are known for every host."""
        addresses = list(hosts)
        rates = [self._rates.get(h) for h in addresses]
        if not addresses or any(r is None for r in rates):
            return {}
        mean = sum(r for r in rates if r is not None) / len(addresses)
        if mean <= 0:
            return {}
        weights = {}
        for host, rate in zip(addresses, rates, strict=True):
            assert rate is not None
            ratio = mean / max(rate, mean * 1e-3)
            weights[host] = max(_MIN_WEIGHT, min(_MAX_WEIGHT, ratio**self.strength))
        return weights
