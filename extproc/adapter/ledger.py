"""Every host's load as this router knows it: its own requests and the fleet's load feed.

The ledger produces the load snapshots the strategies read (``loads``, ``placement_weights``)
and owns what they are made of: this router's requests in flight (``inflight.py``), those
whose streams ended with their decisions (``completions.py`` while Envoy's access log
reports them, ``unseen.py`` otherwise), and the control plane's last load feed. It takes
the time from its caller and knows nothing of the index, the shadow or the strategies.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.adapter import metrics
from extproc.adapter.completions import Completions
from extproc.adapter.inflight import InFlight
from extproc.adapter.unseen import UnseenDecisions
from extproc.control.model import HostLoad
from extproc.picker.decide import Strategy
from extproc.picker.hosts import HostSet
from extproc.picker.strategy import NO_WEIGHTS

# A handed-off request whose completion Envoy never logged stops counting after this.
COMPLETION_MAX_AGE_S = 900.0


class LoadLedger:
    def __init__(self, feed_max_age_s: float, fed: bool) -> None:
        # Older than this, the feed is stale: loads fall back to the local counts.
        self.feed_max_age_s = feed_max_age_s
        # Whether a control plane feeds loads at all (without one, none ever comes).
        self.fed = fed
        self.in_flight = InFlight()
        # Decisions whose streams ended with them (STREAMED bodies, stream_end: decision),
        # until the load feed shows them.
        self.unseen = UnseenDecisions(feed_max_age_s)
        # The same, counted exactly while Envoy's access log reports completions.
        self.completions = Completions(COMPLETION_MAX_AGE_S)
        self._feed: Mapping[str, HostLoad] = {}
        self._feed_received_at: float | None = None

    def configure(self, feed_max_age_s: float, fed: bool) -> None:
        """A new config's feed settings (hot reload); the counts carry over."""
        self.feed_max_age_s = self.unseen.max_age_s = feed_max_age_s
        self.fed = fed

    def acquire(self, host: str) -> None:
        """A request was placed on ``host``: it is in flight there until released."""
        self.in_flight.acquire(host)

    def release(self, host: str) -> None:
        self.in_flight.release(host)

    def hand_off(self, host: str, now: float) -> str | None:
        """The stream of a request in flight on ``host`` closes before the request ends.

        With Envoy's access log connected, the request stays in flight until its log entry
        brings back the returned ticket (``complete``). Without it, the load feed carries
        the request, and until the feed can show it, the unseen count."""
        if self.completions.available:
            for expired in self.completions.expire(now):
                self.in_flight.release(expired)
                metrics.COMPLETIONS.labels("expired").inc()
            return self.completions.issue(host, now)
        self.in_flight.release(host)
        self.unseen.add(host, now)
        return None

    def complete(self, ticket: str) -> bool:
        """Envoy logged the request of ``ticket`` done; False if it is not this router's."""
        host = self.completions.complete(ticket)
        if host is None:
            return False
        self.in_flight.release(host)
        return True

    def set_feed(self, loads: Mapping[str, HostLoad], now: float, wall_now: float) -> None:
        """A new load feed, received at ``now`` (this process's clock) and ``wall_now``."""
        self._feed = loads
        self._feed_received_at = now
        # Each host's scrape start, in this process's clock: the feed stamps wall time.
        for address, load in loads.items():
            self.unseen.scraped(address, now - max(0.0, wall_now - load.scraped_at))

    @property
    def feed(self) -> Mapping[str, HostLoad]:
        """The last load feed: each host's load and vLLM counters."""
        return self._feed

    def feed_age(self, now: float) -> float:
        if self._feed_received_at is None:
            return float("inf")
        return now - self._feed_received_at

    def loads(self, strategy: Strategy, hosts: HostSet, now: float) -> Mapping[str, int | float]:
        """Local in-flight counts, raised to the fleet-wide figure while the feed is fresh.

        The feed counts every router's requests but is up to one scrape old; the local
        count is exact for this router's own. The larger of the two is the safer bound.
        Decisions whose streams closed at once count on top of the feed until it shows
        them; without a fresh feed they count on top of the local figure. RANDOM reads
        the local counts alone. ``hosts``: those the fresh feed's figures are given for.
        """
        local = self.in_flight.snapshot()
        if strategy is Strategy.RANDOM:
            return local
        unseen = self.unseen.counts(now)
        fresh = self.fed
        if fresh and self.feed_age(now) > self.feed_max_age_s:
            metrics.FEED_STALE.inc()
            fresh = False
        if not fresh:
            if not unseen:
                return local
            return {
                address: local.get(address, 0) + unseen.get(address, 0)
                for address in local.keys() | unseen.keys()
            }
        feed = self._feed
        return {
            host.address: max(
                local.get(host.address, 0),
                (feed[host.address].outstanding if host.address in feed else 0)
                + unseen.get(host.address, 0),
            )
            for host in hosts.hosts
        }

    def placement_weights(self, hosts: HostSet, now: float) -> Mapping[str, float]:
        """The control plane's placement weights (cache pressure) from a fresh load feed;
        all equal (none) without one. A host missing from the last round weighs 1."""
        feed = self._feed
        if not feed or self.feed_age(now) > self.feed_max_age_s:
            return NO_WEIGHTS
        return {
            h.address: feed[h.address].placement_weight if h.address in feed else 1.0
            for h in hosts.hosts
        }
