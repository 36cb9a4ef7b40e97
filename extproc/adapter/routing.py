"""The router's state and its one operation: route a request.

This joins the pure picker to the live state (config, host set, in-flight counts) and
records metrics. It knows nothing of gRPC or of Envoy's messages.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping

import structlog

from extproc import metrics
from extproc.adapter.inflight import InFlight
from extproc.config import RouterConfig
from extproc.picker.decide import Decision, Outcome, decide
from extproc.picker.hosts import HostSet
from extproc.picker.keys import extract_key
from extproc.picker.placement import key_digest

log = structlog.get_logger("router")


class Router:
    def __init__(self, config: RouterConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.hosts = HostSet.of(config.hosts)
        self.in_flight = InFlight()
        self._rng = rng or random.Random()
        metrics.HOSTS.set(len(self.hosts))

    def set_hosts(self, hosts: HostSet) -> None:
        """Swap in a newly published host set; decisions after this use it."""
        self.hosts = hosts
        metrics.HOSTS.set(len(hosts))

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
            self.hosts,
            self.in_flight.snapshot(),
            config.routing_strategy,
            config.concurrency_threshold,
            config.failover_hosts,
            self._rng.random(),
        )
        self.in_flight.acquire(decision.primary)
        metrics.DECISIONS.labels(decision.strategy.value, decision.outcome.value).inc()
        if decision.outcome in (Outcome.OVERFLOW, Outcome.SATURATED):
            metrics.OVERFLOWS.labels(decision.strategy.value).inc()
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        return decision

    def finish(self, decision: Decision) -> None:
        self.in_flight.release(decision.primary)
