"""``prefix-router up``: Envoy, the router, the control plane and a fleet on loopback.

The fleet is simulated (``--backends`` of them) unless ``--backend`` names real vLLM
servers. Either way the hosts reach every part: the control plane's config lists them, it
publishes them to the router and (override-host mode) to Envoy over EDS, and in
original-dst mode Envoy connects to the one the router names.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from extproc import ports
from extproc.cli.common import (
    COMMAND_HELP,
    Commands,
    add_routing_flags,
    backend_url,
    choices,
    ip_port,
    routing_overrides,
    usage_error,
    workers_count,
)
from extproc.stack.bootstrap import BODY_MODES, MODES

if TYPE_CHECKING:
    from extproc.stack.local import LocalStack, StackSpec

# The simulated fleet's flags and their defaults; they cannot apply with --backend, so they
# default to None and an explicit one beside --backend is refused.
SIM_DEFAULTS: dict[str, Any] = {
    "backends": 3,
    "sim_port": ports.SIM_PORT,
    "sim_ttft_ms": 20.0,
    "sim_itl_ms": 5.0,
}


def _address_flag(parser: argparse.ArgumentParser, flag: str, default: str, text: str) -> None:
    parser.add_argument(
        flag, type=ip_port, default=ip_port(default), help=f"{text}, ip:port (default {default})"
    )


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "up",
        help=COMMAND_HELP["up"],
        description="Start, on loopback: simulated vLLM backends (or your --backend URLs), "
        "the router and Envoy, and print the URL. Ctrl-C stops everything.",
    )
    _address_flag(parser, "--listen", ports.loopback(ports.ENVOY_LISTEN), "Envoy's listener")
    _address_flag(parser, "--admin", ports.loopback(ports.ENVOY_ADMIN), "Envoy's admin interface")
    _address_flag(
        parser, "--router-listen", ports.loopback(ports.ROUTER_GRPC), "the router's gRPC address"
    )
    _address_flag(
        parser,
        "--router-metrics",
        ports.loopback(ports.ROUTER_METRICS),
        "the router's Prometheus endpoint",
    )
    _address_flag(
        parser,
        "--control-plane",
        ports.loopback(ports.CONTROL_PLANE_XDS),
        "the control plane's xDS address",
    )
    _address_flag(
        parser,
        "--control-plane-metrics",
        ports.loopback(ports.CONTROL_PLANE_METRICS),
        "the control plane's Prometheus endpoint",
    )
    parser.add_argument(
        "--mode",
        choices=choices(MODES),
        default="override-host",
        help="how Envoy applies the choice (default override-host)",
    )
    parser.add_argument(
        "--body-mode",
        choices=choices(BODY_MODES),
        default="buffered-partial",
        help="how Envoy sends the body to the router: buffered-partial (two round trips) "
        "or streamed (one; the router's answer to the headers carries the decision) "
        "(default buffered-partial)",
    )
    parser.add_argument(
        "--workers",
        type=workers_count,
        default=1,
        metavar="N",
        help="router processes, worker i on the router's ports + i; each is an endpoint of "
        "Envoy's ext_proc cluster; auto: one per core (default 1)",
    )
    sim = parser.add_argument_group("the simulated fleet (not with --backend)")
    sim.add_argument(
        "--backends", type=int, help="how many simulated backends to start (default 3)"
    )
    sim.add_argument(
        "--sim-port",
        type=int,
        help="port of the simulated backends, on 127.0.0.11, .12, ... (default 8000)",
    )
    sim.add_argument(
        "--sim-ttft-ms", type=float, help="simulated time to first token in ms (default 20)"
    )
    sim.add_argument(
        "--sim-itl-ms", type=float, help="simulated time per further output token in ms (default 5)"
    )
    parser.add_argument(
        "--backend",
        type=backend_url,
        action="append",
        default=[],
        metavar="URL",
        help="a real vLLM server, http://host:port; repeatable. Replaces the simulated fleet "
        "in either --mode",
    )
    parser.add_argument(
        "--no-upstream-host-header",
        action="store_true",
        help="do not add x-upstream-host to responses",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="where configs and logs go (default: a new temp dir, removed on exit)",
    )
    add_routing_flags(parser)
    parser.set_defaults(handler=run)


def inapplicable(args: argparse.Namespace) -> str | None:
    """Why a flag given cannot apply, or None: the simulated fleet's flags beside --backend."""
    if not args.backend:
        return None
    for name in SIM_DEFAULTS:
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            return f"{flag} applies to the simulated fleet only; --backend replaces it"
    return None


def stack_spec(args: argparse.Namespace) -> StackSpec:
    """The stack the flags describe; the routing settings are validated here, so a bad
    value fails before anything starts."""
    from extproc.config import StreamEnd, load_config
    from extproc.stack.local import StackSpec, simulated_backends

    overrides = {k: v for k, v in routing_overrides(args).items() if v is not None}
    addresses = {
        "listen": "{}:{}".format(*args.router_listen),
        "metrics_listen": "{}:{}".format(*args.router_metrics),
        "workers": args.workers,
    }
    config = load_config(env={}, overrides={**overrides, **addresses})
    sim = {
        name: SIM_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
        for name in SIM_DEFAULTS
    }
    return StackSpec(
        mode=args.mode,
        listen=args.listen,
        admin=args.admin,
        router=args.router_listen,
        router_metrics=args.router_metrics,
        control_plane=args.control_plane,
        control_plane_metrics=args.control_plane_metrics,
        external_backends=tuple(args.backend),
        sim_backends=() if args.backend else simulated_backends(sim["backends"], sim["sim_port"]),
        router_settings=overrides,
        upstream_host_header=not args.no_upstream_host_header,
        body_mode=args.body_mode,
        # Routers whose streams end at the decision learn of completions from Envoy's log.
        envoy_settings={"completion_log": config.stream_end is StreamEnd.DECISION},
        router_workers=config.workers,
        sim_args=("--ttft-ms", str(sim["sim_ttft_ms"]), "--itl-ms", str(sim["sim_itl_ms"])),
        work_dir=args.work_dir,
    )


def _print_banner(stack: LocalStack) -> None:
    backends = ", ".join(f"{h}:{p}" for h, p in stack.spec.backends)
    print(f"prefix-router is up: {stack.url}  (backends: {backends})", flush=True)
    print(f"  envoy admin {stack.admin_url}   router metrics {stack.router_metrics_url}")
    print(f"  control plane config {stack.control_plane_config_path()} (edit to change hosts)")
    print(f"  logs in {stack.work_dir}")
    print(
        f"  try: curl -si {stack.url}/v1/chat/completions -H 'content-type: application/json'"
        ' -d \'{"model":"sim-model","messages":[{"role":"user","content":"hello"}]}\'',
        flush=True,
    )
    print("Ctrl-C stops everything.", flush=True)


def run(args: argparse.Namespace) -> int:
    from extproc.stack.local import LocalStack

    problem = inapplicable(args)
    if problem is not None:
        return usage_error("up", problem)
    spec = stack_spec(args)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stack = LocalStack(spec)
    print("starting simulators, router and envoy ...", flush=True)
    with stack:
        _print_banner(stack)
        while not stop.wait(0.5):
            for process in [stack.envoy, stack.router, stack.control_plane, *stack.sims]:
                if process is not None and not process.running:
                    print(f"{process.name} exited unexpectedly:\n{process.log_tail()}", flush=True)
                    return 1
    print("stopped.", flush=True)
    return 0
