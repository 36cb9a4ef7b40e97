"""Cache pressure from the load feed's counters and clock."""

from __future__ import annotations

from extproc.control.model import HostLoad
from extproc.index.pressure import CachePressure

A, B, C = "127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"


def feed(at: float, queries: dict[str, float]) -> dict[str, HostLoad]:
    return {h: HostLoad(prefix_cache_queries=q, scraped_at=at) for h, q in queries.items()}


def rounds(pressure: CachePressure, rates: dict[str, float], seconds: int, start: float = 0):
    for second in range(seconds + 1):
        at = start + second
        pressure.update(feed(at, {h: rate * at for h, rate in rates.items()}))


def test_a_busy_host_weighs_less_and_equal_hosts_weigh_alike():
    pressure = CachePressure(time_constant_s=5, strength=1)
    assert pressure.weights([A, B, C]) == {}  # nothing known yet: all equal
    rounds(pressure, {A: 3000, B: 1000, C: 1000}, 60)
    weights = pressure.weights([A, B, C])
    assert weights[A] < 0.7 < weights[B] == weights[C]
    assert abs(weights[A] * 3000 - weights[B] * 1000) < 1e-6 * 3000  # mean / rate
    idle = CachePressure(time_constant_s=5, strength=1)
    rounds(idle, {A: 3000, B: 1000, C: 0}, 60)
    assert idle.weights([A, B, C])[C] == 4.0  # capped: an idle host draws, never takes all


def test_replicas_fed_the_same_rounds_compute_the_same_weights():
    one, two = CachePressure(), CachePressure()
    for pressure in (one, two):
        rounds(pressure, {A: 500, B: 2000, C: 100}, 30)
    assert one.weights([A, B, C]) == two.weights([A, B, C])


def test_a_restart_or_a_repeated_round_is_skipped_and_hosts_that_leave_are_dropped():
    pressure = CachePressure()
    rounds(pressure, {A: 1000, B: 1000}, 20)
    before = pressure.rates()
    pressure.update(feed(20, {A: 20_000, B: 20_000}))  # the same round again
    pressure.update(feed(21, {A: 5, B: 21_000}))  # A restarted: its counter went back
    assert pressure.rates()[A] == before[A]
    pressure.retain([B])
    assert set(pressure.rates()) == {B}
    assert pressure.weights([A, B]) == {}  # A unknown again
