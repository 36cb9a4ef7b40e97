"""Shadow mode: how well it predicts, and what it and the traffic log cost.

Accuracy: each fleet workload is served with RANDOM while the router shadows it, then with
PREFIX_AWARE, on the same fleet of simulated vLLM instances from cold caches; the hit rate
the shadow predicted is set against the hit rate PREFIX_AWARE then really gets (vLLM's
counters), and so are each instance's share and the overflow.

Cost: the router's own decision, in process, on the workload's request bodies, with
nothing, the traffic log, shadow mode, and both, interleaved round by round; the added
median per request is what each costs.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from extproc.adapter.observers import ShadowObserver, TrafficLogObserver
from extproc.adapter.routing import Router
from extproc.adapter.traffic_log import TrafficLog
from extproc.bench import report
from extproc.bench.fleet import open_loop
from extproc.bench.fleet_lifecycle import Fleet
from extproc.bench.fleet_options import FleetBenchOptions, default_sim_args, simulator_args
from extproc.bench.fleet_probes import router_counter
from extproc.bench.probes import by_host, scrape, wait_for_idle_pressure
from extproc.bench.workloads import BenchRequest, WorkloadName, WorkloadSpec, generate
from extproc.config import RouterConfig
from extproc.picker.decide import Strategy
from extproc.replay.fleet import addresses as virtual_addresses

log = structlog.get_logger("bench")

KIND = "shadow"
FORMAT = 1
HIT_RATE_POINTS = 5.0
# The bounds on what each adds to a request, median, in microseconds.
SHADOW_US = 30.0
LOG_US = 20.0
VARIANTS = ("plain", "traffic log", "shadow", "shadow and traffic log")


@dataclass(frozen=True)
class ShadowOptions:
    workloads: tuple[WorkloadName, ...] = ("long-context", "conversations", "hot-spot")
    rate_per_s: float = 6.0
    duration_s: float = 60.0
    # The cost comparison: rounds of every variant over the workload's first requests.
    cost_rounds: int = 5
    cost_requests: int = 400
    out_dir: Path | None = None
    command: str = ""
    name: str = "shadow"


def quick(options: ShadowOptions) -> ShadowOptions:
    return replace(options, duration_s=15.0, cost_rounds=2, cost_requests=100)


def _shares(counts: dict[str, float], hosts: list[str]) -> dict[str, float]:
    total = sum(counts.values()) or 1.0
    return {h: counts.get(h, 0.0) / total for h in hosts}


def measure_accuracy(
    options: ShadowOptions, spec: WorkloadSpec, requests: list[BenchRequest]
) -> dict[str, Any]:
    workload = spec.name
    fleet_options = FleetBenchOptions(
        workload=spec, sim_args=default_sim_args(workload), paths=("RANDOM",), out_dir=None
    )
    with tempfile.TemporaryDirectory(prefix="bench-shadow-") as tmp:
        fleet = Fleet(fleet_options, Path(tmp))
        try:
            fleet.start()
            stack = fleet.stack
            assert stack is not None
            hosts = list(fleet.addresses)
            stack.write_router_config(routing_strategy="RANDOM", shadow=True)
            stack.restart_routers(1)
            wait_for_idle_pressure(stack)
            shadowed = open_loop(fleet, "RANDOM, shadowing", stack.url, requests)
            prompt = router_counter(stack, "prefix_router_shadow_prompt_bytes_total")
            matched = router_counter(stack, "prefix_router_shadow_matched_bytes_total")
            overflows = router_counter(stack, "prefix_router_shadow_overflows_total")
            predicted_counts = by_host(
                scrape(stack.router_metrics_url), "prefix_router_shadow_requests_total"
            )
            stack.write_router_config(routing_strategy="PREFIX_AWARE")
            stack.restart_routers(1)
            wait_for_idle_pressure(stack)
            before = {
                name: router_counter(stack, name)
                for name in ("prefix_router_decisions_total", "prefix_router_overflows_total")
            }
            real = open_loop(fleet, "PREFIX_AWARE", stack.url, requests)
            decisions = (
                router_counter(stack, "prefix_router_decisions_total")
                - before["prefix_router_decisions_total"]
            )
            real_overflows = (
                router_counter(stack, "prefix_router_overflows_total")
                - before["prefix_router_overflows_total"]
            )
        finally:
            fleet.stop()
    predicted_hit = matched / prompt if prompt else 0.0
    predicted_shares = _shares(predicted_counts, hosts)
    log.info("bench.shadow", workload=workload, predicted=predicted_hit, real=real.hit_rate)
    return {
        "workload": asdict(spec),
        "requests": len(requests),
        "addresses": hosts,
        "simulator": {"args": simulator_args(fleet_options)},
        "live": {
            "strategy": "RANDOM",
            "hit_rate": shadowed.hit_rate,
            "shares": shadowed.shares,
            "failures": shadowed.failures,
        },
        "predicted": {
            "hit_rate": predicted_hit,
            "shares": predicted_shares,
            "overflow_rate": overflows / max(1.0, sum(predicted_counts.values())),
            "requests": sum(predicted_counts.values()),
        },
        "prefix_aware": {
            "hit_rate": real.hit_rate,
            "shares": real.shares,
            "overflow_rate": real_overflows / max(1.0, decisions),
            "failures": real.failures,
        },
        "hit_rate_error": 100 * abs(predicted_hit - real.hit_rate),
        "share_error": 100 * max(abs(predicted_shares[h] - real.shares.get(h, 0.0)) for h in hosts),
    }


def _route_all(router: Router, bodies: list[bytes]) -> list[float]:
    """Seconds each request's routing took (decide, then finish)."""
    took = []
    clock = time.perf_counter
    for body in bodies:
        started = clock()
        router.finish(router.route({}, body))
        took.append(clock() - started)
    return took


