"""``prefix-router router``: the ext_proc router (gRPC)."""

from __future__ import annotations

import argparse
from pathlib import Path

from extproc import ports
from extproc.cli.common import (
    COMMAND_HELP,
    Commands,
    add_host_flag,
    add_routing_flags,
    host_address,
    listen_address,
    routing_overrides,
    workers_count,
)


def register(commands: Commands) -> None:
    parser = commands.add_parser("router", help=COMMAND_HELP["router"])
    parser.add_argument("--config", type=Path, help="YAML config file")
    parser.add_argument(
        "--listen",
        type=listen_address,
        help="gRPC listen address, ip:port or unix:/absolute/path "
        f"(default {ports.loopback(ports.ROUTER_GRPC)})",
    )
    parser.add_argument(
        "--metrics-listen",
        type=host_address,
        help=f"Prometheus address, ip:port (default {ports.loopback(ports.ROUTER_METRICS)})",
    )
    parser.add_argument(
        "--control-plane",
        type=host_address,
        metavar="IP:PORT",
        help="the control plane's xDS address; it supplies the hosts and the load feed",
    )
    add_host_flag(
        parser,
        "an upstream host; repeatable (replaces the config's hosts)",
    )
    parser.add_argument(
        "--workers",
        type=workers_count,
        metavar="N",
        help="router processes, worker i on the --listen and --metrics-listen ports + i "
        "(a --listen socket's path + .i); auto: one per core (default 1; one per free core "
        "serves the most streams)",
    )
    add_routing_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from extproc import logs
    from extproc.adapter.service import run as run_router
    from extproc.config import load_config

    overrides = routing_overrides(args)
    overrides["listen"] = args.listen
    overrides["metrics_listen"] = args.metrics_listen
    overrides["control_plane"] = args.control_plane
    overrides["workers"] = args.workers
    if args.host:
        overrides["hosts"] = tuple(args.host)
    config = load_config(args.config, overrides=overrides)
    logs.configure(config.log_level)
    if config.workers > 1:
        from extproc.adapter.workers import Supervisor

        return Supervisor(config, args.config, overrides).run()
    run_router(config, config_path=args.config, overrides=overrides)
    return 0
