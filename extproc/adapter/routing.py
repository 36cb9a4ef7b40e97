"""The router's state and its one operation: route a request.

This joins the routing strategies (``strategies.py``, chosen per config) to the live
state (config, host set, the prefix index, the load ledger in ``ledger.py``) and records
metrics. What watches the decisions without taking part (the live shares, the traffic log,
shadow mode) it tells through one interface (``observers.py``), knowing none of them. It
knows nothing of gRPC or of Envoy's messages.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import structlog

from extproc.adapter import metrics
from extproc.adapter.kv_events import KvEventsFeed
from extproc.adapter.ledger import LoadLedger
from extproc.adapter.observers import (
    LiveShares,
    Routed,
    RouteObserver,
    configured,
    shadow_predictions,
)
from extproc.adapter.settings import (
    index_sizing,
    load_policy,
    pending_prefill,
    pending_prefill_rate,
)
from extproc.adapter.strategies import StrategyTable, strategy_table
from extproc.config import RouterConfig
from extproc.control.model import HostLoad
from extproc.errors import NoHostsError
from extproc.index.popularity import PrefixPopularity
from extproc.index.prefix import PrefixIndex
from extproc.picker.blocks import PromptBlocks, chain_seed, prompt_blocks
from extproc.picker.decide import OVERFLOWED, Decision, Outcome, Strategy
from extproc.picker.hosts import HostSet
from extproc.picker.keys import RoutingKey, extract_key
from extproc.picker.placement import key_digest
from extproc.picker.strategy import NO_WEIGHTS, DecisionInput, RoutingStrategy

# What ``place`` returns, named here too: the ext_proc phases import it from the router.
from extproc.picker.strategy import Placement as Placement

log = structlog.get_logger("router")

Kind = TypeVar("Kind")


def key_chain(key: RoutingKey, block_bytes: int) -> PromptBlocks:
    """The block chain of a routing key, seeded by its model and salt."""
    return prompt_blocks(key.key, block_bytes, chain_seed(key.model, key.salt), key.segments)


class DeferredChain:
    """A prompt's block chain, hashed when first asked for, in the thread that asks (an
    observer's: the traffic log's writer, shadow mode's worker), and then kept for the
    others. It holds the key, as the chain itself would; a race between two threads hashes
    it twice, alike."""

    __slots__ = ("_block_bytes", "_blocks", "_key")

    def __init__(self, key: RoutingKey, block_bytes: int) -> None:
        self._key, self._block_bytes = key, block_bytes
        self._blocks: PromptBlocks | None = None

    def __call__(self) -> PromptBlocks:
        if self._blocks is None:
            self._blocks = key_chain(self._key, self._block_bytes)
        return self._blocks


class Router:
    def __init__(
        self,
        config: RouterConfig,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        observers: Sequence[RouteObserver] = (),
    ) -> None:
        self._config = config
        self.hosts = HostSet.of(config.hosts)
        # Every host's load: in-flight counts, decisions handed off, the load feed.
        self.ledger = LoadLedger(config.load_feed_max_age_s, config.control_plane is not None)
        self.index = PrefixIndex(index_sizing(config), clock)
        # The engines' KV events, where hosts publish them (set by the server at start).
        self.kv_events: KvEventsFeed | None = None
        self._evicted_counted = dict(self.index.evicted)
        self.popularity = PrefixPopularity()
        self.prefill = pending_prefill(config)
        self._strategies = strategy_table(
            config, load_policy(config), self.index, self.popularity, self.prefill
        )
        # The config's strategy, looked up once per config rather than per request.
        self._strategy = _chosen(self._strategies, config)
        # What is told of every decision (``observers.py``): the live decisions per host,
        # those the config asks for (the traffic log, shadow mode: built anew on a reload
        # that changes their settings), and those the caller gave (kept, and stopped with
        # the router).
        self._live = LiveShares()
        self._configured = configured(config)
        self._given = tuple(observers)
        self._observe()
        self._rng = rng or random.Random()
        self._clock = clock
        self._wall_clock = wall_clock
        # Set once there is a host set to place over: at start with static hosts, or on
        # the first update from the control plane.
        self.ready = asyncio.Event()
        if config.control_plane is None:
            self.ready.set()
        metrics.HOSTS.set(len(self.hosts))
        metrics.FEED_AGE.set_function(self.feed_age)
        metrics.UNSEEN_DECISIONS.set_function(self.ledger.unseen.total)
        metrics.ACCESS_LOG_STREAMS.set_function(lambda: self.ledger.completions.streams)
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
        """A new config (hot reload): the index starts afresh if what it holds changed, the
        strategies are built anew from its settings, and the observers it asks for (shadow
        mode, the traffic log) are kept while their settings stay, or stopped and built
        anew (``observers.configured``)."""
        policy = load_policy(config)  # before anything changes: a failure leaves the old
        old, self._config = self._config, config
        self.ledger.configure(config.load_feed_max_age_s, config.control_plane is not None)
        if _index_settings(old) != _index_settings(config):
            self.index.clear()
            self.popularity.clear()
            if self.kv_events is not None:
                self.kv_events.restart()
            log.info("prefix_index_cleared", reason="index settings changed")
        if pending_prefill_rate(old) != pending_prefill_rate(config):
            self.prefill = pending_prefill(config)
        held = self._configured
        self._configured = configured(config, held)
        self._observe()
        for observer in self._configured:
            if not any(observer is h for h in held):  # built now: told the fleet as it is
                observer.hosts_changed(self.hosts.addresses)
                observer.cache_sizes(
                    {a: load.cache_capacity_tokens for a, load in self.ledger.feed.items()}
                )
                log.info(f"{observer.name}_started")
        self._strategies = strategy_table(config, policy, self.index, self.popularity, self.prefill)
        self._strategy = _chosen(self._strategies, config)
        self.index.sizing = index_sizing(config)
        self.index.resize()
        self._count_evictions()

    @property
    def strategy(self) -> RoutingStrategy:
        """The strategy the config routes by."""
        return self._strategy

    def _observe(self) -> None:
        """Take up the observers as they are now, and what they read of a request."""
        self.observers: tuple[RouteObserver, ...] = (
            self._live,
            *self._configured,
            *self._given,
        )
        self._reads_prompt = any(o.reads_prompt for o in self.observers)
        self._reads_weights = any(o.reads_weights for o in self.observers)

    def observer(self, kind: type[Kind]) -> Kind | None:
        """The observer of that kind the router holds, if any (tests and benchmarks look)."""
        return next((o for o in self.observers if isinstance(o, kind)), None)

    def close(self) -> None:
        """Stop the observers: their threads end, their files are closed (the router is
        stopping)."""
        for observer in (*self._configured, *self._given):
            observer.stop()
        self._configured = self._given = ()
        self._observe()

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
        for observer in self.observers:
            observer.hosts_changed(hosts.addresses)
        self._count_evictions()
        metrics.HOSTS.set(len(hosts))
        self.ready.set()

    def set_feed(self, loads: Mapping[str, HostLoad]) -> None:
        """A new load feed: the ledger's loads, and each host's cache, by its counters."""
        previous = self.ledger.feed
        for address, load in loads.items():
            before = previous.get(address)
            # Counters that went backwards: the engine restarted, its cache is empty.
            if before is not None and load.prefix_cache_queries < before.prefix_cache_queries:
                self.index.forget(address)
                for observer in self.observers:
                    observer.host_reset(address)
                log.info("prefix_index_host_reset", host=address)
        sizes = {a: load.cache_capacity_tokens for a, load in loads.items()}
        self.index.set_cache_sizes(sizes)
        for observer in self.observers:
            observer.cache_sizes(sizes)
        self._count_evictions()
        self.ledger.set_feed(loads, self._clock(), self._wall_clock())

    def feed_age(self) -> float:
        """Seconds since the last load feed (a gauge reads it); infinite before the first."""
        return self.ledger.feed_age(self._clock())

    @property
    def feed(self) -> Mapping[str, HostLoad]:
        """The last load feed: each host's load and vLLM counters (the metrics read them)."""
        return self.ledger.feed

    @property
    def routed(self) -> Mapping[str, int]:
        """The live decisions per host since start (the metrics read them)."""
        return self._live.counts

    @property
    def shadow_predictions(self) -> metrics.ShadowPredictions | None:
        """Shadow mode's counters since it started (the metrics read them); None while
        shadow mode is off."""
        return shadow_predictions(self.observers)

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
        config = self.config
        strategy = self._strategy
        by_chain = strategy.by_chain
        observed = self._reads_prompt
        # The prompt's block chain: a strategy by the chain matches on it, and observers
        # (the traffic log, the shadow) read it under any strategy. Then the prompt is read
        # as deep as matching goes, once, and the key says where its first prefix_length
        # characters (the fixed-length key) end.
        chained = by_chain or observed
        limit = config.match_depth_chars if chained else config.prefix_length
        fixed_length = config.prefix_length if chained and not by_chain else None
        key = extract_key(
            body, headers, config.key_mode, limit, config.trusted_salt_header, fixed_length
        )
        metrics.KEY_SOURCES.labels(key.source.value).inc()
        if key.salt_rejected:
            metrics.SALT_REJECTED.labels(key.salt_rejected.split(" ")[0]).inc()
            log.warning("salt_rejected", source=key.salt_rejected)
        # A strategy by the chain places by it here; where only observers read it, their
        # own threads hash it (once, for all of them), off the request path.
        # Otherwise the fixed-length key's digest: PREFIX_AWARE-fixed places by it, and the
        # traffic log keeps it so that a replay places as the router did.
        blocks: PromptBlocks | None = None
        digest = 0
        if by_chain:
            blocks = key_chain(key, config.block_bytes)
        else:
            digest = key_digest(key.key[: key.fixed_bytes], key.salt)  # None: the whole key
        chain: PromptBlocks | DeferredChain | None = None
        if observed:
            chain = blocks if blocks is not None else DeferredChain(key, config.block_bytes)
        now = self._clock()
        hosts = candidates.serving(key.model)
        # The weights: read by a strategy by the chain, and by observers that ask (the shadow).
        reads_weights = by_chain or self._reads_weights
        weights = self.ledger.placement_weights(hosts, now) if reads_weights else NO_WEIGHTS
        placement = strategy(
            DecisionInput(
                hosts,
                self.ledger.loads(strategy.strategy, self.hosts, now),
                weights,
                # Drawn only for the strategies that read it: a seeded router draws alike.
                0.0 if by_chain else self._rng.random(),
                now,
                digest,
                blocks,
            )
        )
        decision = placement.decision
        if placement.lookup is not None:
            self._count_evictions()
            if blocks is not None:
                self._count_match(placement, blocks, weights)
        self.ledger.acquire(decision.primary)
        metrics.DECISIONS.labels(decision.strategy.value, decision.outcome.value).inc()
        if decision.outcome in OVERFLOWED:
            metrics.OVERFLOWS.labels(decision.strategy.value).inc()
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        fixed = None if by_chain else (digest, config.prefix_length)
        routed = Routed(decision, hosts, weights, now, chain, key.model, key.salt, fixed)
        for observer in self.observers:
            observer.routed(routed)
        return placement

    @staticmethod
    def _count_match(
        placement: Placement, blocks: PromptBlocks, weights: Mapping[str, float]
    ) -> None:
        """What a longest match found: the index's estimate of the hit, and a debug line."""
        decision, lookup, heat = placement.decision, placement.lookup, placement.heat
        assert lookup is not None
        log.debug(
            "prefix_decision",
            primary=decision.primary,
            outcome=decision.outcome.value,
            blocks=blocks.depth,
            matched=lookup.matched,
            popular=heat.depth if heat is not None else 0,
            replicas=heat.replicas if heat is not None else 0,
            weights=weights,
        )
        if blocks.length:
            metrics.PREFIX_MATCHED.observe(placement.matched_bytes / blocks.length)
            metrics.PROMPT_BYTES.inc(blocks.length)
            metrics.MATCHED_BYTES.inc(placement.matched_bytes)

    def served(self, placement: Placement, endpoint: str) -> Decision:
        """The gateway reports that ``endpoint`` served the request (a retry or its
        fallback moved it): count it in flight there, and note that host as holding the
        prompt. Returns the decision to ``finish`` from now on."""
        decision = placement.decision
        if endpoint == decision.primary:
            return decision
        self.ledger.release(decision.primary)
        self.ledger.acquire(endpoint)
        moved = Decision((endpoint,), decision.outcome, decision.strategy)
        for observer in self.observers:
            observer.moved(decision, moved)
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
        least = self._strategies[Strategy.LEAST_OUTSTANDING_REQUESTS, self.config.prefix_match]
        now = self._clock()
        request = DecisionInput(
            hosts,
            self.ledger.loads(least.strategy, hosts, now),
            NO_WEIGHTS,
            self._rng.random(),
            now,
        )
        targets = least(request).decision.targets
        decision = Decision(targets, Outcome.SHED, least.strategy)
        self.ledger.acquire(decision.primary)
        metrics.DECISIONS.labels(decision.strategy.value, decision.outcome.value).inc()
        metrics.SHED.inc()
        return decision

    def finish(self, decision: Decision) -> None:
        self.ledger.release(decision.primary)
        self._ended(decision)

    def _ended(self, decision: Decision) -> None:
        for observer in self.observers:
            observer.ended(decision)

    def hand_off(self, decision: Decision) -> str | None:
        """The decision's stream closes before its request ends: the ledger carries the
        request from here (``LoadLedger.hand_off``), and returns a ticket for Envoy's access
        log to bring back when one is connected. Its observers are told it ended: shadow mode
        counts it on its shadow host no longer, as it cannot tell when it ends."""
        self._ended(decision)
        return self.ledger.hand_off(decision.primary, self._clock())


def _chosen(table: StrategyTable, config: RouterConfig) -> RoutingStrategy:
    return table[config.routing_strategy, config.prefix_match]


def _index_settings(config: RouterConfig) -> tuple[object, ...]:
    """What the index's entries mean: when one of these changes, they mean nothing."""
    return (
        config.routing_strategy,
        config.prefix_match,
        config.key_mode,
        config.block_bytes,
        config.match_depth_chars,
    )
