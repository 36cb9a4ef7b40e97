"""The fleet benchmark: one workload, one fleet of simulated vLLM instances, every routing
path side by side in one run.

Paths (``fleet_paths``): our Envoy + router with RANDOM, LEAST_OUTSTANDING_REQUESTS and
PREFIX_AWARE (longest match, the default), PREFIX_AWARE with SageMaker's fixed-length key,
and PREFIX_AWARE with two router replicas behind the one Envoy; Envoy's own ring_hash on a
session header (no ext_proc); and, when installed (`pip install envoy-prefix-router[bench]`),
the peers vllm-router (cache_aware, consistent_hash) and smg (cache_aware). Before each path
every instance's prefix cache is reset, and before each of ours the routers restart with the
path's settings, so each path starts cold, prefix index included.

Two optional measurements per path: the routing overhead (``fleet_probes``: the simulators
set to answer at once, the same request sent alternately straight to an instance and through
the path, in pairs) and a closed-loop saturation run (``fleet_closed_loop``: fixed
concurrency, the simulators' model slowed by ``closed_loop_time_scale`` so the fleet, not
this machine's CPU, is the bottleneck), whose completions per second are the capacity of
path and fleet together.

Time is compressed by ``time_scale``: the simulators' modelled durations and the arrival
times are both multiplied by it, and measured times are divided by it, so results are in
model time. Fixed costs that do not scale (Envoy, the router, Python) are inflated by
1/time_scale in the results; the report says so.

The run is stored as one document (``document``: settings, machine, every result) in
<name>.json; the markdown and plots are rendered from that document alone
(``fleet_render``), and ``rerender`` renders them again from a stored JSON.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from extproc.bench import report
from extproc.bench.counters import prefix_counters
from extproc.bench.fleet_closed_loop import run_closed
from extproc.bench.fleet_lifecycle import Fleet, reset_caches
from extproc.bench.fleet_options import (
    HOT_SPOT_SIM_ARGS,
    QUICK_RATE_TIME_CONSTANT_S,
    FleetBenchOptions,
    default_paths,
    default_sim_args,
    effective_rate_time_constant_s,
    simulator_args,
    stack_router_settings,
)
from extproc.bench.fleet_paths import (
    FIXED,
    NO_OVERFLOW,
    OUR_PATHS,
    OUR_STRATEGIES,
    PEERS,
    REPLICAS,
    RING_HASH,
    SESSION_HEADER,
    TWO_REPLICAS,
    our_paths_document,
    path_url,
    reads_events,
)
from extproc.bench.fleet_probes import (
    WARM_UP_PAIRS,
    measure_overhead,
    probe_body,
    router_counters,
)
from extproc.bench.fleet_render import FORMAT, KIND, render_plots, render_report, rerender
from extproc.bench.fleet_results import ClosedLoopResult, PathResult
from extproc.bench.loadgen import run_open_loop
from extproc.bench.probes import wait_for_idle_pressure
from extproc.bench.workloads import BenchRequest, generate
from extproc.config import RouterConfig

__all__ = [
    "FIXED",
    "HOT_SPOT_SIM_ARGS",
    "NO_OVERFLOW",
    "OUR_PATHS",
    "OUR_STRATEGIES",
    "PEERS",
    "QUICK_RATE_TIME_CONSTANT_S",
    "REPLICAS",
    "RING_HASH",
    "SESSION_HEADER",
    "TWO_REPLICAS",
    "ClosedLoopResult",
    "Fleet",
    "FleetBenchOptions",
    "PathResult",
    "default_paths",
    "default_sim_args",
    "document",
    "path_url",
    "render_plots",
    "render_report",
    "rerender",
    "reset_caches",
    "run",
    "run_path",
    "write_report",
]

log = structlog.get_logger("bench")

# The router defaults the report quotes; stored as they were when the run ran.
QUOTED_ROUTER_DEFAULTS = ("balance_factor", "balance_min_in_flight", "overload_cost", "kv_events")


def open_loop(
    fleet: Fleet,
    path: str,
    url: str,
    requests: list[BenchRequest],
    events: bool | None = None,
) -> PathResult:
    """The open loop through ``url``: TTFTs, the measured hit rate, each instance's share."""
    options = fleet.options
    # Whether the routers read the engines' KV events: as the path's name says, unless the
    # caller wrote their config itself.
    if events is None:
        events = reads_events(path)
    reset_caches(fleet.addresses, fleet.stack if events else None)
    queries_before, hits_before = prefix_counters(fleet.addresses)
    outcomes, wall = asyncio.run(
        run_open_loop(f"{url}/v1/chat/completions", requests, options.time_scale)
    )
    queries, hits = prefix_counters(fleet.addresses)
    result = PathResult(
        path,
        outcomes,
        wall,
        options.time_scale,
        (hits - hits_before) / max(1.0, queries - queries_before),
    )
    served = Counter(o.served_by for o in outcomes if o.ok)
    total = sum(served.values()) or 1
    result.shares = {a: served.get(a, 0) / total for a in fleet.addresses}
    return result


