"""``prefix-router envoy-config``: print an Envoy bootstrap."""

from __future__ import annotations

import argparse
import sys

from extproc import ports
from extproc.cli.common import (
    COMMAND_HELP,
    Commands,
    choices,
    ip_port,
    router_endpoint,
    usage_error,
)
from extproc.stack.bootstrap import BODY_MODES, MODES, BootstrapParams, RouterEndpoint
from extproc.stack.upstream_tls import UpstreamTls

DESCRIPTION = (
    "Print an Envoy bootstrap. The backend cluster's hosts come from one place per mode: in "
    "override-host mode from the control plane over EDS (--control-plane), or from --backend "
    "with --static; in original-dst mode from the router's x-target-host header, so no flag "
    "names them. A flag that cannot apply to the chosen mode is refused, not ignored."
)


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "envoy-config",
        help=COMMAND_HELP["envoy-config"],
        description=DESCRIPTION,
    )
    parser.add_argument(
        "--mode",
        choices=choices(MODES),
        default="override-host",
        help="how Envoy applies the router's choice (default override-host)",
    )
    parser.add_argument(
        "--body-mode",
        choices=choices(BODY_MODES),
        default=BootstrapParams.body_mode,
        help="buffered-partial: the router answers the headers, then decides on the body "
        "(two round trips); streamed: Envoy sends the body without waiting and the "
        "router's one answer carries the decision (default buffered-partial)",
    )
    parser.add_argument(
        "--completion-log",
        action="store_true",
        help="report each request's completion to the routers (a gRPC access log to each): "
        "on with --body-mode streamed; give it for routers set to stream_end: decision, "
        "whose streams end before the response does",
    )
    parser.add_argument("--listen", type=ip_port, default=BootstrapParams.listen)
    parser.add_argument("--admin", type=ip_port, default=BootstrapParams.admin)
    parser.add_argument(
        "--router",
        type=router_endpoint,
        action="append",
        default=[],
        help="a router process, ip:port or unix:/absolute/path (its Unix socket); repeatable",
    )
    parser.add_argument(
        "--router-workers",
        type=int,
        default=1,
        metavar="N",
        help="each --router runs `router --workers N`: its endpoints are its port to port "
        "+ N - 1 (a socket: its path, then the path + .1 to + .N-1) (default 1)",
    )
    parser.add_argument(
        "--backend",
        type=ip_port,
        action="append",
        default=[],
        help="a backend, ip:port; repeatable. With --static only (override-host mode)",
    )
    parser.add_argument(
        "--control-plane",
        type=ip_port,
        default=None,
        help="xDS address the backend cluster comes from "
        f"(default {ports.loopback(ports.CONTROL_PLANE_XDS)}); "
        "override-host mode without --static only",
    )
    parser.add_argument(
        "--static",
        action="store_true",
        help="a STATIC backend cluster of --backend hosts instead of EDS (override-host mode)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=BootstrapParams.max_concurrent,
        metavar="N",
        help="circuit breakers of the backend and router clusters: requests, pending "
        "requests and connections each cluster holds at once (default "
        f"{BootstrapParams.max_concurrent}; Envoy's own is 1024)",
    )
    parser.add_argument(
        "--router-max-streams",
        type=int,
        metavar="N",
        help="the most ext_proc streams Envoy holds open to the routers at once: past it a "
        "request fails open at once (cluster.prefix_router.upstream_rq_active_overflow) "
        "instead of waiting for message_timeout. Use it with the routers' stream_end: "
        "decision, where only undecided requests hold a stream (default: --max-concurrent)",
    )
    parser.add_argument(
        "--buffer-limit-bytes",
        type=int,
        default=BootstrapParams.buffer_limit_bytes,
        metavar="N",
        help="the listener's per_connection_buffer_limit_bytes: keep it above the router's "
        "max_body_bytes, since Envoy 1.40 can hang a body that overflows it (default "
        f"{BootstrapParams.buffer_limit_bytes}, 40 MiB)",
    )
    parser.add_argument(
        "--backend-idle-timeout-s",
        type=float,
        default=BootstrapParams.backend_idle_timeout_s,
        metavar="S",
        help="close a backend connection idle this long: keep it below the backends' own "
        "keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), or a request sent as one "
        "closes is reset and retried on another host (default "
        f"{BootstrapParams.backend_idle_timeout_s:g})",
    )
    parser.add_argument(
        "--trusted-salt-header",
        metavar="NAME",
        type=_header_name,
        help="the router's trusted_salt_header: Envoy strips the client's copy before any "
        "other filter, so only a filter you add after the strip filter (your "
        "authentication) can set it",
    )
    parser.add_argument(
        "--upstream-host-header",
        action="store_true",
        help="add x-upstream-host (the backend that served it) and x-router-target (the "
        "router's choice) to every response: for demos and debugging; it shows clients "
        "the fleet's addresses",
    )
    _add_tls_flags(parser, "router", "the routers (the ext_proc and completion-log clusters)")
    _add_tls_flags(parser, "xds", "the control plane (the xds cluster; EDS only)")
    parser.set_defaults(handler=run)


