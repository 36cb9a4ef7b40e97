"""Router replicas that share decisions (sidecar routers, picker replicas): the settings
and prompts their tests place with, and waiting for the exchange to connect.

A ZMQ publisher drops what it sends before a subscriber has joined, and a subscriber
whose peer was not listening yet retries with a backoff of up to a second, so a replica's
first decisions after a start may never reach its sibling (the engines' KV events stay
the source of truth in production). Tests that count the exchanged decisions wait until
each endpoint has accepted its sibling's connection first."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from extproc.stack.local import INSTANT_PREFILL
from extproc.stack.processes import wait_until

from ..reliability.stacks import NEVER_SHED

# One request in flight fills a host: the next new prompt overflows to its next host.
# No balance bound, no prefill queue (the simulators answer at once), no KV events: a
# replica learns a sibling's placement from the exchange or not at all.
ROUTING: dict[str, Any] = {
    "concurrency_threshold": 1,
    "balance_factor": None,
    "kv_events": False,
    **INSTANT_PREFILL,
    **NEVER_SHED,  # a shed request would leave the oracle's decisions
}
PUBLISHED = "prefix_router_decisions_published_total"
APPLIED = "prefix_router_sibling_decisions_applied_total"


def filler(n: int) -> str:
    return f"filler {n}: " + "a held request that keeps its host busy " * 40


def held_on(placement_order: Callable[[str], Sequence[str]], home: str, doc: int) -> str:
    """A prompt new to replica A that A places on ``home`` (``placement_order``: where an
    unshared replica sends a new prompt at an idle fleet); each filler has one chance in
    three."""
    for n in range(100 * doc, 100 * doc + 100):
        if placement_order(filler(n))[0] == home:
            return filler(n)
    raise AssertionError(f"no filler of 100 placed on {home}")


def subscribers(port: int) -> int:
    """Established connections accepted on ``port`` (a replica's exchange endpoint)."""
    argv = ["ss", "-Htn", "state", "established", f"( sport = :{port} )"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
    return len(out.stdout.splitlines())


def wait_for_subscribers(endpoints: Iterable[str], timeout_s: float = 30) -> None:
    """Every ``tcp://ip:port`` endpoint has a subscriber connected."""
    for endpoint in endpoints:
        port = int(endpoint.rpartition(":")[2])
        wait_until(
            lambda p=port: subscribers(p) > 0,
            timeout_s,
            what=f"the sibling to subscribe on {endpoint}",
        )
