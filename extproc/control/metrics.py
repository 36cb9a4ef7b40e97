"""The control plane's own series (``prefix_router_cp_*``), declared in one place; the few
it shares with the router (config reloads, suppressed log lines) are in
``extproc/metrics.py``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

XDS_STREAMS = Gauge("prefix_router_cp_xds_streams", "Open xDS streams")
XDS_REQUESTS = Counter(
    "prefix_router_cp_xds_requests",
    "xDS requests by kind (initial, ack, stale_nonce, ...)",
    ["kind"],
)
XDS_RESPONSES = Counter("prefix_router_cp_xds_responses", "xDS responses sent")
XDS_NACKS = Counter("prefix_router_cp_xds_nacks", "xDS responses rejected by a client")
CP_HOSTS = Gauge("prefix_router_cp_hosts", "Hosts known to the control plane, by state", ["state"])
CP_PLACEMENT_WEIGHT = Gauge(
    "prefix_router_cp_placement_weight",
    "Weight new prefixes are placed with, per host, from its cache pressure (1: even)",
    ["host"],
)
CP_PROMPT_RATE = Gauge(
    "prefix_router_cp_prompt_tokens_per_second",
    "Prompt tokens each host takes in, smoothed: its cache pressure",
    ["host"],
)
CP_EJECTIONS = Counter("prefix_router_cp_ejections", "Hosts ejected by health checks")
CP_HEALTH_HOLDS = Counter(
    "prefix_router_cp_health_holds",
    "Health rounds in which every host failed and the healthy ones were kept (fail static)",
)
CP_SCRAPE_FAILURES = Counter(
    "prefix_router_cp_scrape_failures", "Failed /metrics scrapes of vLLM hosts"
)
CP_PUBLISHES = Counter(
    "prefix_router_cp_snapshots_published", "Snapshots published, by kind", ["kind"]
)
