"""Benchmarks of one part of the router: its overhead per request, its host-set changes
(fleet-events) and its prefix index."""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace
from pathlib import Path

from extproc.cli.bench.workload import Workload, command_line, duration, out, quick, rounds

OVERHEAD_DURATION_S = 10.0


def native_noop(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--native-noop",
        type=Path,
        default=os.environ.get("PREFIX_ROUTER_NATIVE_NOOP"),
        metavar="BINARY",
        help="a native ext_proc processor that decides nothing (../shared/tools/native-noop/"
        "noop-extproc), run as one more floor beside the Python noop; the report then "
        "states the router's cost against both (default: $PREFIX_ROUTER_NATIVE_NOOP; "
        "unset: not run)",
    )


def run_overhead(args: argparse.Namespace) -> int:
    from extproc.bench.overhead import OverheadOptions, run

    run(
        OverheadOptions(
            duration_s=2.0 if args.quick else (args.duration or OVERHEAD_DURATION_S),
            rounds=1 if args.quick else args.rounds,
            out_dir=args.out,
            native_noop=args.native_noop,
        )
    )
    return 0


def run_fleet_events(args: argparse.Namespace) -> int:
    from extproc.bench import fleet_events

    path = fleet_events.run(
        fleet_events.FleetEventOptions(
            prefixes=50 if args.quick else 200,
            rounds=1 if args.quick else args.rounds,
            out_dir=args.out,
        )
    )
    print(path.read_text())
    return 0


def run_long_streams(args: argparse.Namespace) -> int:
    from extproc.bench import long_streams

    options = long_streams.LongStreamOptions(out_dir=args.out, command=command_line(args))
    if args.quick:
        options = replace(options, requests=50, stream_s=4.0, itl_s=0.25)
    data = long_streams.run(options)
    for body_mode, result in data["runs"].items():
        held = long_streams.middle(result, data["options"], "ext_proc_streams")
        print(f"{body_mode}: {result['completed']} completed, {held:.0f} ext_proc streams held")
    return 0


def run_prefix_index(args: argparse.Namespace) -> int:
    from extproc.bench import prefix_index

    options = prefix_index.PrefixIndexOptions(out_dir=args.out, command=command_line(args))
    if args.quick:
        options = replace(options, iterations=200, seeds=(1,), quality_duration_s=10.0)
    data = prefix_index.run(options)
    for cost in data["costs"]:
        print(cost)
    return 0


def run_kv_events(args: argparse.Namespace) -> int:
    from extproc.bench import kv_events

    options = kv_events.KvEventsOptions(out_dir=args.out, command=command_line(args))
    if args.quick:
        options = replace(options, iterations=200, ingest_prompts=20, rounds=1)
    data = kv_events.run(options)
    for cost in data["request_path"]:
        print(cost)
    for ingest in data["ingest"]:
        print(ingest["decoder"], f"{statistics.median(ingest['cpu_us_per_block']):.2f} us/block")
    return 0


def run_http_clients(args: argparse.Namespace) -> int:
    from extproc.bench import http_clients

    options = http_clients.HttpClientOptions(
        rounds=1 if args.quick else args.rounds, out_dir=args.out, command=command_line(args)
    )
    if args.quick:
        options = replace(options, levels=(200,), stream_s=1.0, itl_s=0.1)
    for row in http_clients.summary(http_clients.run(options)):
        print(
            f"{row['level']} at once, {row['client']}: {row['cpu_ms_per_request']:.2f} ms "
            f"of client CPU per request, whole: {row['all_completed']}"
        )
    return 0


WORKLOADS = (
    Workload(
        "overhead",
        "direct vs Envoy vs Envoy+router, at concurrency 1 and 16 (needs wrk)",
        (rounds, duration(OVERHEAD_DURATION_S, "seconds per sample"), quick, native_noop, out),
        run_overhead,
    ),
    Workload(
        "fleet-events",
        "prefixes moved scaling 3->4->3, and time from a host's death to its ejection",
        (rounds, quick, out),
        run_fleet_events,
    ),
    Workload(
        "long-streams",
        "ext_proc streams Envoy holds while 500 responses stream for 30 s, per body mode",
        (quick, out),
        run_long_streams,
    ),
    Workload(
        "kv-events",
        "what reading the engines' KV events costs: the request path, ingestion, memory",
        (quick, out),
        run_kv_events,
    ),
    Workload(
        "http-clients",
        "the load generators' client: its CPU per streaming request, aiohttp's and httpx's",
        (rounds, quick, out),
        run_http_clients,
    ),
    Workload(
        "prefix-index",
        "the prefix index's cost per request and its block size's effect on routing",
        (quick, out),
        run_prefix_index,
    ),
)
