"""Oversize bodies, many slow clients and a client that never finishes its request.

The stack runs Envoy with short timeouts (stream idle 2 s, whole request 8 s) and a
256 KiB buffer, so that "far above the limit" and "never finishes" are cheap to test.
Assertions: Envoy ends every stalled request itself (no hang), the router's memory stays
bounded (VmRSS from /proc), its streams and in-flight counts return to zero, and it
keeps serving everybody else meanwhile.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import prometheus
from extproc.stack.local import LocalStack
from extproc.stack.processes import wait_until, wait_until_async

from ..prompts import document
from .stacks import reliability_spec, rss_kib
from .steady import CHAT, SteadyTraffic, chat

pytestmark = pytest.mark.envoy

BUFFER_LIMIT = 256 * 1024
IDLE_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 8.0
# The router's resident memory may grow by this much across a test: room for Python's
# allocator and gRPC's buffers, far below what holding the bodies would take.
RSS_GROWTH_BOUND_KIB = 64 * 1024


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    # Without KV events: bodies far above the buffer limit are far past any model's
    # context (see tests/integration/test_bodies_through_envoy.py).
    spec = reliability_spec(
        3,
        sim_kv_events=False,
        buffer_limit_bytes=BUFFER_LIMIT,
        envoy_settings={
            "stream_idle_timeout_s": IDLE_TIMEOUT_S,
            "request_timeout_s": REQUEST_TIMEOUT_S,
        },
    )
    with LocalStack(spec) as running:
        yield running


def router_rss(stack: LocalStack) -> int:
    assert stack.router is not None and stack.router.popen is not None
    return rss_kib(stack.router.popen.pid)


def settled(stack: LocalStack) -> None:
    """Every ext_proc stream closed, every in-flight slot released."""
    wait_until(
        lambda: stack.router_metric("prefix_router_open_streams") == 0,
        REQUEST_TIMEOUT_S + 10,
        "the router's streams to close",
    )
    samples = prometheus.scrape(stack.router_metrics_url)
    in_flight = prometheus.by_host(samples, "prefix_router_in_flight_requests")
    assert not any(in_flight.values()), in_flight


def test_bodies_far_above_the_buffer_limit(stack: LocalStack):
    fleet = set(stack.backend_addresses)
    before = router_rss(stack)
    sizes = [4, 8, 16, 4, 8, 16, 32]  # x the 256 KiB buffer limit: 1 MiB to 8 MiB
    outcomes = []
    with httpx.Client(base_url=stack.url, timeout=REQUEST_TIMEOUT_S + 10) as client:
        for n, multiple in enumerate(sizes):
            text = document(n) + "z" * (multiple * BUFFER_LIMIT)
            payload = json.dumps(chat(text)).encode()
            started = time.monotonic()
            response = client.post(
                CHAT, content=payload, headers={"content-type": "application/json"}
            )
            outcomes.append((response, time.monotonic() - started, payload))
    for response, elapsed, payload in outcomes:
        assert elapsed < REQUEST_TIMEOUT_S + 5
        if response.status_code == 200:
            assert response.headers["x-served-by"] in fleet
            # The whole body reached the backend, byte for byte.
            assert response.headers["x-request-body-sha256"] == hashlib.sha256(payload).hexdigest()
        else:
            # Envoy 1.40 sometimes loses the end of a body that overflows the buffer while
            # the router decides (docs/architecture.md); the request timeout ends it.
            assert response.status_code in (408, 504), response.text[:200]
            assert "x-served-by" not in response.headers
    served = sum(r.status_code == 200 for r, _, _ in outcomes)
    assert served >= len(sizes) - 2, [(r.status_code, round(e, 1)) for r, e, _ in outcomes]
    settled(stack)
    assert router_rss(stack) - before < RSS_GROWTH_BOUND_KIB
    # Still serving.
    assert httpx.post(stack.url + CHAT, json=chat("after")).status_code == 200


async def slow_client(host: str, port: int, total: int, drip: int) -> tuple[int, float]:
    """Send headers promising ``total`` bytes, then ``drip`` bytes every 0.3 s. Returns
    the status Envoy answered with (0: connection closed with no response) and when."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            (
                f"POST {CHAT} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                f"content-length: {total}\r\n\r\n"
            ).encode()
            + b'{"model":"sim-model","messages":[{"role":"user","content":"'
        )
        await writer.drain()
        status_line = asyncio.ensure_future(reader.readline())
        deadline = started + REQUEST_TIMEOUT_S + 10
        while not status_line.done() and time.monotonic() < deadline:
            if drip:
                writer.write(b"s" * drip)
                try:
                    await writer.drain()
                except ConnectionError:
                    break
            await asyncio.wait({status_line}, timeout=0.3)
        line = await asyncio.wait_for(status_line, timeout=2)
        status = int(line.split()[1]) if line.startswith(b"HTTP/") else 0
        return status, time.monotonic() - started
    finally:
        writer.close()


async def test_fifty_slow_clients_are_cut_by_envoy_and_others_are_served(stack: LocalStack):
    fleet = set(stack.backend_addresses)
    before = router_rss(stack)
    host, port = stack.spec.listen
    with SteadyTraffic(stack.url, rate=20, limit=1000, max_seconds=40).running() as traffic:
        results = await asyncio.gather(
            *(slow_client(host, port, total=10_000_000, drip=64) for _ in range(50))
        )
        during = len(traffic.sent)
    # Data keeps flowing, so the idle timeout never fires: the request timeout does.
    for status, elapsed in results:
        assert status in (408, 0), results
        assert elapsed < REQUEST_TIMEOUT_S + 6, results
    assert sum(status == 408 for status, _ in results) >= 45, results
    assert during >= 100, traffic.summary()
    assert traffic.routing_failures == [], traffic.summary()
    assert traffic.served_outside(fleet) == []
    settled(stack)
    assert router_rss(stack) - before < RSS_GROWTH_BOUND_KIB


async def test_a_request_that_never_finishes_is_ended_by_envoy(stack: LocalStack):
    host, port = stack.spec.listen
    stalled = asyncio.ensure_future(slow_client(host, port, total=5000, drip=0))
    # While it stalls, the router holds its stream and serves others.
    await wait_until_async(
        lambda: (stack.router_metric("prefix_router_open_streams") or 0) >= 1,
        5,
        what="the router to hold the stalled stream",
    )
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        response = await client.post(CHAT, json=chat(document(1)))
    assert response.status_code == 200
    status, elapsed = await stalled
    assert status == 408  # Envoy's stream idle timeout answered, not a hang
    assert IDLE_TIMEOUT_S - 0.5 < elapsed < IDLE_TIMEOUT_S + 5
    settled(stack)
