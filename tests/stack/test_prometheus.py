"""The harness's Prometheus reader (extproc/stack/prometheus.py) against a real /metrics
endpoint: prometheus_client's own exposition of a private registry."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from extproc.stack.processes import free_port
from extproc.stack.prometheus import (
    by_host,
    by_label,
    scrape,
    scrape_metric,
    series,
    total,
)


@pytest.fixture(scope="module")
def metrics_url() -> Iterator[str]:
    registry = CollectorRegistry()
    Gauge("prefix_router_hosts", "hosts", registry=registry).set(3)
    in_flight = Gauge("prefix_router_in_flight_requests", "in flight", ["host"], registry=registry)
    in_flight.labels(host="127.0.0.11:8000").set(2)
    in_flight.labels(host="127.0.0.12:8000").set(5)
    decisions = Counter(
        "prefix_router_decisions_total", "decisions", ["strategy"], registry=registry
    )
    decisions.labels(strategy="PREFIX_AWARE").inc(4)
    decisions.labels(strategy="LEAST_LOADED").inc(1)
    port = free_port("127.0.0.1")
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def down_url() -> str:
    """A port nothing listens on."""
    return f"http://127.0.0.1:{free_port('127.0.0.1')}/metrics"


def test_scrape_keys_every_sample_by_name_and_sorted_labels(metrics_url):
    samples = scrape(metrics_url)
    assert samples[("prefix_router_hosts", ())] == 3
    assert samples[("prefix_router_in_flight_requests", (("host", "127.0.0.12:8000"),))] == 5
    assert samples[("prefix_router_decisions_total", (("strategy", "PREFIX_AWARE"),))] == 4


def test_total_series_and_by_label_read_labelled_samples(metrics_url):
    samples = scrape(metrics_url)
    assert total(samples, "prefix_router_decisions_total") == 5
    assert total(samples, "prefix_router_in_flight_requests") == 7
    assert total(samples, "prefix_router_hosts") == 3  # unlabelled: its one sample
    assert total(samples, "prefix_router_absent") == 0
    assert series(samples, "prefix_router_in_flight_requests") == 2
    assert series(samples, "prefix_router_absent") == 0
    assert by_host(samples, "prefix_router_in_flight_requests") == {
        "127.0.0.11:8000": 2,
        "127.0.0.12:8000": 5,
    }
    assert by_label(samples, "prefix_router_decisions_total", "strategy") == {
        "PREFIX_AWARE": 4,
        "LEAST_LOADED": 1,
    }
    assert by_host(samples, "prefix_router_hosts") == {}  # no host label


def test_scrape_metric_reads_only_an_unlabelled_sample(metrics_url):
    assert scrape_metric(metrics_url, "prefix_router_hosts") == 3
    # A labelled name has no unlabelled sample, and an absent name none at all.
    assert scrape_metric(metrics_url, "prefix_router_in_flight_requests") is None
    assert scrape_metric(metrics_url, "prefix_router_decisions_total") is None
    assert scrape_metric(metrics_url, "prefix_router_absent") is None
    # Not a prefix match: a name that begins another's is a name of its own.
    assert scrape_metric(metrics_url, "prefix_router_host") is None


def test_an_endpoint_that_is_down_is_none_to_scrape_metric_and_an_error_to_scrape(down_url):
    assert scrape_metric(down_url, "prefix_router_hosts") is None
    with pytest.raises(httpx.ConnectError):
        scrape(down_url)
