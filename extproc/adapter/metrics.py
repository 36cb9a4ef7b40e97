"""The router's own series (``prefix-router router`` and ``epp``: the same Router), declared
in one place; the few it shares with the control plane (config reloads, suppressed log
lines) are in ``extproc/metrics.py``.

Every fallback, overflow and protocol error increments one of these.
"""

from __future__ import annotations

from collections import Counter as Counter_
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class PerHostGauge(Collector):
    """A gauge per host read from a live mapping when scraped: the hot path only updates
    its own dict, instead of creating and removing a labelled child per request."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name
        self._documentation = documentation
        self._source: Mapping[str, float] = {}
        REGISTRY.register(self)

    def track(self, source: Mapping[str, float]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._documentation, labels=["host"])
        for host, value in list(self._source.items()):
            family.add_metric([host], value)
        yield family


class ShadowPredictions(Protocol):
    """Shadow mode's counters since it started (``index/shadow.Shadow``)."""

    @property
    def requests(self) -> Mapping[str, int]: ...

    @property
    def overflows(self) -> int: ...

    @property
    def prompt_bytes(self) -> int: ...

    @property
    def matched_bytes(self) -> int: ...


class HostCacheCounters(Protocol):
    """A host's own vLLM prefix-cache counters, as the load feed carries them
    (``control/model.HostLoad``)."""

    @property
    def prefix_cache_queries(self) -> float: ...

    @property
    def prefix_cache_hits(self) -> float: ...


class LiveAndShadowSource(Protocol):
    """What ``ShadowAndLive`` reads when scraped (``adapter/routing.Router``)."""

    @property
    def routed(self) -> Mapping[str, int]: ...

    @property
    def feed(self) -> Mapping[str, HostCacheCounters]: ...

    @property
    def shadow_predictions(self) -> ShadowPredictions | None: ...


class ShadowAndLive(Collector):
    """Shadow mode's predictions (``index/shadow.py``) beside what the live strategy gets,
    read from the router when scraped: the hot path only counts in its own tables.

    Predicted (while shadow mode is on; they start again at 0 when it is turned on):
    ``prefix_router_shadow_{prompt,matched}_bytes_total`` (their rate's ratio is the hit
    rate PREFIX_AWARE would get), ``prefix_router_shadow_requests_total{host}`` (its share)
    and ``prefix_router_shadow_overflows_total``. Live: ``prefix_router_routed_requests_total
    {host}`` (this router's decisions) and, from the load feed, each host's own vLLM
    counters ``prefix_router_host_prefix_cache_{queries,hits}_total{host}``.
    """

    def __init__(self) -> None:
        self._source: LiveAndShadowSource | None = None
        REGISTRY.register(self)

    def track(self, source: LiveAndShadowSource) -> None:
        self._source = source

    NAMES = (
        "prefix_router_shadow_enabled",
        "prefix_router_routed_requests",
        "prefix_router_host_prefix_cache_queries",
        "prefix_router_host_prefix_cache_hits",
        "prefix_router_shadow_requests",
        "prefix_router_shadow_overflows",
        "prefix_router_shadow_prompt_bytes",
        "prefix_router_shadow_matched_bytes",
    )

    def describe(self) -> Iterator[Metric]:
        """The families it exports (so the registry checks their names at once)."""
        for name in self.NAMES:
            yield Metric(name, "", "gauge" if name.endswith("enabled") else "counter")

    def collect(self) -> Iterator[Metric]:
        source = self._source
        # Read once: shadow mode may be turned off (hot reload) while this scrape runs.
        shadow = None if source is None else source.shadow_predictions
        enabled = GaugeMetricFamily(
            "prefix_router_shadow_enabled", "1 while shadow mode is on, else 0"
        )
        enabled.add_metric([], 0 if shadow is None else 1)
        yield enabled
        if source is None:
            return
        routed = CounterMetricFamily(
            "prefix_router_routed_requests",
            "Requests this router sent to each host, by the live strategy",
            labels=["host"],
        )
        for host, count in list(source.routed.items()):
            routed.add_metric([host], count)
        yield routed
        queries = CounterMetricFamily(
            "prefix_router_host_prefix_cache_queries",
            "Each host's vllm:prefix_cache_queries_total (prompt tokens), from the load feed",
            labels=["host"],
        )
        hits = CounterMetricFamily(
            "prefix_router_host_prefix_cache_hits",
            "Each host's vllm:prefix_cache_hits_total (prompt tokens), from the load feed",
            labels=["host"],
        )
        for host, load in list(source.feed.items()):
            queries.add_metric([host], load.prefix_cache_queries)
            hits.add_metric([host], load.prefix_cache_hits)
        yield queries
        yield hits
        if shadow is None:
            return
        requests = CounterMetricFamily(
            "prefix_router_shadow_requests",
            "Requests PREFIX_AWARE would have sent to each host (shadow mode)",
            labels=["host"],
        )
        for host, count in list(shadow.requests.items()):
            requests.add_metric([host], count)
        yield requests
        for name, value, documentation in (
            ("overflows", shadow.overflows, "Shadow decisions that overflowed or saturated"),
            ("prompt_bytes", shadow.prompt_bytes, "Prompt bytes the shadow placed"),
            (
                "matched_bytes",
                shadow.matched_bytes,
                "Prompt bytes the shadow's host would have held cached",
            ),
        ):
            yield CounterMetricFamily(f"prefix_router_shadow_{name}", documentation, value=value)


