"""structlog set-up: one JSON object per line on stderr.

A client can make some events happen once per request (a rejected salt, a request that
trips a bug, an empty fleet): each of those is written at most ``CLIENT_EVENTS_PER_S``
times a second per process, and the rest are counted in
``prefix_router_log_lines_suppressed_total{event}``, so no client can flood the logs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import FixedWindowRateLimiter

from extproc import metrics

# Events one request can cause; every other event is written whatever its rate.
CLIENT_TRIGGERED_EVENTS = frozenset(
    {"salt_rejected", "internal_error", "no_hosts", "protocol_error"}
)
CLIENT_EVENTS_PER_S = 10


class RateLimitClientEvents:
    """A structlog processor: drops a client-triggered event past its rate, counted."""

    def __init__(self, per_second: int = CLIENT_EVENTS_PER_S) -> None:
        self._limiter = FixedWindowRateLimiter(MemoryStorage())
        self._limit = RateLimitItemPerSecond(per_second)

    def __call__(
        self, logger: Any, method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        event = event_dict.get("event")
        if event in CLIENT_TRIGGERED_EVENTS and not self._limiter.hit(self._limit, event):
            metrics.LOG_LINES_SUPPRESSED.labels(event).inc()
            raise structlog.DropEvent
        return event_dict


def configure(level: str = "info") -> None:
    structlog.configure(
        processors=[
            RateLimitClientEvents(),
            # Fields bound for the whole process, e.g. a router worker's index.
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
