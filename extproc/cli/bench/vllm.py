"""Benchmarks on real vLLM (PREFIX_ROUTER_VLLM_PYTHON names a Python with vllm)."""

from __future__ import annotations

import argparse
import dataclasses

from extproc.cli.bench.workload import Workload, command_line, out

# Where real-vllm runs vLLM; cuda switches to the GPU tier's shape (real_vllm.gpu_options).
DEVICES = ("cpu", "cuda")


def scenario_names(text: str) -> tuple[str, ...]:
    from extproc.bench.real_vllm import SCENARIOS

    names = tuple(part.strip() for part in text.split(","))
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(map(repr, unknown))}: choose from {', '.join(SCENARIOS)}"
        )
    return names


def worker_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(count < 2 for count in counts):
        raise argparse.ArgumentTypeError(f"expected worker counts of at least 2, got {text!r}")
    return counts


def real_vllm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=3, help="vLLM instances (default 3)")
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu", help="where vLLM runs (default cpu)"
    )
    parser.add_argument(
        "--scenarios",
        type=scenario_names,
        help="comma-separated scenarios to run (default all: documents, rag, conversations, "
        "many-documents)",
    )
    parser.add_argument(
        "--unshared-workers",
        type=worker_counts,
        default=(),
        help="also run PREFIX_AWARE as router --workers N with workers_share_decisions off, "
        "for each comma-separated N (default none)",
    )
    parser.add_argument(
        "--no-restart",
        action="store_true",
        help="leave out the run that restarts one instance under router workers",
    )
    parser.add_argument(
        "--report-name",
        help="the stored run's name under --out (default real-vllm-DEVICE)",
    )


def run_real_vllm(args: argparse.Namespace) -> int:
    from extproc.bench import real_vllm

    options = real_vllm.RealVllmOptions(
        instances=args.instances,
        out_dir=args.out,
        report_name=args.report_name or f"real-vllm-{args.device}",
        unshared_workers=args.unshared_workers,
        command=command_line(args),
    )
    if args.scenarios:
        options = dataclasses.replace(options, scenarios=args.scenarios)
    if args.no_restart:
        options = dataclasses.replace(options, restart_workers=None)
    if args.device == "cuda":
        options = real_vllm.gpu_options(options)
    for result in real_vllm.run(options):
        print(
            f"{result.scenario:14} {result.path:32} hit rate {result.hit_rate:.3f}  "
            f"share {result.min_share:.0%} to {result.max_share:.0%}"
        )
    return 0


def run_sim_vs_vllm(args: argparse.Namespace) -> int:
    from extproc.bench import sim_vs_vllm

    comparisons = sim_vs_vllm.run(args.out, command_line(args))
    for comparison in comparisons:
        print(f"{comparison.name}: {'identical' if comparison.equal else 'DIFFERENT'}")
    return 0 if all(c.equal for c in comparisons) else 1


WORKLOADS = (
    Workload(
        "real-vllm",
        "RANDOM vs PREFIX_AWARE hit rate on real vLLM (PREFIX_ROUTER_VLLM_PYTHON names a Python "
        "with vllm)",
        (real_vllm_flags, out),
        run_real_vllm,
    ),
    Workload(
        "sim-vs-vllm",
        "the simulator's prefix-cache accounting against real vLLM's, request by request "
        "(needs PREFIX_ROUTER_VLLM_PYTHON too)",
        (out,),
        run_sim_vs_vllm,
    ),
)
