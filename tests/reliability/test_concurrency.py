"""Thousands of long requests in flight at once through one Envoy and the router: the
circuit breakers Envoy gets from the bootstrap hold them (Envoy's defaults, 1024 per
cluster, failed requests past that open in silence), and the router decides every one."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from extproc.bench import probes
from extproc.stack.bootstrap import BootstrapParams
from extproc.stack.local import LocalStack, StackSpec, envoy_counters

pytestmark = pytest.mark.envoy

REQUESTS = 1500
RATE_PER_S = 300.0  # arrivals over 5 s; each answer takes about 5 s, so ~1,400 overlap
HOLD_TOKENS = 100  # at 50 ms a token: every response takes 5 s
# What Envoy counts when a breaker trips, a message times out or ext_proc fails open.
FAILURE_COUNTERS = {
    "cluster.vllm.": (
        "upstream_rq_pending_overflow",
        "upstream_cx_overflow",
        "upstream_rq_retry_overflow",
    ),
    "cluster.prefix_router.": ("upstream_rq_pending_overflow", "upstream_cx_overflow"),
    "http.ingress.ext_proc.": ("failure_mode_allowed", "message_timeouts", "streams_failed"),
}


async def hold(url: str, count: int, rate: float) -> tuple[list[int], int]:
    """``count`` requests at ``rate`` a second, each held until its answer; their
    statuses, and the most in flight at once."""
    in_flight = peak = 0
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one(n: int) -> int:
            nonlocal in_flight, peak
            await asyncio.sleep(n / rate)  # paced: ``rate`` a second
            body = {
                "model": "sim-model",
                "max_tokens": HOLD_TOKENS,
                "messages": [{"role": "user", "content": f"document {n % 50} " * 40}],
            }
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                response = await client.post("/v1/chat/completions", json=body)
                return response.status_code
            except httpx.HTTPError:
                return 0
            finally:
                in_flight -= 1

        statuses = await asyncio.gather(*(one(n) for n in range(count)))
    return list(statuses), peak


def decisions(stack: LocalStack) -> float:
    return probes.total(probes.scrape(stack.router_metrics_url), "prefix_router_decisions_total")


@pytest.mark.timeout(240)
def test_1500_long_requests_at_once_are_all_decided_and_none_fails_open():
    assert REQUESTS > 1024  # past Envoy's default breakers
    spec = StackSpec.ephemeral(
        3, sim_args=("--ttft-ms", "0", "--itl-ms", "50"), upstream_host_header=False
    )
    with LocalStack(spec) as stack:
        before = decisions(stack)
        started = time.monotonic()
        statuses, peak = asyncio.run(hold(stack.url, REQUESTS, RATE_PER_S))
        took = time.monotonic() - started
        counts = {prefix: envoy_counters(stack.admin_url, prefix) for prefix in FAILURE_COUNTERS}
        decided = decisions(stack) - before
        in_flight = stack.router_metric("prefix_router_open_streams")
    assert statuses.count(200) == REQUESTS, {s: statuses.count(s) for s in set(statuses)}
    assert peak > 1024 + 100, (peak, took)
    failures = {
        f"{prefix}{name}": counts[prefix].get(name, 0.0)
        for prefix, names in FAILURE_COUNTERS.items()
        for name in names
    }
    assert all(value == 0 for value in failures.values()), failures
    assert decided == REQUESTS
    assert in_flight == 0
    assert BootstrapParams.max_concurrent >= 2 * REQUESTS
