"""Decisions handed to the load feed: counted until a scrape of their host began after them."""

from __future__ import annotations

from extproc.adapter.unseen import UnseenDecisions

A = "127.0.0.11:8000"
B = "127.0.0.12:8000"


def test_a_decision_counts_until_a_scrape_of_its_host_begins_after_it() -> None:
    unseen = UnseenDecisions(max_age_s=10)
    unseen.add(A, now=1.0)
    unseen.add(B, now=1.5)
    unseen.add(A, now=2.0)
    assert dict(unseen.counts(2.0)) == {A: 2, B: 1}
    # A scrape that began at 1.8 holds the first decision on A, not the one at 2.0.
    unseen.scraped(A, since=1.8)
    assert dict(unseen.counts(2.1)) == {A: 1, B: 1}
    # Another host's scrape says nothing of A.
    unseen.scraped(B, since=2.5)
    assert dict(unseen.counts(2.6)) == {A: 1}
    unseen.scraped(A, since=2.5)
    assert dict(unseen.counts(2.6)) == {}
    assert unseen.total() == 0


def test_without_a_feed_decisions_expire_by_age() -> None:
    unseen = UnseenDecisions(max_age_s=2)
    for moment in (0.0, 0.5, 1.0, 1.5):
        unseen.add(A, now=moment)
    assert dict(unseen.counts(1.9)) == {A: 4}
    assert dict(unseen.counts(2.6)) == {A: 2}
    assert dict(unseen.counts(10.0)) == {}
    assert unseen.total() == 0


def test_a_scrape_of_a_host_with_no_decisions_is_harmless() -> None:
    unseen = UnseenDecisions(max_age_s=1)
    unseen.scraped(A, since=5.0)
    assert dict(unseen.counts(5.0)) == {}
