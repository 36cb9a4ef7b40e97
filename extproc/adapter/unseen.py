"""Decisions whose ext_proc streams ended before their requests did, until the feed shows them.

In STREAMED body mode (and with ``stream_end: decision``) a request's stream ends with its
decision, so the stream no longer says when the request finishes. A host's load is then
the load feed (vLLM's running + waiting) plus the decisions this router made that the feed
cannot show yet: those made after the host's last scrape began. A decision never counts
longer than ``max_age_s``, so nothing piles up while the feed is stale or missing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


class UnseenDecisions:
    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._decided: dict[str, deque[float]] = {}

    def add(self, host: str, now: float) -> None:
        self._decided.setdefault(host, deque()).append(now)

    def scraped(self, host: str, since: float) -> None:
        """``host``'s scrape began at ``since``: decisions before then are in it (or done)."""
        times = self._decided.get(host)
        if times is not None:
            self._expire(host, times, since)

    def counts(self, now: float) -> Mapping[str, int]:
        """Per host, decisions the feed may not show yet (hosts with none are absent)."""
        oldest = now - self.max_age_s
        for host, times in list(self._decided.items()):
            self._expire(host, times, oldest)
        return {host: len(times) for host, times in self._decided.items()}

    def total(self) -> int:
        return sum(len(times) for times in self._decided.values())

    def _expire(self, host: str, times: deque[float], before: float) -> None:
        while times and times[0] < before:
            times.popleft()
        if not times:
            del self._decided[host]
