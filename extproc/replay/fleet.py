"""A virtual fleet: the simulator's prefix cache and engine timing, in virtual time.

Each instance is a ``PrefixCache`` (the simulator's model of vLLM's block cache). A request
stays in flight for the time the simulator's engine model takes on an idle instance: the
front end, one prefill of the uncached prompt, then one decode step per output token. So
in-flight counts, and with them overflow and LEAST_OUTSTANDING_REQUESTS, behave as under
load. With ``prefill_stalls``, one contention of the engine is modelled too: a request's
prefill runs in steps that every other request on its instance waits for (vLLM batches
prefill chunks with the decodes), so each prefill delays the end of every request in
flight there by the time its steps take beyond a decode step. Each instance keeps a work
clock that falls behind real time by the stalls so far, and a request ends when its
instance's work clock has advanced by its own service time.

Every ``feed_interval_s`` the fleet publishes what the control plane would (each host's
load, counters, cache size and placement weight).

Shared by the offline placement model (``bench/offline.py``) and ``prefix-router replay``.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from extproc.control.model import HostLoad
from extproc.control.rates import CachePressure
from extproc.sim.cache import PrefixCache
from extproc.sim.engine import EngineConfig


def service_s(engine: EngineConfig, uncached_tokens: int, output_tokens: int) -> float:
    """An idle instance's time for one request: the front end, one prefill of the
    uncached tokens, then a decode step per output token after the first."""
    prefill = engine.step_seconds(max(1, uncached_tokens))
    decode = engine.step_seconds(1) * max(0, output_tokens - 1)
    return engine.request_overhead_s + prefill + decode


def addresses(instances: int) -> tuple[str, ...]:
    """The virtual instances' addresses."""
    return tuple(f"127.0.0.{31 + i}:8000" for i in range(instances))


@dataclass(frozen=True)
class FleetModel:
    instances: int = 7
    # Each instance's KV cache, in the cache's blocks.
    capacity_blocks: int = 4000
    block_size_tokens: int = 16
    chars_per_token: int = 4
    engine: EngineConfig = field(default_factory=EngineConfig)
    # The load feed's round: what the control plane publishes changes this often.
    feed_interval_s: float = 0.25
    # The instances' addresses, when the fleet is a real one (placement hashes them, so a
    # replay places host by host as that fleet's router did); default: virtual ones.
    named: tuple[str, ...] = ()
    # Prefill steps delay the other requests on their instance (see the module's doc).
    prefill_stalls: bool = False

    @property
    def addresses(self) -> tuple[str, ...]:
        if self.named:
            return self.named
        return addresses(self.instances)

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size_tokens


class VirtualFleet:
    def __init__(self, model: FleetModel) -> None:
        self.model = model
        self.addresses = model.addresses
        self.caches = {
            a: PrefixCache(model.capacity_blocks, model.block_size_tokens, model.chars_per_token)
            for a in self.addresses
        }
        self.in_flight: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        # Each host's prompt tokens looked up and hit (vLLM's prefix cache counters).
        self.queries: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        # Each host's requests: (end on its work clock, admission number, the caller's token).
        self._ending: dict[str, list[tuple[float, int, object]]] = {a: [] for a in self.addresses}
        # Seconds each host's work clock is behind real time: the prefill stalls so far.
        self._stalled: dict[str, float] = dict.fromkeys(self.addresses, 0.0)
        self._admitted = 0
        self._next_feed = 0.0
        self._pressure = CachePressure()

    def finish_until(self, now: float) -> Iterator[object]:
        """End every request whose time is up by ``now``; yields each one's token."""
        for host, ending in self._ending.items():
            work_now = now - self._stalled[host]
            while ending and ending[0][0] <= work_now:
                _, _, token = heapq.heappop(ending)
                self.in_flight[host] -= 1
                yield token

    def feed_until(self, now: float) -> Iterator[dict[str, HostLoad]]:
        """Every load-feed round due by ``now``, as the control plane would publish it."""
        while self._next_feed <= now:
            at = self._next_feed
            loads = {
                a: HostLoad(
                    running=self.in_flight[a],
                    prefix_cache_queries=self.queries[a],
                    prefix_cache_hits=self.hits[a],
                    cache_capacity_tokens=self.model.capacity_tokens,
                    scraped_at=at,
                )
                for a in self.addresses
            }
            published = self._pressure.update(loads, at)
            self._next_feed += self.model.feed_interval_s
            yield {
                a: HostLoad(
                    running=load.running,
                    prefix_cache_queries=load.prefix_cache_queries,
                    prefix_cache_hits=load.prefix_cache_hits,
                    cache_capacity_tokens=load.cache_capacity_tokens,
                    prompt_tokens_per_s=published[a][0],
                    placement_weight=published[a][1],
                    scraped_at=at,
                )
                for a, load in loads.items()
            }

    def admit(
        self,
        host: str,
        query_tokens: int,
        hit_tokens: int,
        output_tokens: int,
        now: float,
        token: object = None,
    ) -> None:
        """``host`` takes a request whose cache lookup found ``hit_tokens`` of
        ``query_tokens``; it stays in flight for ``service_s``."""
        self.served[host] += 1
        self.queries[host] += query_tokens
        self.hits[host] += hit_tokens
        self.in_flight[host] += 1
        engine = self.model.engine
        uncached = query_tokens - hit_tokens
        took = service_s(engine, uncached, output_tokens)
        work_now = now - self._stalled[host]
        if self.model.prefill_stalls and uncached > 0:
            steps = math.ceil(uncached / engine.max_batched_tokens)
            stall = max(0.0, engine.step_seconds(uncached) - steps * engine.step_seconds(1))
            # Its own prefill is in ``took`` already: it stalls the others only.
            self._stalled[host] += stall
            took -= stall
        self._admitted += 1
        heapq.heappush(self._ending[host], (work_now + took, self._admitted, token))

    # --- what it predicts

    def hit_rate(self) -> float:
        return sum(self.hits.values()) / max(1, sum(self.queries.values()))

    def shares(self) -> dict[str, float]:
        total = sum(self.served.values()) or 1
        return {a: self.served.get(a, 0) / total for a in self.addresses}
