"""The closed-loop saturation run: a fixed number of clients, each sending its next request
as soon as the last one ends, with the simulators' model slowed so that the fleet, not this
machine's CPU, is the bottleneck."""

from __future__ import annotations

import asyncio

from extproc.bench.counters import prefix_counters
from extproc.bench.fleet_lifecycle import Fleet, reset_caches
from extproc.bench.fleet_paths import reads_events
from extproc.bench.fleet_results import ClosedLoopResult
from extproc.bench.loadgen import run_closed_loop
from extproc.bench.workloads import BenchRequest


def run_closed(fleet: Fleet, path: str, url: str, requests: list[BenchRequest]) -> ClosedLoopResult:
    """A saturation run: the model slowed to closed_loop_time_scale, fixed concurrency."""
    options = fleet.options
    scale = options.closed_loop_time_scale
    reset_caches(fleet.addresses, fleet.stack if reads_events(path) else None)
    fleet.set_time_scale(scale)
    try:
        queries_before, hits_before = prefix_counters(fleet.addresses)
        outcomes, wall = asyncio.run(
            run_closed_loop(
                f"{url}/v1/chat/completions",
                requests[: options.closed_loop_requests],
                options.closed_loop_concurrency,
                options.closed_loop_time_limit_s,
            )
        )
        queries, hits = prefix_counters(fleet.addresses)
    finally:
        reset_caches(fleet.addresses)  # waits for idle first
        fleet.set_time_scale(options.time_scale)
    ok = [o for o in outcomes if o.ok]
    model_s = wall / scale if wall else float("inf")
    ttfts = sorted(o.ttft_s * 1000 / scale for o in ok if o.ttft_s)
    return ClosedLoopResult(
        concurrency=options.closed_loop_concurrency,
        completed=len(ok),
        failed=len(outcomes) - len(ok),
        requests_per_s=len(ok) / model_s,
        tokens_per_s=sum(o.output_tokens for o in ok) / model_s,
        hit_rate=(hits - hits_before) / max(1.0, queries - queries_before),
        ttft_p50_ms=ttfts[len(ttfts) // 2] if ttfts else float("nan"),
    )
