"""The load ledger on its own: in-flight counts, hand-offs, the feed and the loads it gives,
with the time passed in and no router."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from extproc.adapter.ledger import COMPLETION_MAX_AGE_S, LoadLedger
from extproc.control.model import HostLoad
from extproc.picker.decide import Strategy
from extproc.picker.hosts import HostSet

A = "127.0.0.61:8000"
B = "127.0.0.62:8000"
C = "127.0.0.63:8000"
HOSTS = HostSet.of((A, B, C))
MAX_AGE_S = 2.0
LEAST = Strategy.LEAST_OUTSTANDING_REQUESTS


def feed_stale() -> float:
    return REGISTRY.get_sample_value("prefix_router_load_feed_stale_total") or 0.0


def expired_completions() -> float:
    sample = REGISTRY.get_sample_value("prefix_router_completions_total", {"result": "expired"})
    return sample or 0.0


def test_acquire_and_release_count_in_flight() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=False)
    ledger.acquire(A)
    ledger.acquire(A)
    ledger.acquire(B)
    assert ledger.in_flight.snapshot() == {A: 2, B: 1}
    ledger.release(A)
    ledger.release(B)
    assert ledger.in_flight.snapshot() == {A: 1}
    assert ledger.loads(LEAST, HOSTS, now=0.0) == {A: 1}


def test_a_hand_off_without_an_access_log_moves_the_request_to_the_unseen_count() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=False)
    ledger.acquire(A)
    assert ledger.hand_off(A, now=10.0) is None
    assert ledger.in_flight.total() == 0
    assert ledger.unseen.total() == 1
    # Without a feed it counts on top of the local figure until it ages out.
    assert dict(ledger.loads(LEAST, HOSTS, now=10.5)) == {A: 1}
    assert dict(ledger.loads(LEAST, HOSTS, now=10.0 + MAX_AGE_S + 0.1)) == {}


def test_a_hand_off_with_an_access_log_keeps_the_request_until_its_ticket_returns() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=False)
    ledger.completions.streams = 1
    ledger.acquire(A)
    ticket = ledger.hand_off(A, now=10.0)
    assert ticket is not None
    assert ledger.in_flight.snapshot() == {A: 1}
    assert ledger.unseen.total() == 0
    assert not ledger.complete("another-router-1")
    assert ledger.complete(ticket)
    assert not ledger.complete(ticket)  # a duplicate log entry
    assert ledger.in_flight.total() == 0


def test_a_ticket_never_logged_is_released_at_a_later_hand_off() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=False)
    ledger.completions.streams = 1
    ledger.acquire(A)
    assert ledger.hand_off(A, now=0.0) is not None
    expired = expired_completions()
    ledger.acquire(B)
    ledger.hand_off(B, now=COMPLETION_MAX_AGE_S + 1)
    assert ledger.in_flight.snapshot() == {B: 1}
    assert expired_completions() == expired + 1


def test_feed_age_is_infinite_until_the_first_feed() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=True)
    assert ledger.feed_age(now=5.0) == float("inf")
    ledger.set_feed({A: HostLoad(running=1)}, now=5.0, wall_now=5.0)
    assert ledger.feed_age(now=5.5) == pytest.approx(0.5)
    assert ledger.feed == {A: HostLoad(running=1)}


def test_a_fresh_feed_raises_the_local_count_to_the_fleets() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=True)
    ledger.acquire(A)
    ledger.acquire(A)
    ledger.acquire(B)
    ledger.set_feed({A: HostLoad(running=1), B: HostLoad(running=2, waiting=1)}, 10.0, 10.0)
    # The larger of the two per host; every host listed, C (in no feed, no count) at 0.
    assert dict(ledger.loads(LEAST, HOSTS, now=10.5)) == {A: 2, B: 3, C: 0}
    # RANDOM reads the local counts alone.
    assert dict(ledger.loads(Strategy.RANDOM, HOSTS, now=10.5)) == {A: 2, B: 1}


def test_a_stale_feed_is_counted_and_ignored() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=True)
    ledger.acquire(A)
    ledger.set_feed({A: HostLoad(running=7)}, now=10.0, wall_now=10.0)
    stale = feed_stale()
    assert dict(ledger.loads(LEAST, HOSTS, now=10.0 + MAX_AGE_S + 0.1)) == {A: 1}
    assert feed_stale() == stale + 1
    # Without a control plane there is no feed to be stale.
    unfed = LoadLedger(MAX_AGE_S, fed=False)
    unfed.loads(LEAST, HOSTS, now=100.0)
    assert feed_stale() == stale + 1


def test_a_handed_off_decision_counts_on_the_feed_until_a_scrape_after_it() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=True)
    ledger.set_feed({A: HostLoad(running=1, scraped_at=9.9)}, now=10.0, wall_now=10.0)
    ledger.acquire(A)
    ledger.hand_off(A, now=10.2)
    assert ledger.loads(LEAST, HOSTS, now=10.3)[A] == 2
    # A scrape that began before the decision (wall 10.1) does not hold it...
    ledger.set_feed({A: HostLoad(running=1, scraped_at=10.1)}, now=10.4, wall_now=10.4)
    assert ledger.loads(LEAST, HOSTS, now=10.5)[A] == 2
    # ...one that began after it (wall 10.3) does.
    ledger.set_feed({A: HostLoad(running=2, scraped_at=10.3)}, now=10.6, wall_now=10.6)
    assert ledger.loads(LEAST, HOSTS, now=10.7)[A] == 2
    assert ledger.unseen.total() == 0


def test_placement_weights_come_from_a_fresh_feed_only() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=True)
    assert ledger.placement_weights(HOSTS, now=0.0) == {}
    ledger.set_feed({A: HostLoad(placement_weight=0.5)}, now=10.0, wall_now=10.0)
    # A host missing from the last round weighs 1.
    assert ledger.placement_weights(HOSTS, now=11.0) == {A: 0.5, B: 1.0, C: 1.0}
    assert ledger.placement_weights(HOSTS, now=10.0 + MAX_AGE_S + 0.1) == {}


def test_configure_changes_the_feeds_age_limit_and_keeps_the_counts() -> None:
    ledger = LoadLedger(MAX_AGE_S, fed=False)
    ledger.acquire(A)
    ledger.hand_off(A, now=0.0)
    ledger.acquire(B)
    ledger.configure(feed_max_age_s=10.0, fed=True)
    assert ledger.unseen.max_age_s == 10.0
    assert ledger.in_flight.snapshot() == {B: 1}
    # The handed-off decision now counts for the new limit, 10 s, not the old 2 s.
    assert dict(ledger.unseen.counts(5.0)) == {A: 1}
