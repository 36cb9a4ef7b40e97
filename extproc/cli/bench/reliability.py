"""concurrency, bodies, soak and saturation: the full stack under many streams, large
bodies, long and rising load (soak and saturation write reliability.md)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from extproc.cli.bench.workload import Workload, command_line, duration, out, quick, rounds

SATURATION_DURATION_S = 4.0


def requests(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, help="requests to send (default 1000000)")


def run_soak(args: argparse.Namespace) -> int:
    from extproc.bench import soak

    command = command_line(args)
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


def positive_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size in bytes of at least 1, got {text!r}")
    return value


def body_bytes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--body-bytes",
        type=positive_bytes,
        help="size of each chat body (default 8192; the prompt is most of it)",
    )


def run_saturation(args: argparse.Namespace) -> int:
    from extproc.bench import saturation

    sat = saturation.SaturationOptions(
        rounds=args.rounds,
        out_dir=args.out,
        command=command_line(args),
        duration_s=args.duration or SATURATION_DURATION_S,
    )
    if args.body_bytes is not None:
        sat = dataclasses.replace(sat, body_bytes=args.body_bytes)
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


def ascending_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if min(counts) < 1 or list(counts) != sorted(set(counts)):
        raise argparse.ArgumentTypeError(f"expected ascending counts of at least 1, got {text!r}")
    return counts


def levels(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--levels",
        type=ascending_counts,
        help="comma-separated requests in flight at once, ascending "
        "(default 1000,2000,3000,4000,5000,6000)",
    )
    parser.add_argument(
        "--gateway",
        choices=("istio", "kgateway", "standalone"),
        help="run `prefix-router epp` behind an Envoy configured as this gateway configures "
        "it for an InferencePool, instead of the router behind the generated bootstrap",
    )


def burst(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--burst",
        action="store_true",
        help="send each level's requests all at once, with no ramp, once for each way the "
        "router may answer more streams than it can decide in time (default levels "
        "3000,6000), for --rounds interleaved rounds (default 3); writes burst.md",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="with --burst: interleaved rounds (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--variants",
        type=lambda text: tuple(name.strip() for name in text.split(",")),
        help="with --burst: comma-separated variants to run, as burst.md names them "
        "(default: all; --quick: defaults alone)",
    )


def run_burst(args: argparse.Namespace) -> int:
    from extproc.bench import burst

    if args.rounds is not None and args.rounds < 1:
        print("prefix-router bench concurrency: --rounds must be at least 1", file=sys.stderr)
        return 2
    options = burst.BurstOptions(out_dir=args.out, command=command_line(args), rounds=3)
    if args.quick:
        options = dataclasses.replace(
            options, levels=(600,), rounds=1, variants=("defaults",), stream_s=2.0, itl_s=0.25
        )
    if args.levels:
        options = dataclasses.replace(options, levels=args.levels)
    if args.rounds is not None:
        options = dataclasses.replace(options, rounds=args.rounds)
    try:
        if args.variants is not None:
            options = dataclasses.replace(options, variants=args.variants)
    except ValueError as error:
        print(f"prefix-router bench concurrency: {error}", file=sys.stderr)
        return 2
    data = burst.run(options)
    for result in burst.summaries(data):
        print(
            f"burst {result['variant']} {result['level']} (median of {result['rounds']}): "
            f"{result['completed']:.0f} completed, "
            f"{result['decided']:.0f} decided of which {result['shed']:.0f} shed, "
            f"held: {result['held']}"
        )
    return 0 if all(result["held"] for result in burst.summaries(data)) else 1


def run_concurrency(args: argparse.Namespace) -> int:
    from extproc.bench import concurrency

    if args.burst:
        if args.gateway:
            print(
                "prefix-router bench concurrency: --burst runs without --gateway", file=sys.stderr
            )
            return 2
        return run_burst(args)

    options = concurrency.ConcurrencyOptions(
        out_dir=args.out, command=command_line(args), gateway=args.gateway
    )
    if args.quick:
        options = dataclasses.replace(options, levels=(200,), stream_s=3.0, itl_s=0.25, ramp_s=1.0)
    if args.levels:
        options = dataclasses.replace(options, levels=args.levels)
    data = concurrency.run(options)
    for level in data["levels"]:
        print(
            f"concurrency {level['level']}: {level['completed']} completed, "
            f"{level['decided']:.0f} decided, held: {level['held']}"
        )
    return 0 if data["levels"] and data["levels"][0]["held"] else 1


def repeats(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeats", type=int, help="requests of each size in each way of uploading it (default 20)"
    )


def run_bodies(args: argparse.Namespace) -> int:
    from extproc.bench import bodies

    options = bodies.BodyOptions(out_dir=args.out, command=command_line(args))
    if args.quick:
        mib = bodies.MiB
        options = dataclasses.replace(
            options, sizes=(0, 64 * 1024, 9 * mib, bodies.MAX_BODY + mib), repeats=2
        )
    if args.repeats:
        if args.repeats < 1:
            print("prefix-router bench bodies: --repeats must be at least 1", file=sys.stderr)
            return 2
        options = dataclasses.replace(options, repeats=args.repeats)
    data = bodies.run(options)
    held = bodies.holds(data)
    print(f"bodies: {len(data['cells'])} cells, {'held' if held else 'DID NOT HOLD'}")
    return 0 if held else 1


WORKLOADS = (
    Workload(
        "concurrency",
        "thousands of streaming requests in flight at once through Envoy and the router: "
        "every one decided, no breaker trips, no fail-open; the highest count that holds",
        (levels, burst, quick, out),
        run_concurrency,
    ),
    Workload(
        "bodies",
        "request bodies from 0 B to past max_body_bytes, fixed, chunked and slow-drip, "
        "through each Envoy mode: each arrives whole or is refused with 413 at once",
        (repeats, quick, out),
        run_bodies,
    ),
    Workload(
        "soak",
        "hundreds of thousands of requests through the full stack: memory, in-flight "
        "accounting and state sizes",
        (requests, quick, out),
        run_soak,
    ),
    Workload(
        "saturation",
        "the highest rate the router sustains within a p99 budget above plain Envoy's",
        (
            rounds,
            duration(SATURATION_DURATION_S, "seconds at each rate step"),
            body_bytes,
            quick,
            out,
        ),
        run_saturation,
    ),
)
