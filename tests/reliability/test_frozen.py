"""Peers that stop answering without closing anything (SIGSTOP: a frozen process, a
half-open connection): keepalive finds them within PING_INTERVAL_S + PING_TIMEOUT_S, the
rest of the stack goes on, and the frozen side recovers after SIGCONT."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from extproc.bench import probes
from extproc.keepalive import PING_INTERVAL_S, PING_TIMEOUT_S
from extproc.stack.local import LocalStack, envoy_counters
from extproc.stack.processes import wait_until

from ..prompts import document
from .stacks import reliability_spec
from .steady import CHAT, SteadyTraffic, chat

pytestmark = pytest.mark.envoy

# Keepalive's bound, plus a ping's jitter and the time to notice.
FOUND_WITHIN_S = PING_INTERVAL_S + PING_TIMEOUT_S + 5
# Envoy's health check: every 1 s, 1 s timeout, two timeouts in a row mark a router down.
HEALTH_CHECK_S = 5


def summed(stack: LocalStack, replica: int, name: str) -> float:
    """A labelled metric of one router replica, summed over its labels."""
    return probes.total(probes.scrape(stack.replica_metrics_url(replica)), name)


def decisions(stack: LocalStack, replica: int) -> float:
    return summed(stack, replica, "prefix_router_decisions_total")


def in_flight(stack: LocalStack, replica: int) -> float:
    return summed(stack, replica, "prefix_router_in_flight_requests")


def long_stream(url: str, doc: int, statuses: list[int]) -> None:
    body = chat(document(doc), max_tokens=400, stream=True)  # ~8 s of tokens
    try:
        with (
            httpx.Client(base_url=url, timeout=60) as client,
            client.stream("POST", CHAT, json=body) as response,
        ):
            for _ in response.iter_lines():
                pass
            statuses.append(response.status_code)
    except httpx.HTTPError:
        statuses.append(0)


def envoy_stat(stack: LocalStack, prefix: str, name: str) -> float:
    return envoy_counters(stack.admin_url, prefix).get(name, 0.0)


@pytest.mark.timeout(180)
def test_a_frozen_router_replica_is_left_found_dead_and_recovers():
    with LocalStack(reliability_spec(3, router_replicas=2)) as stack:
        victim = stack.routers[0]
        assert victim is not None and victim.popen is not None
        with SteadyTraffic(stack.url, limit=6000, max_seconds=90).running() as traffic:
            traffic.wait_for(50)
            statuses: list[int] = []
            threads = [
                threading.Thread(target=long_stream, args=(stack.url, d, statuses))
                for d in range(8)
            ]
            for thread in threads:
                thread.start()
            wait_until(
                lambda: (stack.router_metric("prefix_router_open_streams", 0) or 0) >= 2,
                10,
                "long streams on replica 0",
            )
            victim.popen.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                # Envoy's keepalive finds the silent connection and closes it.
                wait_until(
                    lambda: (
                        envoy_stat(stack, "cluster.prefix_router.", "http2.keepalive_timeout") >= 1
                    ),
                    FOUND_WITHIN_S,
                    "Envoy's keepalive to find the frozen router",
                )
                found_after = time.monotonic() - frozen_at
                survivor = decisions(stack, 1)
                traffic.wait_for(100)
                # New requests are decided by the other replica.
                assert decisions(stack, 1) >= survivor + 50
            finally:
                victim.popen.send_signal(signal.SIGCONT)
            for thread in threads:
                thread.join(timeout=60)
            # The thawed router finds its connection gone: its streams end and every
            # in-flight slot is released; then it takes streams again.
            wait_until(
                lambda: (
                    stack.router_metric("prefix_router_open_streams", 0) == 0
                    and in_flight(stack, 0) == 0
                ),
                15,
                "the thawed router to release its streams",
            )
            back = decisions(stack, 0)
            wait_until(lambda: decisions(stack, 0) > back + 10, 20, "the thawed router to decide")
            traffic.wait_for(50)
        assert found_after <= FOUND_WITHIN_S
        # The long streams were never the router's to cut: each ran to its end.
        assert statuses == [200] * 8, statuses
        # Requests that met the frozen router before Envoy's health check failed open
        # (override-host) and were served; none failed.
        assert traffic.routing_failures == [], traffic.summary()
        assert traffic.backend_failures == []
        late = [s for s in traffic.since(frozen_at + HEALTH_CHECK_S) if s.status]
        assert len(late) >= 50


@pytest.mark.timeout(180)
def test_a_frozen_control_plane_is_found_dead_routing_goes_on_and_it_recovers():
    with LocalStack(reliability_spec(3)) as stack:
        control_plane = stack.control_plane
        assert control_plane is not None and control_plane.popen is not None
        connected = "prefix_router_control_plane_connected"
        wait_until(lambda: stack.router_metric(connected) == 1, 10, "the router's xDS stream")
        with SteadyTraffic(stack.url, limit=6000, max_seconds=90).running() as traffic:
            traffic.wait_for(50)
            control_plane.popen.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                # The router's keepalive finds the silent stream; it keeps its last set.
                wait_until(
                    lambda: stack.router_metric(connected) == 0,
                    FOUND_WITHIN_S,
                    "the router's keepalive to find the frozen control plane",
                )
                found_after = time.monotonic() - frozen_at
                # So does Envoy's, on its ADS connection.
                wait_until(
                    lambda: envoy_stat(stack, "cluster.xds.", "http2.keepalive_timeout") >= 1,
                    FOUND_WITHIN_S,
                    "Envoy's keepalive to find the frozen control plane",
                )
                traffic.wait_for(100)
                assert stack.router_metric("prefix_router_hosts") == 3
            finally:
                control_plane.popen.send_signal(signal.SIGCONT)
            wait_until(lambda: stack.router_metric(connected) == 1, 20, "the router to reconnect")
            wait_until(
                lambda: envoy_stat(stack, "control_plane.", "connected_state") == 1,
                20,
                "Envoy to reconnect",
            )
            traffic.wait_for(50)
        assert found_after <= FOUND_WITHIN_S
        assert traffic.routing_failures == [], traffic.summary()
        assert traffic.backend_failures == []