def measure_cost(requests: list[BenchRequest], rounds: int, count: int) -> dict[str, Any]:
    """Each variant's median routing time per round, in microseconds, interleaved; and
    its CPU time per request, the threads that work off the request path included (the
    traffic log's writer, shadow mode's placements)."""
    bodies = [json.dumps(r.body).encode() for r in requests[:count]]
    hosts = virtual_addresses(7)
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-shadow-cost-") as tmp:
        for round_ in range(rounds):
            for variant in VARIANTS:
                traffic = None
                if "log" in variant:
                    traffic = TrafficLog(Path(tmp) / f"{round_}-{len(variant)}.log", 1 << 30, 2)
                config = RouterConfig(
                    hosts=hosts, routing_strategy=Strategy.RANDOM, shadow="shadow" in variant
                )
                given = () if traffic is None else (TrafficLogObserver(traffic),)
                router = Router(config, random.Random(1), observers=given)
                started = time.process_time()
                took = _route_all(router, bodies)
                shadow = router.observer(ShadowObserver)
                if shadow is not None:
                    shadow.sync()  # its placements are done: their CPU is counted
                if traffic is not None:
                    traffic.close()  # every record written
                cpu[variant].append(1e6 * (time.process_time() - started) / len(bodies))
                router.close()
                medians[variant].append(1e6 * statistics.median(took))
    plain, plain_cpu = medians["plain"], cpu["plain"]
    return {
        "requests": len(bodies),
        "rounds": rounds,
        "median_us": medians,
        "cpu_us": cpu,
        "added_us": {
            variant: statistics.median(m - p for m, p in zip(values, plain, strict=True))
            for variant, values in medians.items()
            if variant != "plain"
        },
        "added_cpu_us": {
            variant: statistics.median(c - p for c, p in zip(values, plain_cpu, strict=True))
            for variant, values in cpu.items()
            if variant != "plain"
        },
    }


def run(options: ShadowOptions) -> dict[str, Any]:
    workloads = []
    for workload in options.workloads:
        spec = WorkloadSpec(
            name=workload, rate_per_s=options.rate_per_s, duration_s=options.duration_s
        )
        requests = generate(spec)
        measured = measure_accuracy(options, spec, requests)
        measured["cost"] = measure_cost(requests, options.cost_rounds, options.cost_requests)
        workloads.append(measured)
    data = {
        "kind": KIND,
        "format": FORMAT,
        "command": options.command,
        "machine": report.machine_description(),
        "bounds": {"hit_rate_points": HIT_RATE_POINTS, "shadow_us": SHADOW_US, "log_us": LOG_US},
        "workloads": workloads,
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, options.name, data)
    return data


