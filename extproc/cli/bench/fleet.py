"""The fleet workloads (one per ``WorkloadName``) and the scale event: the routing paths
side by side on a fleet of simulated vLLM instances."""

from __future__ import annotations

import argparse
from typing import get_args

from extproc.bench.workloads import WorkloadName
from extproc.cli.bench.workload import (
    Workload,
    command_line,
    duration,
    out,
    paths,
    quick,
    split_paths,
)

FLEET_DURATION_S = 40.0


def fleet_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rate", type=float, default=4.0, help="requests per second (model time) (default 4)"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="compress simulated time by this factor (default 1)",
    )
    parser.add_argument(
        "--report-name", help="the report's file name, without .md (default: the workload's)"
    )
    parser.add_argument(
        "--overhead-probes",
        type=int,
        default=0,
        help="measure each path's routing overhead with this many probes against instantly "
        "answering simulators (0: skip; default 0)",
    )
    parser.add_argument(
        "--closed-loop",
        type=int,
        default=0,
        help="after the open loop, a saturation run with this many concurrent clients "
        "(0: skip; default 0)",
    )
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="each simulated instance's KV cache, in 16-token blocks (default: the fleet "
        "benchmarks' own, extproc/bench/fleet_options.py; smaller than the working set: a "
        "fleet whose caches cannot hold it)",
    )
    parser.add_argument(
        "--prefix-length",
        type=int,
        default=8192,
        help="the router's prefix_length; set it to the part requests share "
        "(conversations: the system prompt and first user turn) (default 8192)",
    )


def run_fleet(args: argparse.Namespace) -> int:
    from extproc.bench import fleet
    from extproc.bench.workloads import WorkloadSpec

    spec = WorkloadSpec(
        name=args.workload,
        rate_per_s=args.rate,
        duration_s=10.0 if args.quick else (args.duration or FLEET_DURATION_S),
        **({"documents": 12} if args.quick and "conversations" not in args.workload else {}),
    )
    results = fleet.run(
        fleet.FleetBenchOptions(
            workload=spec,
            time_scale=args.time_scale,
            prefix_length=args.prefix_length,
            out_dir=args.out,
            command=command_line(args),
            paths=split_paths(args.paths) if args.paths else fleet.default_paths(args.workload),
            sim_args=fleet.default_sim_args(args.workload, args.capacity_blocks),
            overhead_probes=args.overhead_probes,
            closed_loop_concurrency=args.closed_loop,
            closed_loop_requests=24 if args.quick else 300,
            report_name=args.report_name,
            rate_time_constant_s=fleet.QUICK_RATE_TIME_CONSTANT_S if args.quick else None,
        )
    )
    for result in results:
        print(
            f"{result.path:28} p50 {result.percentile(0.5):8.0f} ms  "
            f"p90 {result.percentile(0.9):8.0f} ms  hit {result.hit_rate:6.1%}  "
            f"failed {result.failures}"
        )
    return 0


def run_scale_event(args: argparse.Namespace) -> int:
    import dataclasses

    from extproc.bench import scale_event

    options = scale_event.ScaleEventOptions(out_dir=args.out, command=command_line(args))
    if args.quick:
        options = scale_event.quick(options)
    if args.paths:
        options = dataclasses.replace(options, paths=split_paths(args.paths))
    for result in scale_event.run(options):
        for event in result.events:
            print(
                f"{result.path:16} {event.name}: hit {event.baseline:.1%} -> lowest "
                f"{event.lowest:.1%}, recovery {event.recovery_s} s, moved {event.moved}"
            )
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from extproc.bench import replay_accuracy

    options = replay_accuracy.ReplayAccuracyOptions(
        rate_per_s=args.rate,
        duration_s=args.duration or replay_accuracy.ReplayAccuracyOptions.duration_s,
        out_dir=args.out,
        command=command_line(args),
    )
    if args.quick:
        options = replay_accuracy.quick(options)
    data = replay_accuracy.run(options)
    for workload in data["workloads"]:
        for row in workload["rows"]:
            print(
                f"{workload['workload']['name']:14} {row['config']:28} "
                f"hit {row['measured']['hit_rate']:6.1%} predicted "
                f"{row['predicted']['hit_rate']:6.1%}  share error {row['share_error']:4.1f} pts"
            )
    return 0


def run_shadow(args: argparse.Namespace) -> int:
    from extproc.bench import shadow

    options = shadow.ShadowOptions(
        rate_per_s=args.rate,
        duration_s=args.duration or shadow.ShadowOptions.duration_s,
        out_dir=args.out,
        command=command_line(args),
    )
    if args.quick:
        options = shadow.quick(options)
    data = shadow.run(options)
    for workload in data["workloads"]:
        print(
            f"{workload['workload']['name']:14} predicted "
            f"{workload['predicted']['hit_rate']:6.1%}  PREFIX_AWARE "
            f"{workload['prefix_aware']['hit_rate']:6.1%}  shadow +"
            f"{workload['cost']['added_us']['shadow']:.1f} us, log +"
            f"{workload['cost']['added_us']['traffic log']:.1f} us"
        )
    return 0


def replay_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second (default 6)")


WORKLOADS = (
    *(
        Workload(
            name,
            f"fleet workload {name}: the routing paths side by side on simulated vLLM",
            (
                fleet_flags,
                paths,
                duration(FLEET_DURATION_S, "seconds of arrivals in model time"),
                quick,
                out,
            ),
            run_fleet,
        )
        for name in get_args(WorkloadName)
    ),
    Workload(
        "replay",
        "how well prefix-router replay predicts: record a traffic log under RANDOM, replay "
        "it for three configurations, run those for real, compare",
        (replay_flags, duration(60.0, "seconds of arrivals"), quick, out),
        run_replay,
    ),
    Workload(
        "shadow",
        "shadow mode: serve each workload with RANDOM while shadowing, then with "
        "PREFIX_AWARE, and compare; and what shadow mode and the traffic log cost",
        (replay_flags, duration(60.0, "seconds of arrivals"), quick, out),
        run_shadow,
    ),
    Workload(
        "scale-event",
        "long-context while the fleet grows 7 -> 8 instances and shrinks to 6",
        (paths, quick, out),
        run_scale_event,
    ),
)
