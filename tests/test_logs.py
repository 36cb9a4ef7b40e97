"""Log lines a client can cause are rate-limited, and the rest counted."""

from __future__ import annotations

import pytest
import structlog
from prometheus_client import REGISTRY

from extproc.logs import CLIENT_EVENTS_PER_S, RateLimitClientEvents


def suppressed(event: str) -> float:
    sample = REGISTRY.get_sample_value("prefix_router_log_lines_suppressed_total", {"event": event})
    return sample or 0.0


def written(processor: RateLimitClientEvents, event: str, times: int) -> int:
    count = 0
    for n in range(times):
        try:
            processor(None, "warning", {"event": event, "n": n})
        except structlog.DropEvent:
            continue
        count += 1
    return count


def test_a_flood_of_client_caused_events_writes_a_few_lines_and_counts_the_rest():
    processor = RateLimitClientEvents()
    before = suppressed("salt_rejected")
    lines = written(processor, "salt_rejected", 1000)
    # One window, or two if the loop crossed a second's boundary.
    assert CLIENT_EVENTS_PER_S <= lines <= 2 * CLIENT_EVENTS_PER_S
    assert suppressed("salt_rejected") == before + 1000 - lines
    # Each event has its own budget, and events no client causes are never dropped.
    assert written(processor, "internal_error", 5) == 5
    assert written(processor, "fleet_updated", 1000) == 1000


@pytest.mark.parametrize("event", ["salt_rejected", "internal_error", "no_hosts"])
def test_every_client_caused_event_is_limited(event: str):
    assert written(RateLimitClientEvents(), event, 100) <= 2 * CLIENT_EVENTS_PER_S