def worst_costs(data: dict[str, Any]) -> tuple[float, float]:
    """The largest median added, over the workloads: (shadow mode, traffic log)."""
    shadow = max(w["cost"]["added_us"]["shadow"] for w in data["workloads"])
    traffic = max(w["cost"]["added_us"]["traffic log"] for w in data["workloads"])
    return shadow, traffic


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def render(data: dict[str, Any]) -> str:
    bounds = data["bounds"]
    rows = []
    cost_rows = []
    for w in data["workloads"]:
        name = w["workload"]["name"]
        predicted, real = w["predicted"], w["prefix_aware"]
        rows.append(
            (
                name,
                _pct(w["live"]["hit_rate"]),
                _pct(predicted["hit_rate"]),
                _pct(real["hit_rate"]),
                f"{w['hit_rate_error']:.1f}",
                f"{_pct(max(predicted['shares'].values()))} / {_pct(max(real['shares'].values()))}",
                f"{w['share_error']:.1f}",
                f"{_pct(predicted['overflow_rate'])} / {_pct(real['overflow_rate'])}",
            )
        )
        cost = w["cost"]
        cost_rows.append(
            (
                name,
                f"{statistics.median(cost['median_us']['plain']):.1f}",
                *(
                    f"{cost['added_us'][v]:+.1f} ({cost['added_cpu_us'][v]:+.1f} CPU)"
                    for v in VARIANTS[1:]
                ),
            )
        )
    within = all(w["hit_rate_error"] <= bounds["hit_rate_points"] for w in data["workloads"])
    shadow_us, log_us = worst_costs(data)
    accuracy = report.markdown_table(
        ("workload", "RANDOM's hit rate (live)", "shadow's prediction for PREFIX_AWARE",
         "PREFIX_AWARE, measured", "error (points)", "busiest instance, predicted / measured",
         "worst instance's share error (points)", "overflow, predicted / measured"),
        rows,
    )  # fmt: skip
    costs = report.markdown_table(
        (
            "workload",
            "routing alone (µs, median)",
            *(f"{v}: added to the request (CPU, all threads), µs" for v in VARIANTS[1:]),
        ),
        cost_rows,
    )
    first = data["workloads"][0]["cost"]
    return f"""# Shadow mode: what PREFIX_AWARE would get, measured while serving RANDOM

Each workload ran twice on the same fleet of simulated vLLM instances, from cold caches:
first with RANDOM while the router shadowed it, then with PREFIX_AWARE. The shadow's
prediction is read from the router's metrics at the end of the first run
(`prefix_router_shadow_matched_bytes_total / prefix_router_shadow_prompt_bytes_total`,
`prefix_router_shadow_requests_total{{host}}`, `prefix_router_shadow_overflows_total`);
the measured hit rates are vLLM's counters.

{accuracy}

Every workload's prediction within {bounds["hit_rate_points"]:g} points of the hit rate
PREFIX_AWARE then got: **{"yes" if within else "no"}**.

## What it costs

The router's decision in process (route, then finish) on each workload's first
{first["requests"]} request bodies, with the traffic log, shadow mode, or both, against
neither, under RANDOM; {first["rounds"]} interleaved rounds, the median per round, then
the median over rounds of each round's difference. What a request waits for is the first
figure; the traffic log's records and shadow mode's placements are made in their own
threads, and their CPU time (the process's, per request, every record written and every
placement made) is the second.

{costs}

Worst added median: shadow mode {shadow_us:.1f} µs (bound {bounds["shadow_us"]:g} µs:
**{"met" if shadow_us <= bounds["shadow_us"] else "not met"}**), the traffic log
{log_us:.1f} µs (bound {bounds["log_us"]:g} µs:
**{"met" if log_us <= bounds["log_us"] else "not met"}**).

```
{data["command"]}
```

- Machine: {data["machine"]}
"""
