"""How well ``prefix-router replay`` predicts: record a traffic log while a fleet benchmark
workload runs under RANDOM, replay it for three configurations, then run those three for
real on the same fleet, and compare the hit rate and each instance's share.

One fleet of simulated vLLM instances (the fleet benchmark's) and one router. The log is
recorded at the smallest block size (64 bytes) so the replay can route with any block size
a multiple of it, and the replay is told the fleet's addresses, so placement by rendezvous
hashing matches host by host and shares compare instance by instance. The replay's fleet
model gets what an operator knows: the instances' cache size (vllm:cache_config_info) and
the mean output length; nothing measured in the real runs.

The replay models the approximate index: what one router learns from its own decisions.
The real runs therefore route with the engines' KV events off (``kv_events: false``), so
that both sides model the same index; the precise mode is not replayed.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from extproc.bench import report
from extproc.bench.fleet import open_loop
from extproc.bench.fleet_lifecycle import Fleet
from extproc.bench.fleet_options import FleetBenchOptions, default_sim_args, simulator_args
from extproc.bench.probes import wait_for_idle_pressure
from extproc.bench.served import output_tokens
from extproc.bench.workloads import WorkloadName, WorkloadSpec, generate
from extproc.config import RouterConfig
from extproc.replay import report as replay_report
from extproc.replay.configs import (
    FIXED,
    LEAST_OUTSTANDING,
    PREFIX_AWARE,
    RANDOM,
    STRATEGIES,
    Grid,
    ReplayConfig,
)
from extproc.replay.replayer import DRAWS, ServiceModel
from extproc.replay.run import replay

log = structlog.get_logger("bench")

KIND = "replay-accuracy"
FORMAT = 1
# The bounds: hit rate within 5 points, each instance's share within 3.
HIT_RATE_POINTS = 5.0
SHARE_POINTS = 3.0
# Recorded at the smallest block size the router takes: any larger one replays.
RECORD_BLOCK_BYTES = 64
# (name, the router's settings, what the replay routes with: (strategy, block_bytes,
# prefix_length, concurrency_threshold)), in the order they run. PREFIX_AWARE runs first,
# from a fleet that has seen no traffic: it is the strategy that reads the cache pressure,
# which takes a minute to die away after uneven traffic; its second run follows the even
# LEAST_OUTSTANDING_REQUESTS. It routes with the log's block size, so that its placement
# anchors are the logged ones and placement compares instance by instance.
RECORDED = RANDOM
LOW_THRESHOLD = f"{PREFIX_AWARE}, threshold 4"
CONFIGS: tuple[tuple[str, dict[str, Any], tuple[str, int | None, int | None, int | None]], ...] = (
    (
        PREFIX_AWARE,
        {"routing_strategy": "PREFIX_AWARE", "block_bytes": RECORD_BLOCK_BYTES},
        (PREFIX_AWARE, RECORD_BLOCK_BYTES, None, 32),
    ),
    (
        RANDOM,
        {"routing_strategy": "RANDOM", "block_bytes": RECORD_BLOCK_BYTES},
        (RANDOM, None, None, None),
    ),
    (
        FIXED,
        {"routing_strategy": "PREFIX_AWARE", "prefix_match": "fixed"},
        (FIXED, None, 8192, 32),
    ),
    (
        LEAST_OUTSTANDING,
        {"routing_strategy": LEAST_OUTSTANDING},
        (LEAST_OUTSTANDING, None, None, None),
    ),
    (
        LOW_THRESHOLD,
        {
            "routing_strategy": "PREFIX_AWARE",
            "block_bytes": RECORD_BLOCK_BYTES,
            "concurrency_threshold": 4,
        },
        (PREFIX_AWARE, RECORD_BLOCK_BYTES, None, 4),
    ),
)
# Where the bounds apply: the configurations that decide without a random draw. A draw
# (RANDOM; LEAST_OUTSTANDING_REQUESTS between equally loaded hosts, which at these loads
# is most decisions) puts each request on an instance no replay can foresee: their
# predicted shares are an expectation, and one real run's shares scatter around it.
BOUNDED = (PREFIX_AWARE, FIXED, LOW_THRESHOLD)


DEFAULT_GRID = Grid(
    strategies=STRATEGIES,
    instances=(5, 7, 9),
    cache_tokens=(32_000, 64_000),
    concurrency_thresholds=(8, 32),
    block_bytes=(64, 512),
    prefix_lengths=(4096, 8192),
)


@dataclass(frozen=True)
class ReplayAccuracyOptions:
    workloads: tuple[WorkloadName, ...] = ("long-context", "conversations")
    rate_per_s: float = 6.0
    duration_s: float = 60.0
    instances: int = 7
    out_dir: Path | None = None
    command: str = ""
    name: str = "replay"
    # The first workload's log is also replayed for this grid, stored as <name>-grid: what
    # an operator's `prefix-router replay` prints, on a log whose truth is known.
    grid: Grid = field(default_factory=lambda: DEFAULT_GRID)


def quick(options: ReplayAccuracyOptions) -> ReplayAccuracyOptions:
    return replace(options, rate_per_s=6.0, duration_s=15.0)


def _replay_config(
    strategy: str,
    block: int | None,
    length: int | None,
    threshold: int | None,
    fleet: FleetBenchOptions,
) -> ReplayConfig:
    return ReplayConfig(strategy, fleet.instances, _cache_tokens(fleet), threshold, block, length)


def _cache_tokens(fleet: FleetBenchOptions) -> int:
    args = list(fleet.sim_args)
    blocks = int(args[args.index("--capacity-blocks") + 1])
    return blocks * 16  # the simulator's block size, in tokens


def measure_workload(
    options: ReplayAccuracyOptions, workload: WorkloadName, grid: Grid | None = None
) -> dict[str, Any]:
    """Record, run for real, replay; with ``grid``, also replay the log for it and store
    that run as ``<name>-grid``."""
    spec = WorkloadSpec(name=workload, rate_per_s=options.rate_per_s, duration_s=options.duration_s)
    requests = generate(spec)
    fleet_options = FleetBenchOptions(
        workload=spec,
        instances=options.instances,
        sim_args=default_sim_args(workload),
        paths=(RECORDED,),
        out_dir=None,
    )
    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        traffic = Path(tmp) / "traffic.log"
        fleet = Fleet(fleet_options, Path(tmp))
        try:
            fleet.start()
            stack = fleet.stack
            assert stack is not None
            for name, settings, _ in CONFIGS:
                if name == RECORDED:
                    settings = {**settings, "traffic_log": str(traffic)}
                # The replay models the approximate index: the real runs use it too.
                stack.write_router_config(**settings, kv_events=False)
                stack.restart_routers(1)  # stops the recording router: its log is whole
                if settings["routing_strategy"] == PREFIX_AWARE:
                    wait_for_idle_pressure(stack)
                result = open_loop(fleet, name, stack.url, requests, events=False)
                measured[name] = {
                    "hit_rate": result.hit_rate,
                    "shares": result.shares,
                    "failures": result.failures,
                    "requests": len(result.outcomes),
                }
                log.info("bench.replay.real", workload=workload, path=name, hit=result.hit_rate)
            addresses = list(fleet.addresses)
        finally:
            fleet.stop()
        service = ServiceModel(
            output_tokens=round(statistics.fmean(output_tokens(r) for r in requests))
        )
        configs = [_replay_config(*replayed, fleet_options) for _, _, replayed in CONFIGS]
        found = replay(
            traffic,
            configs,
            RouterConfig(concurrency_threshold=fleet_options.concurrency_threshold),
            service,
            hosts=addresses,
        )
        if grid is not None and options.out_dir is not None:
            _store_grid(options, traffic, grid, service, addresses)
    rows = []
    for (name, settings, _), predicted in zip(CONFIGS, found.results, strict=True):
        real = measured[name]
        predicted_shares = dict(zip(addresses, predicted.shares, strict=True))
        rows.append(
            {
                "config": name,
                "settings": settings,
                "replayed_as": predicted.config.label,
                "measured": real,
                "predicted": {
                    "hit_rate": predicted.hit_rate,
                    "shares": predicted_shares,
                    "overflow_rate": predicted.overflow_rate,
                },
                "hit_rate_error": 100 * abs(predicted.hit_rate - real["hit_rate"]),
                "share_error": 100
                * max(abs(predicted_shares[a] - real["shares"].get(a, 0.0)) for a in addresses),
            }
        )
    return {
        "workload": asdict(spec),
        "requests": len(requests),
        "records": found.records,
        "skipped": found.skipped,
        "addresses": addresses,
        "simulator": {"args": simulator_args(fleet_options)},
        "replay": {
            "output_tokens": service.output_tokens,
            "cache_tokens": _cache_tokens(fleet_options),
            "decisions_per_cpu_s": found.decisions_per_cpu_s,
        },
        "rows": rows,
    }


def _store_grid(
    options: ReplayAccuracyOptions,
    traffic: Path,
    grid: Grid,
    service: ServiceModel,
    addresses: list[str],
) -> None:
    router = RouterConfig()
    found = replay(traffic, grid, router, service, hosts=addresses)
    command = f"{options.command}  # then: prefix-router replay <the log> (the grid below)"
    data = replay_report.document(found, Path("traffic.log"), command, router, service)
    assert options.out_dir is not None
    report.write_rendered(options.out_dir, f"{options.name}-grid", data)


def run(options: ReplayAccuracyOptions) -> dict[str, Any]:
    data = {
        "kind": KIND,
        "format": FORMAT,
        "command": options.command,
        "machine": report.machine_description(),
        "recorded_under": RECORDED,
        "bounded": list(BOUNDED),
        "record_block_bytes": RECORD_BLOCK_BYTES,
        "bounds": {"hit_rate_points": HIT_RATE_POINTS, "share_points": SHARE_POINTS},
        "draws": DRAWS,
        "workloads": [
            measure_workload(options, w, options.grid if at == 0 else None)
            for at, w in enumerate(options.workloads)
        ],
    }
    if options.out_dir is not None:
        report.write_rendered(options.out_dir, options.name, data)
    return data


def compared(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """The three configurations the bounds apply to."""
    return [row for row in workload["rows"] if row["config"] in BOUNDED]


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def render(data: dict[str, Any]) -> str:
    bounds = data["bounds"]
    sections = []
    for workload in data["workloads"]:
        rows = []
        for row in workload["rows"]:
            note = ""
            if row["config"] == data["recorded_under"]:
                note = " (recorded under; a draw)"
            elif row["config"] not in data["bounded"]:
                note = " (a draw)"
            rows.append(
                (
                    row["config"] + note,
                    _pct(row["measured"]["hit_rate"]),
                    _pct(row["predicted"]["hit_rate"]),
                    f"{row['hit_rate_error']:.1f}",
                    _pct(max(row["measured"]["shares"].values())),
                    _pct(max(row["predicted"]["shares"].values())),
                    f"{row['share_error']:.1f}",
                )
            )
        within = all(
            row["hit_rate_error"] <= bounds["hit_rate_points"]
            and row["share_error"] <= bounds["share_points"]
            for row in compared(workload)
        )
        spec = workload["workload"]
        sections.append(
            f"""## {spec["name"]}

