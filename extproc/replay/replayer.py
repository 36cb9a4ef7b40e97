"""One configuration replayed: each record decided by the router's own decision code, then
served by the virtual fleet.

Every configuration decides through the router's strategy table
(``adapter/strategies.py``), behind the one signature the router calls. PREFIX_AWARE by
longest match reads its own prefix index, popularity counts and pending prefill, fed by
the virtual fleet's load-feed rounds (cache sizes, placement weights) as the router is fed
by the control plane. Loads are the virtual fleet's exact in-flight counts: what one router replica
counts locally. The cache model is the simulator's, at the log's block size, whatever
block size the configuration routes with: the engines' cache does not change with the
router's settings.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from extproc.adapter.strategies import strategy_table
from extproc.adapter.traffic_log import TrafficRecord
from extproc.config import PrefixMatch, RouterConfig
from extproc.index.popularity import PrefixPopularity
from extproc.index.prefill import PendingPrefill
from extproc.index.prefix import IndexSizing, PrefixIndex
from extproc.index.replies import ServedPrompts
from extproc.picker.affinity import LoadPolicy
from extproc.picker.decide import OVERFLOWED, Decision, Strategy
from extproc.picker.hosts import HostSet
from extproc.picker.strategy import NO_WEIGHTS, DecisionInput
from extproc.replay.configs import FIXED, LEAST_OUTSTANDING, PREFIX_AWARE, RANDOM, ReplayConfig
from extproc.replay.fleet import FleetModel, VirtualFleet
from extproc.replay.recorded import fixed_key_digest, recorded_blocks
from extproc.sim.engine import EngineConfig


@dataclass(frozen=True)
class ServiceModel:
    """What the log does not hold: how long each request keeps its engine busy."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    # Output tokens per request (the log holds prompts only).
    output_tokens: int = 64
    feed_interval_s: float = 0.25
    # A prefill delays the other requests on its instance (``replay/fleet.py``).
    prefill_stalls: bool = True


@dataclass
class ReplayResult:
    config: ReplayConfig
    requests: int
    hit_rate: float
    # Each instance's share of the requests, in address order.
    shares: list[float]
    overflow_rate: float
    # Prompt tokens the engines would prefill, and those their caches would save.
    prefill_tokens: int
    saved_tokens: int
    outcomes: dict[str, int]
    # Prompt tokens each instance would prefill, in address order: the busiest one's is
    # the fleet's bottleneck.
    host_prefill_tokens: list[float]

    @property
    def busiest_share(self) -> float:
        return max(self.shares) if self.shares else 0.0


