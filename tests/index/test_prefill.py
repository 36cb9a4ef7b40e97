"""Pending prefill: each host's queue of prompt bytes still to prefill, drained at a rate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.index.prefill import PendingPrefill


def test_a_queue_drains_at_the_rate_and_is_dropped_once_empty():
    queues = PendingPrefill(drain_bytes_per_s=1000)
    queues.add("a", 1500, now=10.0)
    assert queues.snapshot(10.0) == {"a": 1500}
    assert queues.snapshot(11.0) == {"a": 500}
    assert queues.snapshot(11.5) == {}
    assert len(queues) == 0


def test_work_queued_behind_work_waits_for_it():
    queues = PendingPrefill(drain_bytes_per_s=1000)
    queues.add("a", 1000, now=0.0)
    queues.add("a", 1000, now=0.5)  # half of the first is done
    queues.add("b", 200, now=0.5)
    assert queues.snapshot(0.5) == {"a": 1500, "b": 200}
    assert queues.snapshot(1.0) == {"a": 1000}


def test_nothing_to_prefill_queues_nothing():
    queues = PendingPrefill(drain_bytes_per_s=1000)
    queues.add("a", 0, now=0.0)
    queues.add("a", -5, now=0.0)
    assert queues.snapshot(0.0) == {}


def test_hosts_that_leave_lose_their_queues():
    queues = PendingPrefill(drain_bytes_per_s=1000)
    queues.add("a", 1000, now=0.0)
    queues.add("b", 1000, now=0.0)
    queues.retain(["b"])
    assert set(queues.snapshot(0.0)) == {"b"}
    queues.clear()
    assert queues.snapshot(0.0) == {}


def test_a_rate_must_be_positive():
    with pytest.raises(ValueError, match="drain_bytes_per_s"):
        PendingPrefill(0)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 10_000), st.floats(0, 2))))
def test_a_queue_never_exceeds_what_was_added_nor_goes_negative(events):
    queues = PendingPrefill(drain_bytes_per_s=5000)
    now = 0.0
    added: dict[str, float] = {}
    for host, size, step in events:
        now += step
        queues.add(host, size, now)
        added[host] = added.get(host, 0) + size
        for queued_host, left in queues.snapshot(now).items():
            assert 0 < left <= added[queued_host]