def _router_rates(before: dict[str, float], after: dict[str, float]) -> tuple[float, float | None]:
    """(overflow rate, index estimate) over the counters' increase."""
    delta = {name: after[name] - before[name] for name in after}
    decisions = delta["prefix_router_decisions_total"]
    prompt = delta["prefix_router_prompt_bytes_total"]
    overflow = delta["prefix_router_overflows_total"] / decisions if decisions else 0.0
    estimate = delta["prefix_router_matched_bytes_total"] / prompt if prompt else None
    return overflow, estimate


def run_path(fleet: Fleet, path: str, requests: list[BenchRequest]) -> PathResult:
    options = fleet.options
    stack = fleet.stack
    assert stack is not None
    url = path_url(fleet, path)
    if url is None:
        return PathResult(path, [], 0.0, options.time_scale, 0.0, skipped="not installed")
    pairs = None
    if options.overhead_probes:
        pairs = measure_overhead(fleet, url, probe_body(requests), options.overhead_probes)
    counters_before: dict[str, float] = {}
    if path in OUR_PATHS:
        if options.overhead_probes:  # the probes taught the index one prompt: start afresh
            stack.restart_routers(REPLICAS.get(path, 1))
        # Every path starts from an idle fleet, as from cold caches: no cache pressure left
        # from the path (or the probes) before.
        wait_for_idle_pressure(stack)
        counters_before = router_counters(stack)
    result = open_loop(fleet, path, url, requests)
    if pairs is not None:
        result.overhead_pairs_ms = pairs
        result.overhead_ms = statistics.median(pairs)
    if path in OUR_PATHS:
        result.overflow_rate, result.index_estimate = _router_rates(
            counters_before, router_counters(stack)
        )
    if options.closed_loop_concurrency and path in options.closed_loop_paths:
        result.closed_loop = run_closed(fleet, path, url, requests)
    log.info(
        "bench.path",
        path=path,
        p50_ms=round(result.percentile(0.5), 1),
        hit_rate=round(result.hit_rate, 3),
        failures=result.failures,
    )
    return result


def run(options: FleetBenchOptions) -> list[PathResult]:
    requests = generate(options.workload)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        fleet = Fleet(options, Path(tmp))
        try:
            fleet.start()
            results = [run_path(fleet, path, requests) for path in options.paths]
        finally:
            fleet.stop()
    if options.out_dir is not None:
        write_report(options, results, len(requests))
    return results


def router_settings(options: FleetBenchOptions) -> dict[str, Any]:
    """The settings our paths start from, with the defaults the report quotes, as now."""
    defaults = RouterConfig()
    quoted = {name: getattr(defaults, name) for name in QUOTED_ROUTER_DEFAULTS}
    return {**stack_router_settings(options), **quoted}


def document(options: FleetBenchOptions, results: list[PathResult], count: int) -> dict[str, Any]:
    """The stored run: everything its report is rendered from."""
    return {
        "kind": KIND,
        "format": FORMAT,
        "name": options.name,
        "command": options.command,
        "machine": report.machine_description(),
        "workload": asdict(options.workload),
        "instances": options.instances,
        "time_scale": options.time_scale,
        "requests": count,
        "simulator": {"args": simulator_args(options)},
        "router": router_settings(options),
        "control_plane": {"rate_time_constant_s": effective_rate_time_constant_s(options)},
        "our_paths": our_paths_document(options.paths),
        "session_header": SESSION_HEADER,
        "overhead_probes": options.overhead_probes,
        "overhead_warm_up_pairs": WARM_UP_PAIRS,
        "closed_loop": {
            "concurrency": options.closed_loop_concurrency,
            "requests": options.closed_loop_requests,
            "time_scale": options.closed_loop_time_scale,
            "time_limit_s": options.closed_loop_time_limit_s,
            "paths": list(options.closed_loop_paths),
        },
        "results": [asdict(r) for r in results],
    }


def write_report(options: FleetBenchOptions, results: list[PathResult], count: int) -> Path:
    """Store the run as <name>.json, then render <name>.md and its plots from what was
    stored (read back), so the report is by construction a rendering of the JSON."""
    assert options.out_dir is not None
    options.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = options.out_dir / f"{options.name}.json"
    json_path.write_text(json.dumps(document(options, results, count), default=str) + "\n")
    return rerender(json_path)
