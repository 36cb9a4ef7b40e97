"""The router's state and its one operation: route a request.

This joins the routing strategies (``strategies.py``, chosen per config) to the live
state (config, host set, the prefix index, the load ledger in ``ledger.py``) and records
metrics. It knows nothing of gRPC or of Envoy's messages.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping

import structlog

from extproc.adapter import metrics
from extproc.adapter.kv_events import KvEventsFeed
from extproc.adapter.ledger import LoadLedger
from extproc.adapter.shadow_worker import ShadowWorker
from extproc.adapter.strategies import StrategyTable, strategy_table
from extproc.adapter.traffic_log import TrafficLog
from extproc.config import RouterConfig
from extproc.control.model import HostLoad
from extproc.errors import NoHostsError
from extproc.index.popularity import PrefixPopularity
from extproc.index.prefill import PendingPrefill
from extproc.index.prefix import IndexSizing, PrefixIndex
from extproc.index.shadow import Shadow
from extproc.picker.affinity import LoadPolicy
from extproc.picker.blocks import PromptBlocks, chain_seed, prompt_blocks
from extproc.picker.decide import OVERFLOWED, Decision, Outcome, Strategy
from extproc.picker.hosts import HostSet
from extproc.picker.keys import RoutingKey, extract_key
from extproc.picker.placement import key_digest
from extproc.picker.strategy import NO_WEIGHTS, DecisionInput, RoutingStrategy

# What ``place`` returns, named here too: the ext_proc phases import it from the router.
from extproc.picker.strategy import Placement as Placement

log = structlog.get_logger("router")


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
        """A new config (hot reload): the index starts afresh if what it holds changed, and
        the strategies are built anew from its settings."""
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
        if not config.shadow:
            self._drop_shadow()
        elif self.shadow is None or _shadow_settings(old) != _shadow_settings(config):
            self._drop_shadow()
            self.shadow = new_shadow(config)
            self.shadow.retain(self.hosts.addresses)
            self.shadow.set_cache_sizes(
                {a: load.cache_capacity_tokens for a, load in self.ledger.feed.items()}
            )
            log.info("shadow_started")
        self._strategies = strategy_table(config, policy, self.index, self.popularity, self.prefill)
        self._strategy = _chosen(self._strategies, config)
        self.index.sizing = index_sizing(config)
        self.index.resize()
        self._count_evictions()

    @property
    def strategy(self) -> RoutingStrategy:
        """The strategy the config routes by."""
        return self._strategy

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
        """A new load feed: the ledger's loads, and each host's cache, by its counters."""
        previous = self.ledger.feed
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
        self.ledger.set_feed(loads, self._clock(), self._wall_clock())

    def feed_age(self) -> float:
        """Seconds since the last load feed (a gauge reads it); infinite before the first."""
        return self.ledger.feed_age(self._clock())

    @property
    def feed(self) -> Mapping[str, HostLoad]:
        """The last load feed: each host's load and vLLM counters (the metrics read them)."""
        return self.ledger.feed

    @property
    def shadow_predictions(self) -> Shadow | None:
        """Shadow mode's counters since it started (the metrics read them); None while
        shadow mode is off."""
        worker = self.shadow
        return None if worker is None else worker.shadow

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
        shadow = self.shadow
        traffic_log = self.traffic_log
        observed = traffic_log is not None or shadow is not None
        # The prompt's block chain: a strategy by the chain matches on it, and the traffic
        # log and the shadow read it under any strategy. Then the prompt is read as deep as
        # matching goes, once, and the key says where its first prefix_length characters
        # (the fixed-length key) end.
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
        # A strategy by the chain places by it here; where only the traffic log or the
        # shadow reads it, their own threads hash it (once, for both), off the request path.
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
        if traffic_log is not None and chain is not None:
            fixed = None if by_chain else (digest, config.prefix_length)
            traffic_log.write(chain, key.model, key.salt, fixed)
        now = self._clock()
        hosts = candidates.serving(key.model)
        # The weights: read by a strategy by the chain, and by the shadow.
        reads_weights = by_chain or shadow is not None
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
        self.ledger.acquire(decision.primary)
        self.routed[decision.primary] += 1
        metrics.DECISIONS.labels(decision.strategy.value, decision.outcome.value).inc()
        if decision.outcome in OVERFLOWED:
            metrics.OVERFLOWS.labels(decision.strategy.value).inc()
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        if shadow is not None and chain is not None:
            token = next(self._tokens)
            self._shadowed[id(decision)] = (decision, token)
            shadow.place(token, chain, hosts, weights, now)
        return placement

    def served(self, placement: Placement, endpoint: str) -> Decision:
        """The gateway reports that ``endpoint`` served the request (a retry or its
        fallback moved it): count it in flight there, and note that host as holding the
        prompt. Returns the decision to ``finish`` from now on."""
        decision = placement.decision
        if endpoint == decision.primary:
            return decision
        self.ledger.release(decision.primary)
        self.ledger.acquire(endpoint)
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
        self._end_shadow(decision)

    def _end_shadow(self, decision: Decision) -> None:
        shadowed = self._shadowed.pop(id(decision), None)
        if shadowed is not None and self.shadow is not None:
            self.shadow.release(shadowed[1])

    def hand_off(self, decision: Decision) -> str | None:
        """The decision's stream closes before its request ends: the ledger carries the
        request from here (``LoadLedger.hand_off``), and returns a ticket for Envoy's access
        log to bring back when one is connected. The shadow counts the request on its
        shadow host no longer: it cannot tell when it ends."""
        self._end_shadow(decision)
        return self.ledger.hand_off(decision.primary, self._clock())


def _chosen(table: StrategyTable, config: RouterConfig) -> RoutingStrategy:
    return table[config.routing_strategy, config.prefix_match]


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