{workload["requests"]} requests ({spec["rate_per_s"]:g}/s for {spec["duration_s"]:g} s) on
{len(workload["addresses"])} simulated instances; {workload["records"]} records replayed
({workload["skipped"]} skipped), with {workload["replay"]["output_tokens"]} output tokens a
request and {workload["replay"]["cache_tokens"]:,} cache tokens an instance.

{
                report.markdown_table(
                    (
                        "configuration",
                        "measured hit rate",
                        "predicted",
                        "error (points)",
                        "busiest instance, measured",
                        "predicted",
                        "worst instance's share error (points)",
                    ),
                    rows,
                )
            }

Every bounded configuration within {bounds["hit_rate_points"]:g} points of hit rate and
{bounds["share_points"]:g} points of each instance's share: **{"yes" if within else "no"}**.
"""
        )
    body = "\n".join(sections)
    return f"""# How well a replay predicts

A traffic log was recorded (at {data["record_block_bytes"]}-byte blocks) while each workload
ran under {data["recorded_under"]}; `prefix-router replay` then predicted what other
configurations would do with that traffic, and those ran for real, on the same fleet, with
the same requests, each from cold caches. The share error is the largest difference, over
the instances, between an instance's predicted and measured share of the requests. The
bounds apply to the configurations that decide without a random draw; for those marked "a
draw" (RANDOM, and LEAST_OUTSTANDING_REQUESTS, which at these loads mostly chooses between
idle instances by a draw) the replay predicts the mean of {data["draws"]} draws, and one
real run's shares scatter around it by chance.

{body}
```
{data["command"]}
```

- Machine: {data["machine"]}
"""
