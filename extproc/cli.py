"""The ``prefix-router`` command. The only place errors become exit codes."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import signal
import socket
import sys
import threading
import urllib.parse
from dataclasses import replace
from pathlib import Path
from typing import Any

from extproc.errors import ConfigError, RouterError

EXIT_USAGE = 2
FLEET_WORKLOADS = (
    "long-context",
    "long-context-short-prefix",
    "conversations",
    "multi-tenant",
    "hot-spot",
)


def _ip_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ip:port") from None
    if not 0 < number < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: port must be 1-65535")
    return host, number


def _backend_url(text: str) -> tuple[str, int]:
    """``http://host:port`` (or ``host:port``) resolved to an IP, as Envoy matches on IPs."""
    parsed = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
    if parsed.scheme != "http" or not parsed.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://host:port")
    port = parsed.port or 80
    try:
        address = socket.getaddrinfo(parsed.hostname, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot resolve ({error})") from None
    return str(address[0][4][0]), port


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("routing (override the config file and environment)")
    group.add_argument(
        "--routing-strategy",
        choices=["RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE"],
        help="how to pick the upstream (default PREFIX_AWARE)",
    )
    group.add_argument(
        "--prefix-length",
        type=int,
        help="bytes (native) or characters (openai) of the prompt that form the key, "
        "1024-65536 (default 8192)",
    )
    group.add_argument(
        "--concurrency-threshold",
        type=int,
        help="requests in flight on a host before new ones overflow, 1-1024 (default 32)",
    )
    group.add_argument(
        "--key-mode",
        choices=["openai", "native"],
        help="openai: message text of the JSON body; native: raw body bytes (default openai)",
    )


def _routing_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "routing_strategy": args.routing_strategy,
        "prefix_length": args.prefix_length,
        "concurrency_threshold": args.concurrency_threshold,
        "key_mode": args.key_mode,
    }


