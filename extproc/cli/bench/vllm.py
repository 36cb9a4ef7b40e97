"""Benchmarks on real vLLM (PREFIX_ROUTER_VLLM_PYTHON names a Python with vllm)."""

from __future__ import annotations

import argparse

from extproc.cli.bench.workload import Workload, command_line, out

# Where real-vllm runs vLLM; cuda switches to the GPU tier's shape (real_vllm.gpu_options).
DEVICES = ("cpu", "cuda")


def real_vllm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=3, help="vLLM instances (default 3)")
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu", help="where vLLM runs (default cpu)"
    )


def run_real_vllm(args: argparse.Namespace) -> int:
    from extproc.bench import real_vllm

    options = real_vllm.RealVllmOptions(
        instances=args.instances, out_dir=args.out, report_name=f"real-vllm-{args.device}"
    )
    if args.device == "cuda":
        options = real_vllm.gpu_options(options)
    for result in real_vllm.run(options):
        print(
            f"{result.scenario:14} {result.path:22} hit rate {result.hit_rate:.3f}  "
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
