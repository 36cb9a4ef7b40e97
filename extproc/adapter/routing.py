"""The router's state and its one operation: route a request.

This joins the pure picker to the live state (config, host set, load feed, in-flight
counts) and records metrics. It knows nothing of gRPC or of Envoy's messages.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping

import structlog

from extproc import metrics
from extproc.adapter.inflight import InFlight
from extproc.config import RouterConfig
from extproc.control.model import HostLoad
from extproc.picker.decide import Decision, Outcome, Strategy, decide
from extproc.picker.hosts import HostSet
from extproc.picker.keys import extract_key
from extproc.picker.placement import key_digest

log = structlog.get_logger("router")


class Router:
    def __init__(
        self,
        config: RouterConfig,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.hosts = HostSet.of(config.hosts)
        self.in_flight = InFlight()
        self._rng = rng or random.Random()
        self._clock = clock
        self._feed: Mapping[str, HostLoad] = {}
        self._feed_received_at: float | None = None
        # Set once there is a host set to place over: at start with static hosts, or on
        # the first update from the control plane.
        self.ready = asyncio.Event()
        if config.control_plane is None:
            self.ready.set()
        metrics.HOSTS.set(len(self.hosts))
        metrics.FEED_AGE.set_function(self.feed_age)

    def set_hosts(self, hosts: HostSet) -> None:
        """Swap in a newly published host set; decisions after this use it."""
        self.hosts = hosts
        metrics.HOSTS.set(len(hosts))
        self.ready.set()

    def set_feed(self, loads: Mapping[str, HostLoad]) -> None:
        self._feed = loads
        self._feed_received_at = self._clock()

    def feed_age(self) -> float:
        if self._feed_received_at is None:
            return float("inf")
        return self._clock() - self._feed_received_at

    def _loads(self, strategy: Strategy) -> Mapping[str, int | float]:
        """Local in-flight counts, raised to the fleet-wide figure while the feed is fresh.

        The feed counts every router's requests but is up to one scrape old; the local
        count is exact for this router's own. The larger of the two is the safer bound.
        """
        local = self.in_flight.snapshot()
        if strategy is Strategy.RANDOM or self.config.control_plane is None:
            return local
        if self.feed_age() > self.config.load_feed_max_age_s:
            metrics.FEED_STALE.inc()
            return local
        feed = self._feed
        return {
            host.address: max(
                local.get(host.address, 0),
                feed[host.address].outstanding if host.address in feed else 0,
            )
            for host in self.hosts.hosts
        }

    def route(self, headers: Mapping[str, str], body: bytes) -> Decision:
        """Decide where one request goes and count it in flight on its primary host.

        Raises NoHostsError when the host set is empty. The caller must ``finish`` the
        decision when the request's stream ends.
        """
        started = time.perf_counter()
        config = self.config
        key = extract_key(body, headers, config.key_mode, config.prefix_length)
        metrics.KEY_SOURCES.labels(key.source.value).inc()
        if key.salt_rejected:
            metrics.SALT_REJECTED.labels(key.salt_rejected.split(" ")[0]).inc()
            log.warning("salt_rejected", source=key.salt_rejected)
        decision = decide(
            key_digest(key.key, key.salt),
            self.hosts.serving(key.model),
            self._loads(config.routing_strategy),
            config.routing_strategy,
            config.concurrency_threshold,
            config.failover_hosts,
            self._rng.random(),
            config.balance_factor,
        )
        self.in_flight.acquire(decision.primary)
        metrics.DECISIONS.labels(decision.strategy.value, decision.outcome.value).inc()
        if decision.outcome in (Outcome.OVERFLOW, Outcome.SATURATED):
            metrics.OVERFLOWS.labels(decision.strategy.value).inc()
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        return decision

    def finish(self, decision: Decision) -> None:
        self.in_flight.release(decision.primary)
