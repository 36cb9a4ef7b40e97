"""``prefix-router replay LOG``: what each routing configuration would have done with the
traffic a router logged (``traffic_log``), before switching to it."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from extproc.cli.common import COMMAND_HELP, Commands, host_address, require_extra
from extproc.replay.configs import STRATEGIES, Grid
from extproc.replay.report import MAX_BUSIEST_RATIO

DEFAULT_GRID = Grid(strategies=STRATEGIES, instances=(1,), cache_tokens=(1,))


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "replay",
        help=COMMAND_HELP["replay"],
        description="Replay a traffic log (the router's traffic_log setting) through the "
        "router's own decision code and the simulator's model of vLLM's prefix cache, for "
        "every combination of the values given; print the predicted hit rate, each "
        "instance's share, overflow and prefill saved, and recommend a configuration.",
    )
    parser.add_argument("log", type=Path, help="the traffic log (its rotated files are read too)")
    grid = parser.add_argument_group("the grid: every combination is replayed")
    grid.add_argument(
        "--instances",
        type=int,
        nargs="+",
        required=True,
        help="fleet sizes: how many vLLM instances serve this traffic",
    )
    grid.add_argument(
        "--cache-tokens",
        type=int,
        nargs="+",
        required=True,
        help="each instance's KV cache in tokens (num_gpu_blocks x block_size of "
        "vllm:cache_config_info)",
    )
    grid.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=list(DEFAULT_GRID.strategies),
        help="PREFIX_AWARE is longest match (the default); PREFIX_AWARE-fixed is "
        "SageMaker's fixed-length key (default: all four)",
    )
    grid.add_argument(
        "--concurrency-thresholds",
        type=int,
        nargs="+",
        default=list(DEFAULT_GRID.concurrency_thresholds),
        help="PREFIX_AWARE's concurrency_threshold values (default 32)",
    )
    grid.add_argument(
        "--block-bytes",
        type=int,
        nargs="+",
        default=list(DEFAULT_GRID.block_bytes),
        help="PREFIX_AWARE's block_bytes values, multiples of the log's (default 512)",
    )
    grid.add_argument(
        "--prefix-lengths",
        type=int,
        nargs="+",
        default=list(DEFAULT_GRID.prefix_lengths),
        help="PREFIX_AWARE-fixed's prefix_length values (default 8192)",
    )
    model = parser.add_argument_group("the model of the fleet")
    model.add_argument(
        "--hosts",
        type=host_address,
        nargs="+",
        default=[],
        help="the fleet's ip:port addresses: fleets of that many instances place host by "
        "host as a router over them would (default: virtual addresses)",
    )
    model.add_argument(
        "--config",
        type=Path,
        help="a router config file whose other settings (balance_factor, overload_cost, "
        "...) the replay uses; default: the router's defaults",
    )
    model.add_argument(
        "--output-tokens",
        type=int,
        default=64,
        help="output tokens per request, which the log does not hold (default 64)",
    )
    model.add_argument(
        "--max-busiest",
        type=float,
        default=MAX_BUSIEST_RATIO,
        help="recommend, of the configurations whose busiest instance takes at most this "
        "multiple of a fair share of the requests, the one whose busiest instance would "
        f"prefill the least (default {MAX_BUSIEST_RATIO:g})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="store the run as <out>/<name>.json with its report (.md) and plot (.png)",
    )
    parser.add_argument("--name", default="replay", help="the stored run's name (default replay)")
    parser.add_argument("--limit", type=int, help="replay at most this many records (default: all)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.out is not None:  # the stored run's plot: before the replay, not after it
        require_extra("bench", "replay --out", ("matplotlib",))
    from extproc import reporting
    from extproc.config import load_config
    from extproc.replay import report
    from extproc.replay.replayer import ServiceModel
    from extproc.replay.report import document, render, table
    from extproc.replay.run import replay

    grid = Grid(
        strategies=tuple(args.strategies),
        instances=tuple(args.instances),
        cache_tokens=tuple(args.cache_tokens),
        concurrency_thresholds=tuple(args.concurrency_thresholds),
        block_bytes=tuple(args.block_bytes),
        prefix_lengths=tuple(args.prefix_lengths),
    )
    router = load_config(args.config, env={})
    service = ServiceModel(output_tokens=args.output_tokens)
    found = replay(args.log, grid, router, service, args.limit, tuple(args.hosts))
    command = shlex.join(["prefix-router", *getattr(args, "argv", [])])
    data = document(found, args.log, command, router, service, args.max_busiest)
    if args.out is not None:
        path = reporting.write_rendered(args.out, args.name, data, report)
        print(f"wrote {path}", file=sys.stderr)
    else:
        render(data)  # the same checks, nothing written
    print(table(data))
    print(
        f"\n{found.records:,} requests, {len(found.results)} configurations, "
        f"{found.decisions_per_cpu_s:,.0f} requests a CPU second"
    )
    return 0
