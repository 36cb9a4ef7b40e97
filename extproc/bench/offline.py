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

import heapq
import json
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from extproc.adapter.routing import Router
from extproc.bench.served import output_tokens, serve
from extproc.bench.workloads import BenchRequest
from extproc.config import RouterConfig
from extproc.control.model import HostLoad
from extproc.control.rates import CachePressure
from extproc.picker.hosts import HostSet
from extproc.picker.placement import key_digest, placement_order
from extproc.sim.cache import PrefixCache
from extproc.sim.engine import EngineConfig

SESSION_HASH = "session-hash"  # Envoy ring_hash on the session header, as in the fleet bench


@dataclass(frozen=True)
class OfflineFleet:
    instances: int = 7
    capacity_blocks: int = 4000
    block_size_tokens: int = 16
    chars_per_token: int = 4
    engine: EngineConfig = field(default_factory=EngineConfig)
    # The load feed's round: the router sees each host's counters and load this often.
    feed_interval_s: float = 0.25

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(f"127.0.0.{31 + i}:8000" for i in range(self.instances))


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


def _service_s(engine: EngineConfig, uncached_tokens: int, output_tokens: int) -> float:
    # An idle instance: the front end, one prefill of the uncached tokens, then decode steps.
    prefill = engine.step_seconds(max(1, uncached_tokens))
    decode = engine.step_seconds(1) * max(0, output_tokens - 1)
    return engine.request_overhead_s + prefill + decode


def simulate(
    requests: Sequence[BenchRequest],
    fleet: OfflineFleet,
    settings: Mapping[str, Any] | None = None,
    path: str = "router",
    replicas: int = 1,
) -> OfflineResult:
    """Route ``requests`` over ``fleet``: by our router with ``settings`` (``replicas`` of
    it, taking requests in turn as Envoy spreads its streams, each with only its own index),
    or (``path`` = ``session-hash``) by consistent hashing of the session header, the
    ring_hash baseline."""
    addresses = fleet.addresses
    caches = {
        a: PrefixCache(fleet.capacity_blocks, fleet.block_size_tokens, fleet.chars_per_token)
        for a in addresses
    }
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
    # (end time, sequence, decision, host)
    ending: list[tuple[float, int, Any, str]] = []
    served: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    queries = hits = 0
    counters = {a: [0, 0] for a in addresses}  # each host's vLLM queries and hits, in tokens
    in_flight: Counter[str] = Counter()
    next_feed = 0.0
    pressure = CachePressure()  # what the control plane publishes with the loads
    capacity_tokens = fleet.capacity_blocks * fleet.block_size_tokens
    for sequence, request in enumerate(requests):
        now[0] = request.at_s
        while ending and ending[0][0] <= request.at_s:
            _, finished_sequence, finished, finished_host = heapq.heappop(ending)
            in_flight[finished_host] -= 1
            if finished is not None:
                routers[finished_sequence % replicas].finish(finished)
        while next_feed <= request.at_s:
            loads = {
                a: HostLoad(
                    running=in_flight[a],
                    prefix_cache_queries=counters[a][0],
                    prefix_cache_hits=counters[a][1],
                    cache_capacity_tokens=capacity_tokens,
                    scraped_at=next_feed,
                )
                for a in addresses
            }
            published = pressure.update(loads, next_feed)
            feed = {
                a: replace(
                    load, prompt_tokens_per_s=published[a][0], placement_weight=published[a][1]
                )
                for a, load in loads.items()
            }
            for router in routers:
                router.set_feed(feed)
            next_feed += fleet.feed_interval_s
        body = json.dumps(request.body).encode()
        if path == SESSION_HASH:
            session = request.headers.get("x-session-id", "").encode()
            host = placement_order(key_digest(session, None), hosts)[0].address
            decision = None
        else:
            headers = {k.lower(): v for k, v in request.headers.items()}
            decision = routers[sequence % replicas].route(headers, body)
            host = decision.primary
            outcomes[decision.outcome.value] += 1
        served[host] += 1
        result = serve(caches[host], request)
        output = output_tokens(request)
        queries += result.query_tokens
        hits += result.hit_tokens
        counters[host][0] += result.query_tokens
        counters[host][1] += result.hit_tokens
        in_flight[host] += 1
        took = _service_s(fleet.engine, result.query_tokens - result.hit_tokens, output)
        heapq.heappush(ending, (request.at_s + took, sequence, decision, host))
    total = sum(served.values()) or 1
    return OfflineResult(
        hit_rate=hits / max(1, queries),
        shares={a: served.get(a, 0) / total for a in addresses},
        outcomes=dict(outcomes),
        requests=len(requests),
    )
