"""``prefix-router control-plane``: EDS of the healthy vLLM hosts, and the load feed."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from extproc import ports
from extproc.cli.common import COMMAND_HELP, Commands, add_host_flag, host_address


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "control-plane",
        help=COMMAND_HELP["control-plane"],
    )
    parser.add_argument("--config", type=Path, help="YAML config file; re-read when it changes")
    parser.add_argument(
        "--listen",
        type=host_address,
        help=f"xDS gRPC address, ip:port (default {ports.loopback(ports.CONTROL_PLANE_XDS)})",
    )
    parser.add_argument(
        "--metrics-listen",
        type=host_address,
        help=f"Prometheus address, ip:port (default {ports.loopback(ports.CONTROL_PLANE_METRICS)})",
    )
    add_host_flag(
        parser,
        "a vLLM host; repeatable (replaces the config's hosts)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from extproc import logs
    from extproc.control.config import load_control_plane_config
    from extproc.control.service import serve

    overrides: dict[str, Any] = {"listen": args.listen, "metrics_listen": args.metrics_listen}
    if args.host:
        overrides["hosts"] = tuple(args.host)
    config = load_control_plane_config(args.config, overrides)
    logs.configure(config.log_level)
    asyncio.run(serve(config, args.config))
    return 0