class KvEventsSource(Protocol):
    """What ``KvEventsCollector`` reads (``adapter/kv_events.KvEventsFeed``)."""

    def states(self) -> Mapping[str, Any]: ...

    def stream_stats(self) -> Mapping[str, Any]: ...

    def mirrors(self) -> Mapping[str, Any]: ...

    def speculation(self) -> Mapping[str, Any]: ...


class KvEventsCollector(Collector):
    """The engines' KV-event streams, read from the feed when scraped.

    ``prefix_router_kv_events_hosts{state}``: hosts by where their view comes from
    (precise, silent, no_events, no_tokenizer, unmatched).
    ``prefix_router_kv_events_total{kind}``: over every stream: batches and events
    received, gaps seen, batches replayed and lost, publisher restarts, caches cleared,
    silences and undecodable batches. ``prefix_router_kv_events_blocks{host}``: the router
    blocks each engine holds, as its events say.
    ``prefix_router_kv_events_speculative_total{result}``: this router's decisions' blocks
    whose time ran out, confirmed by an event or not.
    """

    STREAM_KINDS = (
        "batches",
        "events",
        "gaps",
        "replayed_batches",
        "lost_batches",
        "restarts",
        "clears",
        "silences",
        "decode_errors",
    )
    STATES = ("precise", "silent", "no_events", "no_tokenizer", "unmatched")

    def __init__(self) -> None:
        self._feed: KvEventsSource | None = None
        REGISTRY.register(self)

    def track(self, feed: KvEventsSource) -> None:
        self._feed = feed

    def describe(self) -> Iterator[Metric]:
        yield Metric("prefix_router_kv_events_hosts", "", "gauge")
        yield Metric("prefix_router_kv_events", "", "counter")
        yield Metric("prefix_router_kv_events_blocks", "", "gauge")
        yield Metric("prefix_router_kv_events_speculative", "", "counter")

    def collect(self) -> Iterator[Metric]:
        feed = self._feed
        hosts = GaugeMetricFamily(
            "prefix_router_kv_events_hosts",
            "Hosts by where the index's view of them comes from",
            labels=["state"],
        )
        states = Counter_(str(s) for s in (feed.states().values() if feed else ()))
        for state in self.STATES:
            hosts.add_metric([state], states.get(state, 0))
        yield hosts
        totals = CounterMetricFamily(
            "prefix_router_kv_events", "KV-event stream counts, over every host", labels=["kind"]
        )
        stats = list(feed.stream_stats().values()) if feed else []
        for kind in self.STREAM_KINDS:
            totals.add_metric([kind], sum(getattr(each, kind, 0) for each in stats))
        yield totals
        blocks = GaugeMetricFamily(
            "prefix_router_kv_events_blocks",
            "Router blocks each engine holds, as its KV events say",
            labels=["host"],
        )
        for host, mirror in feed.mirrors().items() if feed else ():
            blocks.add_metric([host], len(mirror))
        yield blocks
        speculative = CounterMetricFamily(
            "prefix_router_kv_events_speculative",
            "Blocks of this router's decisions whose time ran out, by whether an event "
            "confirmed them",
            labels=["result"],
        )
        views = list(feed.speculation().values()) if feed else []
        speculative.add_metric(["confirmed"], sum(v.confirmed for v in views))
        speculative.add_metric(["unconfirmed"], sum(v.unconfirmed for v in views))
        yield speculative


