"""What one fleet benchmark run is asked to do: the workload, the fleet, the paths, and
the optional probes and closed loop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.bench.fleet_paths import (
    FIXED,
    NO_OVERFLOW,
    OUR_STRATEGIES,
    PEERS,
    RING_HASH,
    STREAMED,
    TWO_REPLICAS,
)
from extproc.bench.workloads import WorkloadSpec
from extproc.control.config import LoadFeedSettings

# Each simulated instance's KV cache, in blocks of 16 tokens.
CAPACITY_BLOCKS = 4000
# The pressure time constant of smoke runs (``--quick``, the tests): a fifth of the
# control plane's default, so a path waits seconds, not most of a minute, for the path
# before it to die away.
QUICK_RATE_TIME_CONSTANT_S = 2.0


@dataclass(frozen=True)
class FleetBenchOptions:
    workload: WorkloadSpec
    instances: int = 7
    time_scale: float = 1.0
    # About 7.8 documents of 8k tokens per instance: the fleet holds the working set only
    # if placement keeps each document on few instances.
    sim_args: tuple[str, ...] = ("--capacity-blocks", str(CAPACITY_BLOCKS))
    concurrency_threshold: int = 32
    prefix_length: int = 8192
    paths: tuple[str, ...] = (*OUR_STRATEGIES, FIXED, TWO_REPLICAS, RING_HASH, *PEERS)
    out_dir: Path | None = Path("docs/benchmarks")
    command: str = ""
    # Instances started but not published at first (the scale-event benchmark adds them).
    spare_instances: int = 0
    # Routing overhead: this many probes per path and per direct call; 0 skips it.
    overhead_probes: int = 0
    # Closed-loop saturation run after the open loop, for these paths; 0 clients skips it.
    closed_loop_concurrency: int = 0
    closed_loop_requests: int = 300
    closed_loop_time_scale: float = 4.0
    closed_loop_time_limit_s: float = 90.0
    # Not every path: each saturation run takes about a minute of wall time.
    closed_loop_paths: tuple[str, ...] = ("RANDOM", "PREFIX_AWARE", RING_HASH)
    # The report's file name (without .md); None: the workload's name.
    report_name: str | None = None
    # The control plane's load_feed.rate_time_constant_s; None: its default. Each router
    # path waits for the last path's (or the overhead probes') cache pressure to die away,
    # 35-45 s at the default's 10 s after a smoke-size path: smoke runs shorten it.
    rate_time_constant_s: float | None = None

    @property
    def name(self) -> str:
        return self.report_name or self.workload.name


def default_paths(workload: str) -> tuple[str, ...]:
    """Every path; the hot spot adds PREFIX_AWARE without overflow, to show what it buys,
    and behind a streamed-body Envoy, to show overflow still protects the tail there."""
    paths = FleetBenchOptions.paths
    if workload == "hot-spot":
        at = paths.index("PREFIX_AWARE") + 1
        paths = (*paths[:at], NO_OVERFLOW, STREAMED, *paths[at:])
    return paths


# The hot spot sends about half of its requests for one cached document; with at most 16
# sequences at once (a memory-tight long-context deployment) instead of vLLM's 256, one
# instance can be overloaded at the request rates this benchmark drives.
HOT_SPOT_SIM_ARGS = ("--max-num-seqs", "16")


def default_sim_args(workload: str, capacity_blocks: int | None = None) -> tuple[str, ...]:
    """The simulators' arguments for ``workload``; ``capacity_blocks`` replaces the default
    cache size (a fleet whose caches cannot hold the working set)."""
    extra = HOT_SPOT_SIM_ARGS if workload == "hot-spot" else ()
    base = FleetBenchOptions.sim_args
    if capacity_blocks is not None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, not {capacity_blocks}")
        base = ("--capacity-blocks", str(capacity_blocks))
    return (*base, *extra)


def simulator_args(options: FleetBenchOptions) -> list[str]:
    """What every simulator runs with: ``prefix-router sim`` these, plus its addresses."""
    # Each simulator publishes vLLM's KV events on vLLM's ports of its own address.
    timing = ["--timing", "model", "--time-scale", str(options.time_scale)]
    return [*timing, "--kv-events", *options.sim_args]


def stack_router_settings(options: FleetBenchOptions) -> dict[str, Any]:
    """The router settings every one of our paths starts from (a path's own settings are
    written over them)."""
    return {
        "concurrency_threshold": options.concurrency_threshold,
        "prefix_length": options.prefix_length,
    }


def control_plane_settings(options: FleetBenchOptions) -> dict[str, Any]:
    """The control plane's settings over its defaults: none but a shorter pressure time
    constant where the run asks for one."""
    if options.rate_time_constant_s is None:
        return {}
    return {"load_feed": {"rate_time_constant_s": options.rate_time_constant_s}}


def effective_rate_time_constant_s(options: FleetBenchOptions) -> float:
    """The pressure time constant the run's control plane smooths with."""
    if options.rate_time_constant_s is not None:
        return options.rate_time_constant_s
    return float(LoadFeedSettings().rate_time_constant_s)
