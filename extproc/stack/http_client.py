"""The harness's one HTTP client for the local stack's own endpoints (Envoy's admin
interface, /metrics, /health): httpx's synchronous client, shared by the process.

Each request goes on a connection of its own, closed after the response, and follows no
redirect; any answer but 2xx raises ``httpx.HTTPStatusError``. So every failure, no
answer or a wrong one, is an ``httpx.HTTPError``: what ``wait_until`` counts as "not yet".
"""

from __future__ import annotations

import functools
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx


@functools.cache
def _client() -> httpx.Client:
    # One client, not one per request: building a client's TLS context (certifi's CAs)
    # takes some 50 ms, against 1 to 2 ms for a request on loopback, and the stack polls
    # every 50 ms. No kept-alive connections, as with urllib before: a new connection per
    # request is what spreads requests over Envoy's workers (open_completion_logs), and no
    # idle socket is held to a process the stack stops or restarts. A jar that takes no
    # cookie: no request carries what an earlier response set.
    return httpx.Client(
        limits=httpx.Limits(max_keepalive_connections=0),
        cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])),
    )


def get(url: str, timeout_s: float) -> httpx.Response:
    """GET ``url``; raises ``httpx.HTTPError`` when it does not answer within ``timeout_s``
    (each of connect, write and read) or answers other than 2xx."""
    return _client().get(url, timeout=timeout_s).raise_for_status()


def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> httpx.Response:
    """POST ``body`` to ``url``; raises as ``get`` does."""
    return _client().post(url, content=body, headers=headers, timeout=timeout_s).raise_for_status()
