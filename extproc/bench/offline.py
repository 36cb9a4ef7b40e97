"""The offline placement model: the router's real decision code over a workload schedule
and the simulator's cache model, with no processes, sockets or wall clock.

Each request of the schedule is routed by a real ``Router`` (static hosts, an injected
clock), then looked up and inserted in its host's ``PrefixCache`` (the simulator's vLLM
block cache, output blocks included). A request stays in flight for the time the
simulator's engine model would take on an idle instance (request overhead, the uncached
prompt's prefill, then one decode step per output token), so in-flight counts and
overflow behave as under load, without contention. It runs thousands of requests a second:
fast enough to sweep settings (block size, thresholds) before a fleet benchmark confirms
the choice. What it cannot see: queueing inside an engine, the load feed's lag, Envoy.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from extproc.adapter.routing import Router
from extproc.bench.served import output_tokens, serve
from extproc.bench.workloads import BenchRequest
from extproc.config import RouterConfig
from extproc.picker.decide import Decision
from extproc.picker.hosts import HostSet
from extproc.picker.placement import key_digest, placement_order
from extproc.replay.fleet import FleetModel, VirtualFleet

SESSION_HASH = "session-hash"  # Envoy ring_hash on the session header, as in the fleet bench

# The offline model's fleet is the replay's virtual fleet.
OfflineFleet = FleetModel


@dataclass
class OfflineResult:
    hit_rate: float
    shares: dict[str, float]
    outcomes: dict[str, int]
    requests: int

    @property
    def max_share(self) -> float:
        return max(self.shares.values()) if self.shares else 0.0

    @property
    def min_share(self) -> float:
        return min(self.shares.values()) if self.shares else 0.0


def simulate(
    requests: Sequence[BenchRequest],
    fleet: FleetModel,
    settings: Mapping[str, Any] | None = None,
    path: str = "router",
    replicas: int = 1,
) -> OfflineResult:
    """Route ``requests`` over ``fleet``: by our router with ``settings`` (``replicas`` of
    it, taking requests in turn as Envoy spreads its streams, each with only its own index),
    or (``path`` = ``session-hash``) by consistent hashing of the session header, the
    ring_hash baseline."""
    addresses = fleet.addresses
    virtual = VirtualFleet(fleet)
    now = [0.0]
    routers = [
        Router(
            RouterConfig(hosts=addresses, **dict(settings or {})),
            rng=random.Random(1 + replica),
            clock=lambda: now[0],
        )
        for replica in range(replicas)
    ]
    hosts = HostSet.of(addresses)
    outcomes: Counter[str] = Counter()
    for sequence, request in enumerate(requests):
        now[0] = request.at_s
        for ended in virtual.finish_until(request.at_s):
            if ended is not None:
                finished_sequence, finished = cast(tuple[int, Decision], ended)
                routers[finished_sequence % replicas].finish(finished)
        for feed in virtual.feed_until(request.at_s):
            for router in routers:
                router.set_feed(feed)
        body = json.dumps(request.body).encode()
        token: tuple[int, Decision] | None = None
        if path == SESSION_HASH:
            session = request.headers.get("x-session-id", "").encode()
            host = placement_order(key_digest(session, None), hosts)[0].address
        else:
            headers = {k.lower(): v for k, v in request.headers.items()}
            decision = routers[sequence % replicas].route(headers, body)
            host = decision.primary
            outcomes[decision.outcome.value] += 1
            token = (sequence, decision)
        result = serve(virtual.caches[host], request)
        virtual.admit(
            host,
            result.query_tokens,
            result.hit_tokens,
            output_tokens(request),
            request.at_s,
            token,
        )
    return OfflineResult(
        hit_rate=virtual.hit_rate(),
        shares=virtual.shares(),
        outcomes=dict(outcomes),
        requests=len(requests),
    )
