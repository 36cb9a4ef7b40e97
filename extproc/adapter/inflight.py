"""Requests in flight per host, counted from the routing decision to the stream's end.

Envoy keeps the ext_proc stream open for the whole HTTP request and closes it when the
response completes or the client aborts, so releasing on stream end is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from extproc.adapter import metrics


class InFlight:
    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        # The gauge reads these counts when scraped (the latest InFlight made is served).
        metrics.IN_FLIGHT.track(self._counts)

    def acquire(self, host: str) -> None:
        self._counts[host] = self._counts.get(host, 0) + 1

    def release(self, host: str) -> None:
        count = self._counts.get(host, 0) - 1
        if count > 0:
            self._counts[host] = count
            return
        # Idle hosts have no series (absent means 0), so hosts that leave the fleet,
        # e.g. autoscaled ones with fresh addresses, leave nothing behind.
        self._counts.pop(host, None)

    def snapshot(self) -> Mapping[str, int]:
        """A read-only view: the picker reads it, only acquire/release change it."""
        return MappingProxyType(self._counts)

    def total(self) -> int:
        return sum(self._counts.values())
