"""The runtime's HTTP client, for its requests to vLLM hosts: the control plane's health
probes and /metrics scrapes, and the router's KV-event discovery.

One client serves a loop (or a round) of requests, so its pool keeps one connection per
host between rounds. Each caller bounds its requests in total with ``asyncio.timeout``:
httpx's own timeouts are per phase (connect, each read), so a host that trickles its body
could outlast them (encode/httpx#776, #1450).
"""

from __future__ import annotations

import httpx

# A connection per host, kept between rounds as aiohttp's connector (the client before this
# one) kept them: up to 100, every one of them kept when idle, for 15 s. httpx's default
# keeps 20 idle for 5 s, so a larger fleet, or a slower round, would reconnect each round.
_POOL = httpx.Limits(max_connections=100, max_keepalive_connections=100, keepalive_expiry=15.0)


def host_client() -> httpx.AsyncClient:
    """A client for requests to the fleet's hosts.

    ``trust_env=False``: the hosts are reached directly, never through a proxy that
    HTTP_PROXY or ALL_PROXY name for the process's other traffic. ``timeout=None``: the
    callers' total bounds each request, and no per-phase default (5 s) cuts a longer one
    short. Redirects are not followed (httpx's default): a probe answers for its own host.
    """
    return httpx.AsyncClient(trust_env=False, timeout=None, limits=_POOL)
