"""In-flight accounting and its gauge: idle hosts keep no series."""

from __future__ import annotations

from prometheus_client import REGISTRY

from extproc.adapter.inflight import InFlight


def gauge(host: str) -> float | None:
    return REGISTRY.get_sample_value("prefix_router_in_flight_requests", {"host": host})


def test_counts_follow_acquire_and_release():
    counts = InFlight()
    host = "127.0.0.201:8000"
    counts.acquire(host)
    counts.acquire(host)
    assert counts.snapshot() == {host: 2} and gauge(host) == 2
    counts.release(host)
    assert counts.snapshot() == {host: 1} and gauge(host) == 1
    counts.release(host)
    assert counts.snapshot() == {} and counts.total() == 0


def test_an_idle_host_leaves_no_series_behind():
    counts = InFlight()
    # Autoscaled hosts come and go with fresh addresses: none may leave a series.
    hosts = [f"127.0.1.{n}:8000" for n in range(1, 51)]
    for host in hosts:
        counts.acquire(host)
    for host in hosts:
        counts.release(host)
    assert all(gauge(host) is None for host in hosts)


def test_release_without_acquire_is_harmless():
    counts = InFlight()
    counts.release("127.0.0.202:8000")
    assert counts.total() == 0
    assert gauge("127.0.0.202:8000") is None