def _add_tls_flags(parser: argparse.ArgumentParser, link: str, upstreams: str) -> None:
    group = parser.add_argument_group(
        f"TLS to {upstreams}",
        f"--{link}-tls-ca turns TLS on; with --{link}-tls-cert and --{link}-tls-key Envoy "
        "presents a client certificate (mTLS). The paths are written as given, for the "
        "machine Envoy runs on.",
    )
    group.add_argument(
        f"--{link}-tls-ca",
        metavar="FILE",
        help="the CA certificates (PEM) the server's certificate must chain to",
    )
    group.add_argument(
        f"--{link}-tls-cert", metavar="FILE", help="the certificate chain Envoy presents (PEM)"
    )
    group.add_argument(f"--{link}-tls-key", metavar="FILE", help="its private key (PEM)")
    group.add_argument(
        f"--{link}-tls-server-name",
        metavar="NAME",
        help="the DNS name the server's certificate must carry, also sent as SNI "
        "(default: the certificate must carry the endpoint's IP)",
    )


def _tls_parts(args: argparse.Namespace, link: str) -> tuple[str | None, ...]:
    return tuple(getattr(args, f"{link}_tls_{p}") for p in ("ca", "cert", "key", "server_name"))


def _tls_problem(args: argparse.Namespace, link: str) -> str | None:
    """Why the TLS flags of ``link`` (router or xds) do not go together, or None."""
    ca, cert, key, name = _tls_parts(args, link)
    if ca is None:
        given = [f"--{link}-tls-{p}" for p, v in (("cert", cert), ("key", key)) if v]
        given += [f"--{link}-tls-server-name"] if name else []
        return f"{given[0]} needs --{link}-tls-ca" if given else None
    if (cert is None) != (key is None):
        return f"--{link}-tls-cert and --{link}-tls-key go together"
    return None


def _tls(args: argparse.Namespace, link: str) -> UpstreamTls | None:
    """TLS to ``link``'s upstreams, or None for plaintext (after ``_tls_problem``)."""
    ca, cert, key, name = _tls_parts(args, link)
    return None if ca is None else UpstreamTls(ca, cert, key, name)


def _inapplicable(args: argparse.Namespace) -> str | None:
    """Why a flag given cannot apply to the chosen mode, or None."""
    if args.xds_tls_ca is not None and (args.mode == "original-dst" or args.static):
        return "--xds-tls-ca applies with EDS only (override-host mode without --static)"
    if args.mode == "original-dst":
        reason = (
            "does not apply to --mode original-dst: Envoy connects to the host the router "
            "names in x-target-host (an ORIGINAL_DST cluster has no host list)"
        )
        given = [
            flag
            for flag, value in (
                ("--backend", args.backend),
                ("--static", args.static),
                ("--control-plane", args.control_plane),
            )
            if value
        ]
        return f"{given[0]} {reason}" if given else None
    if args.static and args.control_plane is not None:
        return "--control-plane does not apply with --static: the backend cluster is STATIC"
    if args.backend and not args.static:
        return (
            "--backend applies with --static only: without it the backend cluster comes "
            "from the control plane over EDS (--control-plane)"
        )
    return None


