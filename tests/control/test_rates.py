"""Prompt-token rates per host, smoothed from the load feed's counters and clock."""

from __future__ import annotations

from extproc.control.model import HostLoad
from extproc.control.rates import PromptRates

A, B = "127.0.0.1:8000", "127.0.0.2:8000"


def feed(at: float, queries: dict[str, float]) -> dict[str, HostLoad]:
    return {h: HostLoad(prefix_cache_queries=q, scraped_at=at) for h, q in queries.items()}


def test_rates_converge_to_the_counters_slope():
    rates = PromptRates(time_constant_s=5)
    assert rates.update(feed(0, {A: 0, B: 0})) == {}  # one round says nothing yet
    for second in range(1, 61):
        smoothed = rates.update(feed(second, {A: 3000 * second, B: 500 * second}))
    assert abs(smoothed[A] - 3000) < 1 and abs(smoothed[B] - 500) < 1


def test_a_repeated_round_changes_nothing_and_a_restart_starts_from_zero():
    rates = PromptRates(time_constant_s=5)
    for second in range(20):
        smoothed = rates.update(feed(second, {A: 1000 * second}))
    assert rates.update(feed(19, {A: 19_000})) == smoothed
    assert rates.update(feed(20, {A: 7}))[A] == 0.0  # the counter went back: restarted


def test_hosts_that_leave_are_forgotten():
    rates = PromptRates()
    rates.update(feed(0, {A: 0, B: 0}))
    rates.update(feed(1, {A: 10, B: 10}))
    rates.retain([B])
    assert set(rates.update(feed(2, {B: 20}))) == {B}
