"""Prompt text each host still has to prefill for this router's recent decisions.

An engine prefills the uncached part of its prompts first come, first served, at about a
constant rate, and a request's first token waits for the prefill queued ahead of it. So
each decision adds the bytes its host lacks (the prompt's length past the matched blocks)
to that host's queue, and the queue drains at ``drain_bytes_per_s`` (the engine's prefill
rate in prompt characters). A host that has just taken two cold documents has a long
queue, and the decision weighs it like prefill of its own: a burst of new prompts spreads
over idle hosts instead of stacking on the one their hashes share, while a host whose
queue has drained costs nothing more.

It only knows this router's own decisions; the load feed carries everyone's requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class PendingPrefill:
    def __init__(self, drain_bytes_per_s: float) -> None:
        if drain_bytes_per_s <= 0:
            raise ValueError("drain_bytes_per_s must be positive")
        self.drain_bytes_per_s = drain_bytes_per_s
        # host -> (bytes queued, as of this time)
        self._queues: dict[str, tuple[float, float]] = {}

    def add(self, host: str, uncached_bytes: float, now: float) -> None:
        if uncached_bytes <= 0:
            return
        self._queues[host] = (self._left(host, now) + uncached_bytes, now)

    def snapshot(self, now: float) -> Mapping[str, float]:
        """Bytes still queued on each host with any; drained queues are dropped."""
        queued = {}
        for host in list(self._queues):
            left = self._left(host, now)
            if left > 0:
                queued[host] = left
            else:
                del self._queues[host]
        return queued

    def retain(self, hosts: Iterable[str]) -> None:
        keep = set(hosts)
        for host in [h for h in self._queues if h not in keep]:
            del self._queues[host]

    def clear(self) -> None:
        self._queues.clear()

    def __len__(self) -> int:
        return len(self._queues)

    def _left(self, host: str, now: float) -> float:
        queued, as_of = self._queues.get(host, (0.0, now))
        return max(0.0, queued - max(0.0, now - as_of) * self.drain_bytes_per_s)