def _header_name(text: str) -> str:
    """A header name as the router's config takes it (validated by the same schema)."""
    from extproc.config import RouterConfig
    from extproc.errors import ConfigError
    from extproc.schema import validated

    try:
        return str(validated(RouterConfig, {"trusted_salt_header": text}).trusted_salt_header)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _worker_endpoint(router: RouterEndpoint, index: int) -> RouterEndpoint:
    """Where worker ``index`` of ``router --workers N`` listens (see worker_address)."""
    if isinstance(router, str):
        return f"{router}.{index}" if index else router
    return router[0], router[1] + index


def run(args: argparse.Namespace) -> int:
    from extproc.stack.bootstrap import render

    problem = _inapplicable(args)
    if problem is not None:
        return usage_error("envoy-config", problem)
    if not 1 <= args.router_workers <= 64:
        return usage_error(
            "envoy-config", f"--router-workers must be 1-64, got {args.router_workers}"
        )
    if not 1 <= args.max_concurrent <= 1_000_000:
        return usage_error(
            "envoy-config", f"--max-concurrent must be 1-1000000, got {args.max_concurrent}"
        )
    if args.router_max_streams is not None and not 1 <= args.router_max_streams <= 1_000_000:
        return usage_error(
            "envoy-config",
            f"--router-max-streams must be 1-1000000, got {args.router_max_streams}",
        )
    if not 1024 * 1024 <= args.buffer_limit_bytes <= 2**31:
        return usage_error(
            "envoy-config",
            f"--buffer-limit-bytes must be 1048576-{2**31}, got {args.buffer_limit_bytes}",
        )
    if not 0.1 <= args.backend_idle_timeout_s <= 3600:
        return usage_error(
            "envoy-config",
            f"--backend-idle-timeout-s must be 0.1-3600, got {args.backend_idle_timeout_s:g}",
        )
    routers = tuple(args.router) or BootstrapParams.routers
    endpoints = tuple(
        _worker_endpoint(router, i) for router in routers for i in range(args.router_workers)
    )
    if any(not isinstance(e, str) and e[1] > 65535 for e in endpoints):
        return usage_error("envoy-config", "--router-workers takes a --router port past 65535")
    for link in ("router", "xds"):
        tls_problem = _tls_problem(args, link)
        if tls_problem is not None:
            return usage_error("envoy-config", tls_problem)
    if args.router_tls_ca is not None and any(isinstance(e, str) for e in endpoints):
        return usage_error(
            "envoy-config",
            "--router-tls-ca needs ip:port routers: a router on a Unix socket serves no TLS",
        )
    params = BootstrapParams(
        mode=args.mode,
        listen=args.listen,
        admin=args.admin,
        routers=endpoints,
        backends=tuple(args.backend) or BootstrapParams.backends,
        control_plane=None if args.static else args.control_plane or BootstrapParams.control_plane,
        upstream_host_header=args.upstream_host_header,
        trusted_salt_header=args.trusted_salt_header,
        max_concurrent=args.max_concurrent,
        router_max_streams=args.router_max_streams,
        buffer_limit_bytes=args.buffer_limit_bytes,
        backend_idle_timeout_s=args.backend_idle_timeout_s,
        body_mode=args.body_mode,
        completion_log=args.completion_log,
        router_tls=_tls(args, "router"),
        xds_tls=_tls(args, "xds"),
    )
    sys.stdout.write(render(params))
    return 0
