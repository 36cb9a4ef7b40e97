"""What the fleet benchmark reads off our routers (their counters) and the routing
overhead probes: the same request straight to an instance and through a path, in pairs."""

from __future__ import annotations

import time
from typing import Any

import httpx

from extproc.bench.fleet_lifecycle import Fleet
from extproc.bench.fleet_paths import SESSION_HEADER
from extproc.bench.workloads import BenchRequest
from extproc.stack.local import LocalStack
from extproc.stack.prometheus import scrape, total

# The router's counters a path's result is computed from (decisions, overflows, and the
# prefix index's matched and prompt bytes).
ROUTER_COUNTERS = (
    "prefix_router_decisions_total",
    "prefix_router_overflows_total",
    "prefix_router_prompt_bytes_total",
    "prefix_router_matched_bytes_total",
)
WARM_UP_PAIRS = 3


def router_counter(stack: LocalStack, name: str) -> float:
    """``name`` summed over its label sets and over the running router replicas."""
    return sum(
        total(scrape(stack.replica_metrics_url(replica), timeout_s=5), name)
        for replica, process in enumerate(stack.routers)
        if process is not None
    )


def router_counters(stack: LocalStack) -> dict[str, float]:
    """Every counter of ROUTER_COUNTERS, now."""
    return {name: router_counter(stack, name) for name in ROUTER_COUNTERS}


def probe_body(requests: list[BenchRequest]) -> dict[str, Any]:
    """The workload's first request, asking for one token, not streamed."""
    return {**requests[0].body, "max_tokens": 1, "stream": False}


def _probe_pairs(
    direct: str,
    routed: str,
    body: dict[str, Any],
    headers: dict[str, str],
    probes: int,
) -> list[float]:
    """Seconds each back-to-back (direct, routed) pair differs by, after the warm-up."""
    added = []
    with httpx.Client(timeout=30, trust_env=False) as client:
        for index in range(probes + WARM_UP_PAIRS):
            took = []
            for target in (direct, routed):
                started = time.perf_counter()
                client.post(target, json=body, headers=headers).raise_for_status()
                took.append(time.perf_counter() - started)
            if index >= WARM_UP_PAIRS:  # the first rounds warm connections up
                added.append(took[1] - took[0])
    return added


def measure_overhead(fleet: Fleet, url: str, body: dict[str, Any], probes: int) -> list[float]:
    """Each pair's (latency through ``url`` minus latency straight to an instance), in ms,
    with the simulators answering at once; each pair is sent back to back."""
    fleet.set_time_scale(0.0)
    direct = f"http://{fleet.addresses[0]}/v1/chat/completions"
    routed = f"{url}/v1/chat/completions"
    headers = {SESSION_HEADER: "overhead-probe"}
    try:
        added = _probe_pairs(direct, routed, body, headers, probes)
    finally:
        fleet.set_time_scale(fleet.options.time_scale)
    return [seconds * 1000 for seconds in added]
