"""``prefix-router sim``: simulated vLLM backends."""

from __future__ import annotations

import argparse
from typing import get_args

from extproc.cli.common import COMMAND_HELP, Commands, ip_port, usage_error
from extproc.sim.options import (
    DEFAULT_CAPACITY_BLOCKS,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    SimOptions,
    Timing,
)

# --timing model's knobs: (flag, type, what it sets); each defaults to SimOptions' field.
MODEL_FLAGS: tuple[tuple[str, type, str], ...] = (
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
FIXED_FLAGS = ("--ttft-ms", "--itl-ms")


def _field(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def register(commands: Commands) -> None:
    parser = commands.add_parser("sim", help=COMMAND_HELP["sim"])
    parser.add_argument(
        "--address",
        type=ip_port,
        action="append",
        required=True,
        help="ip:port to serve one simulated instance on; repeatable",
    )
    parser.add_argument(
        "--timing",
        choices=get_args(Timing),
        default="fixed",
        help="fixed: --ttft-ms/--itl-ms whatever the load; model: vLLM's batching, "
        "queueing and prefill cost, calibrated on Llama-3.3-70B on 8xH100 (default fixed)",
    )
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="KV/prefix-cache capacity in blocks (default "
        f"{DEFAULT_CAPACITY_BLOCKS['fixed']} with --timing fixed, "
        f"{DEFAULT_CAPACITY_BLOCKS['model']} with --timing model)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=SimOptions.block_size_tokens,
        help=f"tokens per KV block (default {SimOptions.block_size_tokens})",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=SimOptions.time_scale,
        help="multiplies every modelled duration; 0.1 runs ten times faster than real time "
        f"(default {SimOptions.time_scale})",
    )
    parser.add_argument(
        "--ttft-ms",
        type=float,
        default=None,
        help="--timing fixed: time to first token, ms (default 0)",
    )
    parser.add_argument(
        "--itl-ms",
        type=float,
        default=None,
        help="--timing fixed: time per further token, ms (default 0)",
    )
    for flag, kind, text in MODEL_FLAGS:
        default = getattr(SimOptions, _field(flag))
        parser.add_argument(
            flag, type=kind, default=None, help=f"--timing model: {text} (default {default})"
        )
    parser.add_argument(
        "--keepalive-s",
        type=float,
        default=SimOptions.keepalive_s,
        help="seconds an idle client connection stays open, as vLLM's "
        f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default {SimOptions.keepalive_s:g})",
    )
    parser.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=SimOptions.kv_events,
        help="publish KV-cache events as vLLM's --kv-events-config does (ZMQ PUB, msgpack "
        "batches, topic 'kv'; token ids are code points), bound on each --address's IP "
        f"(default {'on' if SimOptions.kv_events else 'off'})",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=SimOptions.kv_events_port,
        help=f"port of the KV-event PUB socket; 0 picks a free one (default {KV_EVENTS_PORT})",
    )
    parser.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=SimOptions.kv_events_replay_port,
        help="port of the KV-event replay socket; 0 picks a free one "
        f"(default {KV_EVENTS_REPLAY_PORT})",
    )
    parser.add_argument("--model", default="sim-model", help="model name served")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from extproc import logs
    from extproc.sim.server import run as serve

    # Flags left unset (None) take SimOptions' defaults; a flag of the other timing is a
    # mistake worth saying, not ignoring.
    model_only = tuple(flag for flag, _, _ in MODEL_FLAGS)
    wrong, other = (model_only, "model") if args.timing == "fixed" else (FIXED_FLAGS, "fixed")
    for flag in wrong:
        if getattr(args, _field(flag)) is not None:
            return usage_error("sim", f"{flag} applies to --timing {other} only")
    given = {
        _field(flag): getattr(args, _field(flag))
        for flag in (*FIXED_FLAGS, *model_only)
        if getattr(args, _field(flag)) is not None
    }
    try:
        options = SimOptions(
            model=args.model,
            timing=args.timing,
            time_scale=args.time_scale,
            capacity_blocks=args.capacity_blocks,
            block_size_tokens=args.block_size,
            keepalive_s=args.keepalive_s,
            kv_events=args.kv_events,
            kv_events_port=args.kv_events_port,
            kv_events_replay_port=args.kv_events_replay_port,
            **given,
        )
    except ValueError as error:
        return usage_error("sim", str(error))
    logs.configure("info")
    serve(args.address, options)
    return 0
