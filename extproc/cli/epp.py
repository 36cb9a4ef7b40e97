"""``prefix-router epp``: the router as a Gateway API Inference Extension endpoint picker.

It serves ext_proc on 9002 (TLS with a self-signed certificate unless given one, or
plaintext with ``--secure-serving=false``), gRPC health on 9003 and metrics on 9090, as the
reference endpoint picker does, and takes the reference chart's flags so that its values
work unchanged: those it has no use for (the pool's name, leader election, log encoding)
are accepted and logged. docs/kubernetes.md describes the setup for each gateway.

``--workers N`` runs N picker processes behind those same ports: a gateway knows one
address for its picker, so every worker binds the gRPC and health ports itself
(SO_REUSEPORT, ``workers_share_listen``) and the kernel spreads the gateway's connections
over them; worker i serves its metrics on the metrics port + i, as router workers do.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path
from typing import Any

from extproc import ports
from extproc.cli.common import (
    COMMAND_HELP,
    Commands,
    add_host_flag,
    add_routing_flags,
    host_address,
    routing_overrides,
    workers_count,
)

# The reference chart's flags this picker accepts and does not act on. Discovery comes
# from the control plane or the gateway's subset hint (docs/kubernetes.md).
IGNORED_VALUE_FLAGS = (
    "--pool-name",
    "--pool-namespace",
    "--pool-group",
    "--config-file",
    "--config-text",
    "--zap-encoder",
    "--zap-log-level",
    "--metrics-endpoint-auth",
    "--total-queued-requests-metric",
    "--kv-cache-usage-percentage-metric",
    "--lora-info-metric",
    "--cache-info-metric",
    "--refresh-metrics-interval",
    "--refresh-prometheus-metrics-interval",
    "--tracing",
    "--model-server-metrics-port",
    "--model-server-metrics-path",
    "--model-server-metrics-scheme",
)
IGNORED_SWITCHES = ("--ha-enable-leader-election", "--enable-pprof", "--metrics-endpoint-auth")


def go_bool(text: str) -> bool:
    """A Go flag's boolean (``--secure-serving=false``)."""
    value = text.strip().lower()
    if value in ("1", "t", "true"):
        return True
    if value in ("0", "f", "false"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "epp",
        help=COMMAND_HELP["epp"],
        description="The ext_proc router as an endpoint picker (protocol 1.0.0): full-duplex "
        "streamed bodies, the subset hint, the served endpoint. Flags of the reference "
        "chart that have no meaning here are accepted and ignored.",
    )
    parser.add_argument("--config", type=Path, help="YAML router config file")
    parser.add_argument(
        "--bind-address",
        default="0.0.0.0",
        help="the IP the three ports listen on (default 0.0.0.0, for a pod)",
    )
    parser.add_argument(
        "--grpc-port", type=int, default=ports.EPP_GRPC, help="ext_proc (default %(default)s)"
    )
    parser.add_argument(
        "--grpc-health-port",
        type=int,
        default=ports.EPP_HEALTH,
        help="gRPC health (default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=ports.EPP_METRICS,
        help="Prometheus (default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=workers_count,
        metavar="N",
        help="picker processes, all on the gRPC and health ports (SO_REUSEPORT: the kernel "
        "spreads connections over them), worker i on the metrics port + i; auto: one per "
        "core (default 1; one per free core serves the most streams)",
    )
    parser.add_argument(
        "--secure-serving",
        type=go_bool,
        nargs="?",
        const=True,
        default=True,
        metavar="BOOL",
        help="serve ext_proc over TLS (default true); --secure-serving=false: plaintext",
    )
    parser.add_argument(
        "--cert-path",
        type=Path,
        help="a directory holding tls.crt and tls.key (default: a self-signed certificate "
        "made at start)",
    )
    parser.add_argument(
        "--control-plane",
        type=host_address,
        metavar="IP:PORT",
        help="the control plane's xDS address: the pool's endpoints and the load feed",
    )
    add_host_flag(
        parser,
        "a pool endpoint; repeatable. With neither this nor --control-plane, the "
        "gateway's subset hint is the pool",
    )
    parser.add_argument(
        "--endpoint-list",
        action="store_true",
        default=None,
        help="send the ordered list of endpoints (primary and failover) instead of one",
    )
    parser.add_argument(
        "--conformance-hooks",
        action="store_true",
        default=None,
        help="honour the conformance suite's test-epp-endpoint-selection header (lets a "
        "client choose the upstream: conformance runs only)",
    )
    ignored = parser.add_argument_group("the reference chart's flags, accepted and ignored")
    for flag in IGNORED_VALUE_FLAGS:
        if flag not in IGNORED_SWITCHES:
            ignored.add_argument(flag, dest=_ignored_dest(flag), metavar="VALUE")
    for flag in IGNORED_SWITCHES:
        ignored.add_argument(
            flag, dest=_ignored_dest(flag), nargs="?", const="true", metavar="BOOL"
        )
    ignored.add_argument("-v", "--v", dest="ignored_v", metavar="LEVEL", help="log verbosity")
    add_routing_flags(parser)
    parser.set_defaults(handler=run)


def _ignored_dest(flag: str) -> str:
    return "ignored_" + flag.lstrip("-").replace("-", "_")


def overrides_of(args: argparse.Namespace, cert: tuple[Path, Path] | None) -> dict[str, Any]:
    """The router config the flags make (None: leave the config file's)."""
    overrides = routing_overrides(args)
    bind = args.bind_address
    address = f"[{bind}]" if ":" in bind else bind
    overrides.update(
        epp=True,
        listen=f"{address}:{args.grpc_port}",
        health_listen=f"{address}:{args.grpc_health_port}",
        metrics_listen=f"{address}:{args.metrics_port}",
        workers=args.workers,
        # One address for the gateway, whatever the number of workers.
        workers_share_listen=True,
        control_plane=args.control_plane,
        epp_endpoint_list=args.endpoint_list,
        epp_conformance_hooks=args.conformance_hooks,
    )
    if args.host:
        overrides["hosts"] = tuple(args.host)
    if cert is not None:
        overrides["tls_cert_file"], overrides["tls_key_file"] = (str(p) for p in cert)
    return overrides


def run(args: argparse.Namespace) -> int:
    import structlog

    from extproc import logs, tls
    from extproc.adapter.service import run as run_router
    from extproc.config import load_config

    with contextlib.ExitStack() as cleanup:
        cert: tuple[Path, Path] | None = None
        if args.secure_serving:
            if args.cert_path is not None:
                cert = (args.cert_path / "tls.crt", args.cert_path / "tls.key")
            else:
                directory = Path(cleanup.enter_context(tempfile.TemporaryDirectory()))
                cert = tls.write_self_signed(directory)
        overrides = overrides_of(args, cert)
        config = load_config(args.config, overrides=overrides)
        logs.configure(config.log_level)
        ignored = {k: v for k, v in vars(args).items() if k.startswith("ignored_") and v}
        if ignored:
            structlog.get_logger("epp").info("epp_flags_ignored", **ignored)
        if config.workers > 1:
            from extproc.adapter.workers import Supervisor

            # The self-signed certificate's directory lives until every worker has stopped.
            return Supervisor(config, args.config, overrides).run()
        run_router(config, config_path=args.config, overrides=overrides)
    return 0
