"""Waiting for router replicas' decision exchange to connect.

A ZMQ publisher drops what it sends before a subscriber has joined, and a subscriber
whose peer was not listening yet retries with a backoff of up to a second, so a replica's
first decisions after a start may never reach its sibling (the engines' KV events stay
the source of truth in production). Tests that count the exchanged decisions wait until
each endpoint has accepted its sibling's connection first."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable

from extproc.stack.processes import wait_until


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
