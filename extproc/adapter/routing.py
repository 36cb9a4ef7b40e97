"""The router's state and its one operation: route a request.

This joins the pure picker to the live state (config, host set, load feed, in-flight
counts) and records metrics. It knows nothing of gRPC or of Envoy's messages.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from extproc import metrics
from extproc.adapter.completions import Completions
from extproc.adapter.inflight import InFlight
from extproc.adapter.kv_events import KvEventsFeed
from extproc.adapter.shadow_worker import ShadowWorker
from extproc.adapter.traffic_log import TrafficLog
from extproc.adapter.unseen import UnseenDecisions
from extproc.config import PrefixMatch, RouterConfig
from extproc.control.model import HostLoad
from extproc.errors import NoHostsError
from extproc.index.placer import place_longest
from extproc.index.popularity import PrefixPopularity
from extproc.index.prefill import PendingPrefill
from extproc.index.prefix import IndexSizing, PrefixIndex
from extproc.index.shadow import Shadow
from extproc.picker.affinity import LoadPolicy
from extproc.picker.blocks import PrefixLookup, PromptBlocks, chain_seed, prompt_blocks
from extproc.picker.decide import OVERFLOWED, Decision, Outcome, Strategy, decide
from extproc.picker.hosts import HostSet
from extproc.picker.keys import RoutingKey, extract_key
from extproc.picker.placement import key_digest

log = structlog.get_logger("router")


@dataclass(frozen=True, slots=True)
class Placement:
    """A decision and the index lookup it was made on (None outside PREFIX_AWARE's index)."""

    decision: Decision
    lookup: PrefixLookup | None


def key_chain(key: RoutingKey, block_bytes: int) -> PromptBlocks:
    """The block chain of a routing key, seeded by its model and salt."""
    return prompt_blocks(key.key, block_bytes, chain_seed(key.model, key.salt), key.segments)


class DeferredChain:
    """A prompt's block chain, hashed when first asked for, in the thread that asks (the
    traffic log's writer, shadow mode's worker), and then kept for the other. It holds the
    key, as the chain itself would; a race between the two threads hashes it twice, alike."""

    __slots__ = ("_block_bytes", "_blocks", "_key")

    def __init__(self, key: RoutingKey, block_bytes: int) -> None:
        self._key, self._block_bytes = key, block_bytes
        self._blocks: PromptBlocks | None = None

    def __call__(self) -> PromptBlocks:
        if self._blocks is None:
            self._blocks = key_chain(self._key, self._block_bytes)
        return self._blocks


# A handed-off request whose completion Envoy never logged stops counting after this.
COMPLETION_MAX_AGE_S = 900.0


class Router:
    def __init__(
        self,
        config: RouterConfig,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        traffic_log: TrafficLog | None = None,
    ) -> None:
        self._config = config
        # Where each request's record goes (``traffic_log.py``); None: nowhere.
        self.traffic_log = traffic_log
        self._policy = load_policy(config)
        self.hosts = HostSet.of(config.hosts)
        self.in_flight = InFlight()
        # Decisions whose streams ended with them (STREAMED bodies, stream_end: decision),
        # until the load feed shows them.
        self.unseen = UnseenDecisions(config.load_feed_max_age_s)
        # The same, counted exactly while Envoy's access log reports completions.
        self.completions = Completions(COMPLETION_MAX_AGE_S)
        self.index = PrefixIndex(index_sizing(config), clock)
        # The engines' KV events, where hosts publish them (set by the server at start).
        self.kv_events: KvEventsFeed | None = None
        self._evicted_counted = dict(self.index.evicted)
        self.popularity = PrefixPopularity()
        self.prefill = pending_prefill(config)
        # Shadow mode (``index/shadow.py``): where PREFIX_AWARE would have sent each request,
        # placed in its own thread. A request is known to it by a number from ``_tokens``,
        # kept here beside its decision until it ends, and found by the decision's id():
        # the decision is held here, so no other object can take that id meanwhile. A
        # decision ``served`` moved to another endpoint takes over its first one's number.
        self.shadow = new_shadow(config) if config.shadow else None
        self._tokens = itertools.count()
        self._shadowed: dict[int, tuple[Decision, int]] = {}
        # Live decisions per host, since start: the share the shadow's is set against.
        self.routed: Counter[str] = Counter()
        self._rng = rng or random.Random()
        self._clock = clock
        self._wall_clock = wall_clock
        self._feed: Mapping[str, HostLoad] = {}
        self._feed_received_at: float | None = None
        # Set once there is a host set to place over: at start with static hosts, or on
        # the first update from the control plane.
        self.ready = asyncio.Event()
        if config.control_plane is None:
            self.ready.set()
        metrics.HOSTS.set(len(self.hosts))
        metrics.FEED_AGE.set_function(self.feed_age)
        metrics.UNSEEN_DECISIONS.set_function(self.unseen.total)
        metrics.ACCESS_LOG_STREAMS.set_function(lambda: self.completions.streams)
        metrics.INDEX_BLOCKS.set_function(lambda: len(self.index))
        metrics.POPULARITY_KEYS.set_function(lambda: len(self.popularity))
        metrics.INDEX_CAPACITY.set_function(
            lambda: sum(self.index.capacity_of(a) for a in self.hosts.addresses)
        )
        metrics.SHADOW.track(self)

    @property
    def config(self) -> RouterConfig:
        return self._config

    @config.setter
    def config(self, config: RouterConfig) -> None:
        """A new config (hot reload): the index starts afresh if what it holds changed."""
        policy = load_policy(config)  # before anything changes: a failure leaves the old
        old, self._config, self._policy = self._config, config, policy
        self.unseen.max_age_s = config.load_feed_max_age_s
        if _index_settings(old) != _index_settings(config):
            self.index.clear()
            self.popularity.clear()
            if self.kv_events is not None:
                self.kv_events.restart()
            log.info("prefix_index_cleared", reason="index settings changed")
        if pending_prefill_rate(old) != pending_prefill_rate(config):
            self.prefill = pending_prefill(config)
        if not config.shadow:
            self._drop_shadow()
        elif self.shadow is None or _shadow_settings(old) != _shadow_settings(config):
            self._drop_shadow()
            self.shadow = new_shadow(config)
            self.shadow.retain(self.hosts.addresses)
            self.shadow.set_cache_sizes(
                {a: load.cache_capacity_tokens for a, load in self._feed.items()}
            )
            log.info("shadow_started")
        self.index.sizing = index_sizing(config)
        self.index.resize()
        self._count_evictions()

    def _drop_shadow(self) -> None:
        if self.shadow is not None:
            self.shadow.stop()
        self.shadow = None
        self._shadowed.clear()

    def close(self) -> None:
        """Stop shadow mode's thread (the router is stopping)."""
        self._drop_shadow()

    def _count_evictions(self) -> None:
        for reason, total in self.index.evicted.items():
            counted = self._evicted_counted.get(reason, 0)
            if total > counted:
                metrics.INDEX_EVICTED.labels(reason).inc(total - counted)
                self._evicted_counted[reason] = total

    def set_hosts(self, hosts: HostSet) -> None:
        """Swap in a newly published host set; decisions after this use it."""
        self.hosts = hosts
        self.index.retain(hosts.addresses)
        if self.kv_events is not None:
            self.kv_events.set_hosts(hosts.addresses)
        if self.prefill is not None:
            self.prefill.retain(hosts.addresses)
        if self.shadow is not None:
            self.shadow.retain(hosts.addresses)
        for host in [h for h in self.routed if h not in hosts.addresses]:
            del self.routed[host]
        self._count_evictions()
        metrics.HOSTS.set(len(hosts))
        self.ready.set()

    def set_feed(self, loads: Mapping[str, HostLoad]) -> None:
        previous = self._feed
        for address, load in loads.items():
            before = previous.get(address)
            # Counters that went backwards: the engine restarted, its cache is empty.
            if before is not None and load.prefix_cache_queries < before.prefix_cache_queries:
                self.index.forget(address)
                if self.shadow is not None:
                    self.shadow.forget(address)
                log.info("prefix_index_host_reset", host=address)
        sizes = {a: load.cache_capacity_tokens for a, load in loads.items()}
        self.index.set_cache_sizes(sizes)
        if self.shadow is not None:
            self.shadow.set_cache_sizes(sizes)
        self._count_evictions()
        self._feed = loads
        now = self._feed_received_at = self._clock()
        # Each host's scrape start, in this process's clock: the feed stamps wall time.
        wall_now = self._wall_clock()
        for address, load in loads.items():
            self.unseen.scraped(address, now - max(0.0, wall_now - load.scraped_at))

    @property
    def feed(self) -> Mapping[str, HostLoad]:
        """The last load feed: each host's load and vLLM counters."""
        return self._feed

    def feed_age(self) -> float:
        if self._feed_received_at is None:
            return float("inf")
        return self._clock() - self._feed_received_at

    def _loads(self, strategy: Strategy) -> Mapping[str, int | float]:
        """Local in-flight counts, raised to the fleet-wide figure while the feed is fresh.

        The feed counts every router's requests but is up to one scrape old; the local
        count is exact for this router's own. The larger of the two is the safer bound.
        Decisions whose streams closed at once count on top of the feed until it shows
        them; without a fresh feed they count on top of the local figure.
        """
        local = self.in_flight.snapshot()
        if strategy is Strategy.RANDOM:
            return local
        unseen = self.unseen.counts(self._clock())
        fresh = self.config.control_plane is not None
        if fresh and self.feed_age() > self.config.load_feed_max_age_s:
            metrics.FEED_STALE.inc()
            fresh = False
        if not fresh:
            if not unseen:
                return local
            return {
                address: local.get(address, 0) + unseen.get(address, 0)
                for address in local.keys() | unseen.keys()
            }
        feed = self._feed
        return {
            host.address: max(
                local.get(host.address, 0),
                (feed[host.address].outstanding if host.address in feed else 0)
                + unseen.get(host.address, 0),
            )
            for host in self.hosts.hosts
        }

    def route(self, headers: Mapping[str, str], body: bytes) -> Decision:
        """Decide where one request goes and count it in flight on its primary host.

        Raises NoHostsError when the host set is empty. The caller must ``finish`` the
        decision when the request's stream ends, or ``hand_off`` it to the load feed
        when the stream closes first.
        """
        return self.place(headers, body).decision

    def place(
        self, headers: Mapping[str, str], body: bytes, within: HostSet | None = None
    ) -> Placement:
        """``route``, over ``within`` (a gateway's subset of the hosts) when given, keeping
        what the index looked up so that ``served`` can move the request if it went
        elsewhere. Raises NoHostsError when there is no host to choose."""
        started = time.perf_counter()
        candidates = self.hosts if within is None else within
        if not candidates.hosts:
            raise NoHostsError("no host to choose from")
        lookup: PrefixLookup | None = None
        config = self.config
        longest = (
            config.routing_strategy is Strategy.PREFIX_AWARE
            and config.prefix_match is PrefixMatch.LONGEST
        )
        shadow = self.shadow
        # The prompt's block chain: PREFIX_AWARE matches on it, and the traffic log and the
        # shadow read it under any strategy. Then the prompt is read as deep as matching
        # goes, once, and the key says where its first prefix_length characters (the
        # fixed-length key) end.
        chained = longest or self.traffic_log is not None or shadow is not None
        limit = config.match_depth_chars if chained else config.prefix_length
        fixed_length = config.prefix_length if chained and not longest else None
        key = extract_key(
            body, headers, config.key_mode, limit, config.trusted_salt_header, fixed_length
        )
        metrics.KEY_SOURCES.labels(key.source.value).inc()
        if key.salt_rejected:
            metrics.SALT_REJECTED.labels(key.salt_rejected.split(" ")[0]).inc()
            log.warning("salt_rejected", source=key.salt_rejected)
        # The chain: PREFIX_AWARE matches on it here; where only the traffic log or the
        # shadow reads it, their own threads hash it (once, for both), off the request path.
        blocks: PromptBlocks | None = None
        chain: PromptBlocks | DeferredChain | None = None
        if longest:
            blocks = chain = key_chain(key, config.block_bytes)
        elif chained:
            chain = DeferredChain(key, config.block_bytes)
        # The fixed-length key's digest: PREFIX_AWARE-fixed places by it, and the traffic log
        # keeps it so that a replay places as the router did.
        digest = None
        if not longest:
            digest = key_digest(key.key[: key.fixed_bytes], key.salt)  # None: the whole key
        if self.traffic_log is not None:
            assert chain is not None
            fixed = None if digest is None else (digest, config.prefix_length)
            self.traffic_log.write(chain, key.model, key.salt, fixed)
        if longest:
            assert blocks is not None
            decision, lookup = self._decide_longest(key, blocks, candidates)
        else:
            assert digest is not None
            decision = decide(
                digest,
                candidates.serving(key.model),
                self._loads(config.routing_strategy),
                config.routing_strategy,
                config.concurrency_threshold,
                config.failover_hosts,
                self._rng.random(),
                config.balance_factor,
                config.balance_min_in_flight,
            )
        self.in_flight.acquire(decision.primary)
        self.routed[decision.primary] += 1
        metrics.DECISIONS.labels(decision.strategy.value, decision.outcome.value).inc()
        if decision.outcome in OVERFLOWED:
            metrics.OVERFLOWS.labels(decision.strategy.value).inc()
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        if shadow is not None:
            assert chain is not None
            hosts = candidates.serving(key.model)
            weights = self.placement_weights(hosts)
            token = next(self._tokens)
            self._shadowed[id(decision)] = (decision, token)
            shadow.place(token, chain, hosts, weights, self._clock())
        return Placement(decision, lookup)

    def served(self, placement: Placement, endpoint: str) -> Decision:
        """The gateway reports that ``endpoint`` served the request (a retry or its
        fallback moved it): count it in flight there, and note that host as holding the
        prompt. Returns the decision to ``finish`` from now on."""
        decision = placement.decision
        if endpoint == decision.primary:
            return decision
        self.in_flight.release(decision.primary)
        self.in_flight.acquire(endpoint)
        self.routed[decision.primary] -= 1
        self.routed[endpoint] += 1
        moved = Decision((endpoint,), decision.outcome, decision.strategy)
        shadowed = self._shadowed.pop(id(decision), None)
        if shadowed is not None:
            self._shadowed[id(moved)] = (moved, shadowed[1])
        if placement.lookup is not None:
            self.index.record(endpoint, placement.lookup)
            self._count_evictions()
        metrics.SERVED_ELSEWHERE.inc()
        return moved

    def route_shed(self) -> Decision | None:
        """A decision on the headers alone, for a router too far behind to read the body in
        time: the least loaded host, counted in flight like any other. None when the hosts
        differ in what they serve (a LoRA adapter's requests need the body's model).

        Raises NoHostsError when the host set is empty."""
        hosts = self.hosts
        if len({host.models for host in hosts.hosts}) > 1:
            return None
        config = self.config
        least = decide(
            0,
            hosts,
            self._loads(Strategy.LEAST_OUTSTANDING_REQUESTS),
            Strategy.LEAST_OUTSTANDING_REQUESTS,
            config.concurrency_threshold,
            config.failover_hosts,
            self._rng.random(),
        )
        decision = Decision(least.targets, Outcome.SHED, least.strategy)
        self.in_flight.acquire(decision.primary)
        metrics.DECISIONS.labels(decision.strategy.value, decision.outcome.value).inc()
        metrics.SHED.inc()
        return decision

    def _decide_longest(
        self, key: RoutingKey, blocks: PromptBlocks, candidates: HostSet
    ) -> tuple[Decision, PrefixLookup]:
        """PREFIX_AWARE over the prefix index: look up, decide (pure), then record."""
        config = self.config
        hosts = candidates.serving(key.model)
        weights = self.placement_weights(hosts)
        placed = place_longest(
            blocks,
            hosts,
            self._loads(Strategy.PREFIX_AWARE),
            weights,
            self._policy,
            config.hot_prefix_factor,
            config.failover_hosts,
            self.index,
            self.popularity,
            self.prefill,
            self._clock(),
        )
        decision, lookup = placed.decision, placed.lookup
        log.debug(
            "prefix_decision",
            primary=decision.primary,
            outcome=decision.outcome.value,
            blocks=blocks.depth,
            matched=lookup.matched,
            popular=placed.heat.depth,
            replicas=placed.heat.replicas,
            weights=weights,
        )
        self._count_evictions()
        if blocks.length:
            metrics.PREFIX_MATCHED.observe(placed.matched_bytes / blocks.length)
            metrics.PROMPT_BYTES.inc(blocks.length)
            metrics.MATCHED_BYTES.inc(placed.matched_bytes)
        return decision, lookup

    def placement_weights(self, hosts: HostSet) -> Mapping[str, float]:
        """The control plane's placement weights (cache pressure) from a fresh load feed;
        all equal without one. A host missing from the last round weighs 1."""
        feed = self._feed
        if not feed or self.feed_age() > self.config.load_feed_max_age_s:
            return {}
        return {
            h.address: feed[h.address].placement_weight if h.address in feed else 1.0
            for h in hosts.hosts
        }

    def finish(self, decision: Decision) -> None:
        self.in_flight.release(decision.primary)
        self._end_shadow(decision)

    def _end_shadow(self, decision: Decision) -> None:
        shadowed = self._shadowed.pop(id(decision), None)
        if shadowed is not None and self.shadow is not None:
            self.shadow.release(shadowed[1])

    def hand_off(self, decision: Decision) -> str | None:
        """The decision's stream closes before its request ends.

        With Envoy's access log connected, the request stays in flight until its log
        entry brings back the returned ticket (``complete``). Without it, the load feed
        carries the request, and until the feed can show it, the unseen count. The shadow
        counts the request on its shadow host no longer: it cannot tell when it ends."""
        self._end_shadow(decision)
        now = self._clock()
        if self.completions.available:
            for host in self.completions.expire(now):
                self.in_flight.release(host)
                metrics.COMPLETIONS.labels("expired").inc()
            return self.completions.issue(decision.primary, now)
        self.in_flight.release(decision.primary)
        self.unseen.add(decision.primary, now)
        return None

    def complete(self, ticket: str) -> bool:
        """Envoy logged the request of ``ticket`` done; False if it is not this router's."""
        host = self.completions.complete(ticket)
        if host is None:
            return False
        self.in_flight.release(host)
        return True


def load_policy(config: RouterConfig) -> LoadPolicy:
    return LoadPolicy(
        config.concurrency_threshold,
        config.balance_factor,
        config.balance_min_in_flight,
        config.overload_cost,
    )


def pending_prefill_rate(config: RouterConfig) -> float | None:
    """Prompt bytes an engine prefills a second; None: queued prefill is not counted."""
    if config.prefill_tokens_per_s is None:
        return None
    return config.prefill_tokens_per_s * config.chars_per_token


def pending_prefill(config: RouterConfig) -> PendingPrefill | None:
    rate = pending_prefill_rate(config)
    return None if rate is None else PendingPrefill(rate)


def new_shadow(config: RouterConfig) -> ShadowWorker:
    return ShadowWorker(
        Shadow(
            index_sizing(config),
            load_policy(config),
            config.hot_prefix_factor,
            pending_prefill_rate(config),
        )
    )


def _shadow_settings(config: RouterConfig) -> tuple[object, ...]:
    """What the shadow's model depends on: when one of these changes, it starts afresh."""
    return (
        config.key_mode,
        config.block_bytes,
        config.match_depth_chars,
        load_policy(config),
        config.hot_prefix_factor,
        pending_prefill_rate(config),
    )


def index_sizing(config: RouterConfig) -> IndexSizing:
    return IndexSizing(
        block_bytes=config.block_bytes,
        max_blocks=config.index_max_blocks,
        default_host_tokens=config.index_host_tokens,
        chars_per_token=config.chars_per_token,
    )


def _index_settings(config: RouterConfig) -> tuple[object, ...]:
    """What the index's entries mean: when one of these changes, they mean nothing."""
    return (
        config.routing_strategy,
        config.prefix_match,
        config.key_mode,
        config.block_bytes,
        config.match_depth_chars,
    )