class Replayer:
    def __init__(
        self,
        config: ReplayConfig,
        log_block_bytes: int,
        router: RouterConfig,
        service: ServiceModel,
        seed: int = 1,
        hosts: Sequence[str] = (),
    ) -> None:
        """``hosts``: the fleet's addresses, used when there are ``config.instances`` of
        them (placement then matches host by host); otherwise virtual addresses."""
        self.config = config
        self.service = service
        self._chars_per_token = router.chars_per_token
        self._log_block_bytes = log_block_bytes
        block_tokens = max(1, round(log_block_bytes / router.chars_per_token))
        self.fleet = VirtualFleet(
            FleetModel(
                instances=config.instances,
                capacity_blocks=max(1, config.cache_tokens // block_tokens),
                block_size_tokens=block_tokens,
                chars_per_token=max(1, round(router.chars_per_token)),
                engine=service.engine,
                feed_interval_s=service.feed_interval_s,
                named=tuple(hosts) if len(hosts) == config.instances else (),
                prefill_stalls=service.prefill_stalls,
            )
        )
        self.hosts = HostSet.of(self.fleet.addresses)
        self._rng = random.Random(seed)
        self._strategy = (
            Strategy.PREFIX_AWARE
            if config.strategy in (PREFIX_AWARE, FIXED)
            else Strategy(config.strategy)
        )
        self._threshold = config.concurrency_threshold or router.concurrency_threshold
        self._router = router
        self._multiple = (config.block_bytes or log_block_bytes) // log_block_bytes
        self._longest = config.strategy == PREFIX_AWARE
        self._weights: Mapping[str, float] = {}
        self.index = PrefixIndex(
            IndexSizing(
                block_bytes=config.block_bytes or log_block_bytes,
                max_blocks=router.index_max_blocks,
                default_host_tokens=router.index_host_tokens,
                chars_per_token=router.chars_per_token,
            )
        )
        self.popularity = PrefixPopularity()
        rate = router.prefill_tokens_per_s
        self.prefill = None if rate is None else PendingPrefill(rate * router.chars_per_token)
        self._policy = LoadPolicy(
            self._threshold,
            router.balance_factor,
            router.balance_min_in_flight,
            router.overload_cost,
        )
        # The router's strategy table over the replay's own index and counts; a request's
        # alternatives (failover hosts) never serve in a replay, so none are listed.
        match = PrefixMatch.FIXED if config.strategy == FIXED else PrefixMatch.LONGEST
        table = strategy_table(
            router.replace(failover_hosts=0),
            self._policy,
            self.index,
            self.popularity,
            self.prefill,
        )
        self.routing = table[self._strategy, match]
        # The cache model holds prompts; vLLM's holds their replies too.
        self.replies = ServedPrompts(router.chars_per_token, service.output_tokens)
        self._start: float | None = None
        self._now = 0.0
        self.outcomes: Counter[str] = Counter()

    def offer(self, record: TrafficRecord) -> str:
        """Route and serve one record; returns the host it went to."""
        if self._start is None:
            self._start = record.t
        # The writer thread may put records a millisecond out of order: time never goes back.
        now = self._now = max(self._now, record.t - self._start)
        fleet = self.fleet
        for _ in fleet.finish_until(now):
            pass
        if self._longest:
            for feed in fleet.feed_until(now):
                self.index.set_cache_sizes(
                    {a: load.cache_capacity_tokens for a, load in feed.items()}
                )
                self._weights = {a: load.placement_weight for a, load in feed.items()}
        decision = self._decide(record, now)
        host = decision.primary
        self.outcomes[decision.outcome.value] += 1
        hashes = record.hashes
        depth = fleet.caches[host].touch(hashes)
        block = self._log_block_bytes
        hit_blocks = self.replies.matched(host, hashes, depth, record.ends, block)
        if hashes:
            self.replies.note(host, hashes[-1], record.bytes, fleet.model.capacity_blocks)
        per_token = self._chars_per_token
        query = math.ceil(record.chars / per_token)
        hit = min(query, int(hit_blocks * self._log_block_bytes / per_token))
        fleet.admit(host, query, hit, self.service.output_tokens, now)
        return host

    def _decide(self, record: TrafficRecord, now: float) -> Decision:
        """The router's own strategy (``strategy_table``), over the replay's fleet."""
        routing = self.routing
        by_chain = routing.by_chain
        digest = 0
        if self.config.strategy == FIXED:
            length = self.config.prefix_length or self._router.prefix_length
            digest = fixed_key_digest(record, length)
        request = DecisionInput(
            self.hosts,
            self.fleet.in_flight,
            self._weights if by_chain else NO_WEIGHTS,
            # Drawn only for the strategies that read it, as the router draws.
            0.0 if by_chain else self._rng.random(),
            now,
            digest,
            recorded_blocks(record, self._multiple) if by_chain else None,
        )
        return routing(request).decision

    def result(self) -> ReplayResult:
        fleet = self.fleet
        requests = sum(fleet.served.values())
        queries, hits = sum(fleet.queries.values()), sum(fleet.hits.values())
        overflowed = sum(self.outcomes[o.value] for o in OVERFLOWED)
        return ReplayResult(
            config=self.config,
            requests=requests,
            hit_rate=fleet.hit_rate(),
            shares=list(fleet.shares().values()),
            overflow_rate=overflowed / max(1, requests),
            prefill_tokens=queries - hits,
            saved_tokens=hits,
            outcomes=dict(self.outcomes),
            host_prefill_tokens=[float(fleet.queries[a] - fleet.hits[a]) for a in fleet.addresses],
        )


# RANDOM, and LEAST_OUTSTANDING_REQUESTS between equally loaded hosts, decide by a random
# draw, which no replay can foresee request by request: their prediction is the mean over
# this many draws (seeds), so that it estimates the expected hit rate and shares, not one
# draw's.
DRAWN = (RANDOM, LEAST_OUTSTANDING)
DRAWS = 8


def mean_result(results: Sequence[ReplayResult]) -> ReplayResult:
    """The mean of one configuration's replays under different draws."""
    count = len(results)
    first = results[0]
    outcomes: Counter[str] = Counter()
    for result in results:
        outcomes.update(result.outcomes)
    return ReplayResult(
        config=first.config,
        requests=first.requests,
        hit_rate=sum(r.hit_rate for r in results) / count,
        shares=[sum(column) / count for column in zip(*(r.shares for r in results), strict=True)],
        overflow_rate=sum(r.overflow_rate for r in results) / count,
        prefill_tokens=round(sum(r.prefill_tokens for r in results) / count),
        saved_tokens=round(sum(r.saved_tokens for r in results) / count),
        outcomes={k: round(v / count) for k, v in outcomes.items()},
        host_prefill_tokens=[
            sum(column) / count
            for column in zip(*(r.host_prefill_tokens for r in results), strict=True)
        ],
    )