SHADOW = ShadowAndLive()
KV_EVENTS = KvEventsCollector()
SHADOW_DROPPED = Counter(
    "prefix_router_shadow_dropped",
    "Requests shadow mode left out because its thread was more than 65,536 events behind",
)
SHADOW_SECONDS = Histogram(
    "prefix_router_shadow_seconds",
    "Time each shadow placement took, in shadow mode's thread (off the request path)",
    buckets=(0.00001, 0.00002, 0.00003, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.01),
)
DECISIONS = Counter(
    "prefix_router_decisions",
    "Routing decisions, by strategy and how the primary host was chosen",
    ["strategy", "outcome"],
)
OVERFLOWS = Counter(
    "prefix_router_overflows",
    "Requests whose key's first host was at the concurrency threshold",
    ["strategy"],
)
IN_FLIGHT = PerHostGauge(
    "prefix_router_in_flight_requests",
    "Requests this router has sent to each host that have not finished yet (no series: 0)",
)
COMPLETIONS = Counter(
    "prefix_router_completions",
    "Access-log entries of requests whose streams ended at the decision: completed (this "
    "router's ticket), foreign (another router's, or none), expired (never logged)",
    ["result"],
)
ACCESS_LOG_STREAMS = Gauge(
    "prefix_router_access_log_streams",
    "Envoy access-log streams open to this router (completions are exact while one is)",
)
UNSEEN_DECISIONS = Gauge(
    "prefix_router_unseen_decisions",
    "Decisions whose ext_proc streams ended with them, made while no access-log stream was "
    "open, that the load feed may not show yet; they count toward their hosts' loads",
)
DECISION_SECONDS = Histogram(
    "prefix_router_decision_seconds",
    "Time from receiving the body (or end-of-stream headers) to the routing decision",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
)
KEY_SOURCES = Counter(
    "prefix_router_key_sources",
    "Routing keys by source; native_fallback and encoded_fallback mean an unparsed body",
    ["source"],
)
SALT_REJECTED = Counter(
    "prefix_router_salt_rejected",
    "Tenant salts ignored for being empty, over 64 characters or not printable ASCII",
    ["source"],
)
SHED = Counter(
    "prefix_router_shed",
    "Requests decided on their headers alone, the least loaded host (in epp mode: answered "
    "429), because the router's event loop ran further behind than shed_lag_s or "
    "shed_backlog streams were waiting for a decision",
)
UNDECIDED = Gauge(
    "prefix_router_undecided_streams",
    "ext_proc streams open and not yet decided: past shed_backlog, new ones are shed",
)
LOOP_LAG = Gauge(
    "prefix_router_event_loop_lag_seconds",
    "How late the router's event loop woke, the second worst of its last wake-ups (one late "
    "wake-up is a pause): every ext_proc "
    "message waits this long and more",
)
REFUSED = Counter(
    "prefix_router_refused",
    "Requests the router answered itself instead of routing, by reason (body_too_large: "
    "413, the body is over max_body_bytes; no_eligible_endpoint: 503, nothing in an "
    "endpoint-picker gateway's subset hint is eligible; shed: 429 in epp mode, see "
    "prefix_router_shed)",
    ["reason"],
)
SERVED_ELSEWHERE = Counter(
    "prefix_router_served_elsewhere",
    "Requests an endpoint-picker gateway reports as served by another endpoint than the "
    "one picked (a retry or its fallback); they count there instead",
)
TRAFFIC_LOG_DROPPED = Counter(
    "prefix_router_traffic_log_dropped",
    "Traffic-log records dropped because the writer thread was far behind (the request "
    "was routed as usual)",
)
FALLBACKS = Counter(
    "prefix_router_fallbacks",
    "Requests the router could not place and left to Envoy's fallback, by reason",
    ["reason"],
)
PROTOCOL_ERRORS = Counter(
    "prefix_router_protocol_errors",
    "ext_proc messages that arrived out of order or were of an unexpected kind",
    ["kind"],
)
PREFIX_MATCHED = Histogram(
    "prefix_router_prefix_matched_ratio",
    "PREFIX_AWARE (longest match): share of the prompt the chosen host already held, as the "
    "prefix index saw it; the router's estimate of the hit rate",
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
)
PROMPT_BYTES = Counter(
    "prefix_router_prompt_bytes",
    "PREFIX_AWARE (longest match): bytes of prompt routed, up to match_depth_chars",
)
MATCHED_BYTES = Counter(
    "prefix_router_matched_bytes",
    "PREFIX_AWARE (longest match): of those, the bytes the chosen host already held, as the "
    "prefix index saw it; matched / prompt is the index's estimate of the hit rate",
)
INDEX_BLOCKS = Gauge("prefix_router_index_blocks", "Blocks the prefix index holds, over all hosts")
POPULARITY_KEYS = Gauge(
    "prefix_router_popularity_keys",
    "Block counters the prefix popularity windows hold (at most twice their max_keys)",
)
INDEX_CAPACITY = Gauge(
    "prefix_router_index_capacity_blocks",
    "Blocks the prefix index may hold over the hosts it places over: each host's engine "
    "cache, all within index_max_blocks",
)
INDEX_EVICTED = Counter(
    "prefix_router_index_evicted_blocks",
    "Blocks the prefix index forgot, by reason: capacity (LRU, as the engine's cache would), "
    "host_left, host_reset (restart or cache cleared)",
    ["reason"],
)
STREAMS = Gauge("prefix_router_open_streams", "ext_proc streams open now")
HOSTS = Gauge("prefix_router_hosts", "Hosts in the set the router places over")