def _cmd_router(args: argparse.Namespace) -> int:
    from extproc import logs
    from extproc.adapter.service import serve
    from extproc.config import load_config

    overrides = _routing_overrides(args)
    overrides["listen"] = args.listen
    overrides["metrics_listen"] = args.metrics_listen
    overrides["control_plane"] = args.control_plane
    if args.host:
        overrides["hosts"] = tuple(args.host)
    config = load_config(args.config, overrides=overrides)
    logs.configure(config.log_level)
    asyncio.run(serve(config, config_path=args.config, overrides=overrides))
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from extproc import logs
    from extproc.sim.server import SimOptions, run

    # Flags left unset (None) take SimOptions' defaults; a flag of the other timing is a
    # mistake worth saying, not ignoring.
    fixed_only = {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms}
    model_only = {name: getattr(args, name) for name in args.sim_model_flags}
    wrong_mode = model_only if args.timing == "fixed" else fixed_only
    other = "model" if args.timing == "fixed" else "fixed"
    for name, value in wrong_mode.items():
        if value is not None:
            flag = "--" + name.replace("_", "-")
            print(f"prefix-router sim: {flag} applies to --timing {other} only", file=sys.stderr)
            return EXIT_USAGE
    given = {
        name: value for name, value in {**fixed_only, **model_only}.items() if value is not None
    }
    try:
        options = SimOptions(
            model=args.model,
            timing=args.timing,
            time_scale=args.time_scale,
            capacity_blocks=args.capacity_blocks,
            block_size_tokens=args.block_size,
            **given,
        )
    except ValueError as error:
        print(f"prefix-router sim: {error}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure("info")
    run(args.address, options)
    return 0


def _cmd_control_plane(args: argparse.Namespace) -> int:
    from extproc import logs
    from extproc.control.config import load_control_plane_config
    from extproc.control.service import serve

    overrides = {"listen": args.listen, "metrics_listen": args.metrics_listen}
    if args.host:
        overrides["hosts"] = tuple(args.host)
    config = load_control_plane_config(args.config, overrides)
    logs.configure(config.log_level)
    asyncio.run(serve(config, args.config))
    return 0


def _cmd_envoy_config(args: argparse.Namespace) -> int:
    from extproc.stack.bootstrap import BootstrapParams, render

    params = BootstrapParams(
        mode=args.mode,
        listen=args.listen,
        admin=args.admin,
        routers=tuple(args.router) or BootstrapParams.routers,
        backends=tuple(args.backend) or BootstrapParams.backends,
        control_plane=None if args.static else args.control_plane,
        upstream_host_header=not args.no_upstream_host_header,
    )
    sys.stdout.write(render(params))
    return 0


def _cmd_config_reference(args: argparse.Namespace) -> int:
    from extproc.config_reference import render

    sys.stdout.write(render())
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from extproc.config import load_config
    from extproc.stack.local import LocalStack, StackSpec, simulated_backends

    overrides = {k: v for k, v in _routing_overrides(args).items() if v is not None}
    # Validate routing settings here, so a bad value fails before anything starts.
    load_config(env={}, overrides=overrides)
    spec = StackSpec(
        mode=args.mode,
        listen=args.listen,
        admin=args.admin,
        router=args.router_listen,
        router_metrics=args.router_metrics,
        control_plane=args.control_plane,
        control_plane_metrics=args.control_plane_metrics,
        external_backends=tuple(args.backend),
        sim_backends=() if args.backend else simulated_backends(args.backends, args.sim_port),
        router_settings=overrides,
        upstream_host_header=not args.no_upstream_host_header,
        sim_args=("--ttft-ms", str(args.sim_ttft_ms), "--itl-ms", str(args.sim_itl_ms)),
        work_dir=args.work_dir,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stack = LocalStack(spec)
    print("starting simulators, router and envoy ...", flush=True)
    with stack:
        backends = ", ".join(f"{h}:{p}" for h, p in spec.backends)
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
        while not stop.wait(0.5):
            for process in [stack.envoy, stack.router, stack.control_plane, *stack.sims]:
                if process is not None and not process.running:
                    print(f"{process.name} exited unexpectedly:\n{process.log_tail()}", flush=True)
                    return 1
    print("stopped.", flush=True)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from extproc import logs

    logs.configure("info")
    rounds = 1 if args.quick else args.rounds
    if args.workload == "real-vllm":
        from extproc.bench import real_vllm

        options = real_vllm.RealVllmOptions(
            instances=args.instances, out_dir=args.out, report_name=f"real-vllm-{args.device}"
        )
        if args.device == "cuda":
            options = real_vllm.gpu_options(options)
        results = real_vllm.run(options)
        for result in results:
            print(
                f"{result.scenario:14} {result.path:16} hit rate {result.hit_rate:.3f}  "
                f"share {result.min_share:.0%} to {result.max_share:.0%}"
            )
        return 0
    if args.workload == "scale-event":
        return _bench_scale_event(args)
    if args.workload == "sim-vs-vllm":
        from extproc.bench import sim_vs_vllm

        comparisons = sim_vs_vllm.run(args.out, "prefix-router bench " + " ".join(sys.argv[2:]))
        for comparison in comparisons:
            print(f"{comparison.name}: {'identical' if comparison.equal else 'DIFFERENT'}")
        return 0 if all(c.equal for c in comparisons) else 1
    if args.workload == "prefix-index":
        from extproc.bench import prefix_index

        options = prefix_index.PrefixIndexOptions(
            out_dir=args.out, command="prefix-router bench " + " ".join(sys.argv[2:])
        )
        if args.quick:
            options = replace(options, iterations=200, seeds=(1,), quality_duration_s=10.0)
        data = prefix_index.run(options)
        for cost in data["costs"]:
            print(cost)
        return 0
    if args.workload in FLEET_WORKLOADS:
        from extproc.bench import fleet
        from extproc.bench.workloads import WorkloadSpec

        spec = WorkloadSpec(
            name=args.workload,
            rate_per_s=args.rate,
            duration_s=10.0 if args.quick else (args.duration or 40.0),
            **({"documents": 12} if args.quick and "conversations" not in args.workload else {}),
        )
        command = "prefix-router bench " + " ".join(sys.argv[2:])
        paths = fleet.default_paths(args.workload)
        if args.paths:
            paths = tuple(args.paths.split(","))
        results = fleet.run(
            fleet.FleetBenchOptions(
                workload=spec,
                time_scale=args.time_scale,
                prefix_length=args.prefix_length,
                out_dir=args.out,
                command=command,
                paths=paths,
                sim_args=fleet.default_sim_args(args.workload),
                overhead_probes=args.overhead_probes,
                closed_loop_concurrency=args.closed_loop,
                closed_loop_requests=24 if args.quick else 300,
                report_name=args.report_name,
            )
        )
        for result in results:
            print(
                f"{result.path:28} p50 {result.percentile(0.5):8.0f} ms  "
                f"p90 {result.percentile(0.9):8.0f} ms  hit {result.hit_rate:6.1%}  "
                f"failed {result.failures}"
            )
        return 0
    if args.workload == "fleet-events":
        from extproc.bench import fleet_events

        path = fleet_events.run(
            fleet_events.FleetEventOptions(
                prefixes=50 if args.quick else 200, rounds=rounds, out_dir=args.out
            )
        )
        print(path.read_text())
        return 0
    if args.workload in ("soak", "saturation"):
        return _bench_reliability(args)
    from extproc.bench.overhead import OverheadOptions, run

    run(
        OverheadOptions(
            duration_s=2.0 if args.quick else (args.duration or 10.0),
            rounds=rounds,
            out_dir=args.out,
        )
    )
    return 0


def _bench_scale_event(args: argparse.Namespace) -> int:
    """scale-event: long-context while the fleet grows 7 -> 8 and shrinks to 6."""
    import dataclasses

    from extproc.bench import scale_event

    options = scale_event.ScaleEventOptions(
        out_dir=args.out, command="prefix-router bench " + " ".join(sys.argv[2:])
    )
    if args.quick:
        options = scale_event.quick(options)
    if args.paths:
        options = dataclasses.replace(options, paths=tuple(args.paths.split(",")))
    for result in scale_event.run(options):
        for event in result.events:
            print(
                f"{result.path:16} {event.name}: hit {event.baseline:.1%} -> lowest "
                f"{event.lowest:.1%}, recovery {event.recovery_s} s, moved {event.moved}"
            )
    return 0


def _bench_reliability(args: argparse.Namespace) -> int:
    """soak and saturation: both write docs/benchmarks/reliability.md."""
    import dataclasses

    command = "prefix-router bench " + " ".join(sys.argv[2:])
    if args.workload == "soak":
        from extproc.bench import soak

        options = soak.SoakOptions(out_dir=args.out, command=command)
        if args.quick:
            options = soak.SoakOptions(
                requests=3000,
                warmup_s=2.0,
                segment_s=2.0,
                leak_probe_streams=0,
                out_dir=args.out,
                command=command,
            )
        if args.requests:
            options = dataclasses.replace(options, requests=args.requests)
        result = soak.run(options)
        print(
            f"soak: {result.requests} requests, {result.errors} errors, in flight at end "
            f"{result.in_flight_end:g}, RSS growth router {result.growth['router']:+.1%} "
            f"control plane {result.growth['control_plane']:+.1%}: "
            f"{'passed' if result.passed else 'FAILED'}"
        )
        return 0 if result.passed else 1
    from extproc.bench import saturation

    sat = saturation.SaturationOptions(
        rounds=args.rounds, out_dir=args.out, command=command, duration_s=args.duration or 4.0
    )
    if args.quick:
        sat = dataclasses.replace(
            sat, rates=(100, 200), duration_s=1.0, rounds=1, profile_s=1.0, failures_to_stop=2
        )
    found = saturation.run(sat)
    for config, rate in found.max_rate.items():
        print(
            f"saturation: {config}: {rate} req/s at p99 <= {sat.added_p99_budget_ms:g} ms added, "
            f"capacity {found.capacity.get(config)} req/s"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-router",
        description="Prefix-aware routing for vLLM fleets behind Envoy (ext_proc).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser(
        "up",
        help="run Envoy, the router and a simulated vLLM fleet on loopback",
        description="Start, on loopback: simulated vLLM backends (or your --backend URLs), "
        "the router and Envoy, and print the URL. Ctrl-C stops everything.",
    )
    up.add_argument(
        "--listen",
        type=_ip_port,
        default=("127.0.0.1", 10000),
        help="Envoy's listener, ip:port (default 127.0.0.1:10000)",
    )
    up.add_argument(
        "--admin",
        type=_ip_port,
        default=("127.0.0.1", 9901),
        help="Envoy's admin interface, ip:port (default 127.0.0.1:9901)",
    )
    up.add_argument(
        "--router-listen",
        type=_ip_port,
        default=("127.0.0.1", 50051),
        help="the router's gRPC address, ip:port (default 127.0.0.1:50051)",
    )
    up.add_argument(
        "--router-metrics",
        type=_ip_port,
        default=("127.0.0.1", 9102),
        help="the router's Prometheus endpoint, ip:port (default 127.0.0.1:9102)",
    )
    up.add_argument(
        "--control-plane",
        type=_ip_port,
        default=("127.0.0.1", 18000),
        help="the control plane's xDS address, ip:port (default 127.0.0.1:18000)",
    )
    up.add_argument(
        "--control-plane-metrics",
        type=_ip_port,
        default=("127.0.0.1", 9103),
        help="the control plane's Prometheus endpoint, ip:port (default 127.0.0.1:9103)",
    )
    up.add_argument(
        "--mode",
        choices=["override-host", "original-dst"],
        default="override-host",
        help="how Envoy applies the choice (default override-host)",
    )
    up.add_argument(
        "--backends", type=int, default=3, help="how many simulated backends to start (default 3)"
    )
    up.add_argument(
        "--sim-port",
        type=int,
        default=8000,
        help="port of the simulated backends, on 127.0.0.11, .12, ... (default 8000)",
    )
    up.add_argument(
        "--sim-ttft-ms",
        type=float,
        default=20.0,
        help="simulated time to first token in ms (default 20)",
    )
    up.add_argument(
        "--sim-itl-ms",
        type=float,
        default=5.0,
        help="simulated time per further output token in ms (default 5)",
    )
    up.add_argument(
        "--backend",
        type=_backend_url,
        action="append",
        default=[],
        metavar="URL",
        help="a real vLLM server, http://host:port; repeatable. Replaces the simulated fleet",
    )
    up.add_argument(
        "--no-upstream-host-header",
        action="store_true",
        help="do not add x-upstream-host to responses",
    )
    up.add_argument(
        "--work-dir",
        type=Path,
        help="where configs and logs go (default: a new temp dir, removed on exit)",
    )
    _add_routing_flags(up)
    up.set_defaults(handler=_cmd_up)

    router = commands.add_parser("router", help="run the ext_proc router (gRPC)")
    router.add_argument("--config", type=Path, help="YAML config file")
    router.add_argument("--listen", help="gRPC listen address, ip:port (default 127.0.0.1:50051)")
    router.add_argument("--metrics-listen", help="Prometheus address (default 127.0.0.1:9102)")
    router.add_argument(
        "--control-plane",
        metavar="IP:PORT",
        help="the control plane's xDS address; it supplies the hosts and the load feed",
    )
    router.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="an upstream host; repeatable (replaces the config's hosts)",
    )
    _add_routing_flags(router)
    router.set_defaults(handler=_cmd_router)

    sim = commands.add_parser("sim", help="run simulated vLLM backends")
    sim.add_argument(
        "--address",
        type=_ip_port,
        action="append",
        required=True,
        help="ip:port to serve one simulated instance on; repeatable",
    )
    from extproc.sim.options import DEFAULT_CAPACITY_BLOCKS, SimOptions

    sim.add_argument(
        "--timing",
        choices=("fixed", "model"),
        default="fixed",
        help="fixed: --ttft-ms/--itl-ms whatever the load; model: vLLM's batching, "
        "queueing and prefill cost, calibrated on Llama-3.3-70B on 8xH100 (default fixed)",
    )
    sim.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="KV/prefix-cache capacity in blocks (default "
        f"{DEFAULT_CAPACITY_BLOCKS['fixed']} with --timing fixed, "
        f"{DEFAULT_CAPACITY_BLOCKS['model']} with --timing model)",
    )
    sim.add_argument(
        "--block-size",
        type=int,
        default=SimOptions.block_size_tokens,
        help=f"tokens per KV block (default {SimOptions.block_size_tokens})",
    )
    sim.add_argument(
        "--time-scale",
        type=float,
        default=SimOptions.time_scale,
        help="multiplies every modelled duration; 0.1 runs ten times faster than real time "
        f"(default {SimOptions.time_scale})",
    )
    sim.add_argument(
        "--ttft-ms",
        type=float,
        default=None,
        help="--timing fixed: time to first token, ms (default 0)",
    )
    sim.add_argument(
        "--itl-ms",
        type=float,
        default=None,
        help="--timing fixed: time per further token, ms (default 0)",
    )
    model_flags = (
        ("--prefill-ms-per-token", float, "prefill time per uncached prompt token, ms"),
        ("--decode-ms-per-token", float, "decode step time (one token per sequence), ms"),
        ("--step-overhead-ms", float, "fixed cost of every engine step, ms"),
        ("--request-overhead-ms", float, "per-request front-end time before queueing, ms"),
        (
            "--attention-ms-per-kv-token",
            float,
            "step time per context token of each decoding sequence, ms",
        ),
        ("--max-batched-tokens", int, "token budget of one engine step"),
        ("--max-num-seqs", int, "most requests running at once"),
    )
    for flag, kind, text in model_flags:
        default = getattr(SimOptions, flag.removeprefix("--").replace("-", "_"))
        sim.add_argument(
            flag, type=kind, default=None, help=f"--timing model: {text} (default {default})"
        )
    sim.add_argument("--model", default="sim-model", help="model name served")
    sim_model_flags = [flag.removeprefix("--").replace("-", "_") for flag, _, _ in model_flags]
    sim.set_defaults(handler=_cmd_sim, sim_model_flags=sim_model_flags)

    bench = commands.add_parser(
        "bench",
        help="run a benchmark and write its report to docs/benchmarks/",
        description="Benchmarks run the alternatives side by side in one run. "
        "overhead: direct vs Envoy vs Envoy+router, at concurrency 1 and 16 (needs wrk). "
        "fleet-events: prefixes moved scaling 3->4->3, and time from a host's death to "
        "its ejection. real-vllm: RANDOM vs PREFIX_AWARE hit rate on real vLLM "
        "(PREFIX_ROUTER_VLLM_PYTHON names a Python with vllm).",
    )
    bench.add_argument(
        "--workload",
        choices=[
            "overhead",
            "fleet-events",
            "real-vllm",
            "scale-event",
            "prefix-index",
            "sim-vs-vllm",
            "soak",
            "saturation",
            *FLEET_WORKLOADS,
        ],
        required=True,
    )
    bench.add_argument(
        "--rate", type=float, default=4.0, help="fleet workloads: requests per second (model time)"
    )
    bench.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="fleet workloads: compress simulated time by this factor",
    )
    bench.add_argument("--paths", help="fleet workloads: comma-separated subset of paths")
    bench.add_argument(
        "--report-name",
        help="fleet workloads: the report's file name, without .md (default: the workload's)",
    )
    bench.add_argument(
        "--overhead-probes",
        type=int,
        default=0,
        help="fleet workloads: measure each path's routing overhead with this many probes "
        "against instantly answering simulators (0: skip)",
    )
    bench.add_argument(
        "--closed-loop",
        type=int,
        default=0,
        help="fleet workloads: after the open loop, a saturation run with this many "
        "concurrent clients (0: skip)",
    )
    bench.add_argument(
        "--prefix-length",
        type=int,
        default=8192,
        help="fleet workloads: the router's prefix_length; set it to the part requests share "
        "(conversations: the system prompt and first user turn) (default 8192)",
    )
    bench.add_argument("--instances", type=int, default=3, help="real-vllm: vLLM instances")
    bench.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="real-vllm: where vLLM runs"
    )
    bench.add_argument(
        "--duration",
        type=float,
        help="overhead: seconds per sample (default 10); fleet workloads: seconds of arrivals "
        "in model time (default 40)",
    )
    bench.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians quoted")
    bench.add_argument("--quick", action="store_true", help="a short smoke run")
    bench.add_argument("--requests", type=int, help="soak: requests to send (default 200000)")
    bench.add_argument(
        "--out",
        type=Path,
        default=Path("docs/benchmarks"),
        help="report directory (default docs/benchmarks)",
    )
    bench.set_defaults(handler=_cmd_bench)

    control = commands.add_parser(
        "control-plane",
        help="run the xDS control plane (EDS of the healthy vLLM hosts, and the load feed)",
    )
    control.add_argument("--config", type=Path, help="YAML config file; re-read when it changes")
    control.add_argument("--listen", help="xDS gRPC address, ip:port (default 127.0.0.1:18000)")
    control.add_argument(
        "--metrics-listen", help="Prometheus address, ip:port (default 127.0.0.1:9103)"
    )
    control.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="IP:PORT",
        help="a vLLM host; repeatable (replaces the config's hosts)",
    )
    control.set_defaults(handler=_cmd_control_plane)

    envoy = commands.add_parser("envoy-config", help="print an Envoy bootstrap")
    envoy.add_argument("--mode", choices=["override-host", "original-dst"], default="override-host")
    envoy.add_argument("--listen", type=_ip_port, default=("127.0.0.1", 10000))
    envoy.add_argument("--admin", type=_ip_port, default=("127.0.0.1", 9901))
    envoy.add_argument(
        "--router",
        type=_ip_port,
        action="append",
        default=[],
        help="a router process, ip:port; repeatable",
    )
    envoy.add_argument(
        "--backend",
        type=_ip_port,
        action="append",
        default=[],
        help="a backend, ip:port; repeatable",
    )
    envoy.add_argument(
        "--control-plane",
        type=_ip_port,
        default=("127.0.0.1", 18000),
        help="xDS address the backend cluster comes from (default 127.0.0.1:18000)",
    )
    envoy.add_argument(
        "--static",
        action="store_true",
        help="a STATIC backend cluster of --backend hosts instead of EDS",
    )
    envoy.add_argument("--no-upstream-host-header", action="store_true")
    envoy.set_defaults(handler=_cmd_envoy_config)

    reference = commands.add_parser(
        "config-reference",
        help="print the configuration reference (docs/configuration.md) from the config schema",
    )
    reference.set_defaults(handler=_cmd_config_reference)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except ConfigError as error:
        print(f"prefix-router: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (RouterError, OSError) as error:
        print(f"prefix-router: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
