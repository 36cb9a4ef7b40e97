"""HTTP/2 keepalive on every gRPC link: Envoy to the routers (ext_proc and the completion
log), Envoy to the control plane (ADS), and each router to the control plane.

Without it a peer that stops answering (frozen, partitioned, a half-open connection after
a crash behind NAT) keeps its connection until the kernel gives up, about two hours later:
Envoy keeps the streams on it, a router keeps counting them in flight, and a router keeps a
host set it can no longer refresh. With it the silent peer is found within
``PING_INTERVAL_S + PING_TIMEOUT_S``.
"""

from __future__ import annotations

from typing import Any

# How often the client side of a link pings when idle or not, and how long it waits for
# the answer before it closes the connection.
PING_INTERVAL_S = 10
PING_TIMEOUT_S = 5
# A server accepts pings this often (well under PING_INTERVAL_S) with no data in between,
# and never answers a client's pings with GOAWAY too_many_pings (gRPC's default after
# two pings within five minutes), which would close Envoy's connection every few pings.
MIN_PING_INTERVAL_S = 1


def _pings() -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", PING_INTERVAL_S * 1000),
        ("grpc.keepalive_timeout_ms", PING_TIMEOUT_S * 1000),
        # gRPC 1.85 waits this long for a ping's ack, whatever keepalive_timeout says
        # (its default is a minute).
        ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_S * 1000),
    ]


def server_options() -> list[tuple[str, int]]:
    """grpc.aio server options: accept the clients' pings, and ping idle clients too."""
    return [
        *_pings(),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_S * 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def channel_options() -> list[tuple[str, int]]:
    """grpc.aio channel options for a long-lived stream (the router's ADS subscription)."""
    return [
        *_pings(),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def envoy_keepalive() -> dict[str, Any]:
    """Envoy's ``http2_protocol_options.connection_keepalive`` for its gRPC clusters."""
    return {"interval": f"{PING_INTERVAL_S}s", "timeout": f"{PING_TIMEOUT_S}s"}