# --- load feed and fleet, as the router sees them
FEED_AGE = Gauge(
    "prefix_router_load_feed_age_seconds",
    "Seconds since the last load-feed update arrived from the control plane",
)
FEED_STALE = Counter(
    "prefix_router_load_feed_stale",
    "Decisions made on local in-flight counts only, because the load feed was stale",
)
FLEET_UPDATES = Counter(
    "prefix_router_fleet_updates", "Host-set and load updates received", ["kind"]
)
CONTROL_PLANE_CONNECTED = Gauge(
    "prefix_router_control_plane_connected",
    "1 while the router's xDS stream to the control plane is up and has delivered the "
    "fleet; 0 while it reconnects (the router places over the last set it received)",
)

# --- decisions shared with sibling routers (adapter/decision_exchange.py)
DECISIONS_PUBLISHED = Counter(
    "prefix_router_decisions_published",
    "Decisions this router sent its sibling routers (workers_share_decisions, or "
    "decision_exchange_bind)",
)
SIBLING_DECISIONS_APPLIED = Counter(
    "prefix_router_sibling_decisions_applied",
    "Sibling routers' decisions recorded in this router's prefix index",
)
SIBLING_DECISIONS_DROPPED = Counter(
    "prefix_router_sibling_decisions_dropped",
    "Decisions shared between sibling routers that were lost or refused, by reason: "
    "unknown_host (a host outside this router's host set), malformed (a message this "
    "version cannot read), settings (the sender's block_bytes or key_mode differ: a reload "
    "half applied), lost (a gap in a sender's sequence: a full queue between the two), "
    "send_full (this router's own, its send queue full)",
    ["reason"],
)
