"""Every metric the router exports, declared in one place.

Every fallback, overflow and protocol error increments one of these.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
IN_FLIGHT = Gauge(
    "prefix_router_in_flight_requests",
    "Requests this router has sent to each host that have not finished yet",
    ["host"],
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
STREAMS = Gauge("prefix_router_open_streams", "ext_proc streams open now")
HOSTS = Gauge("prefix_router_hosts", "Hosts in the set the router places over")
