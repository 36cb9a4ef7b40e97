"""A benchmark workload of ``prefix-router bench``: its name, its flags and its runner.

Each workload declares only the flags that apply to it, from the ones below, so
``prefix-router bench WORKLOAD --help`` lists exactly what that workload reads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Flag = Callable[[argparse.ArgumentParser], None]
Runner = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Workload:
    name: str
    help: str
    flags: tuple[Flag, ...]
    run: Runner


def command_line(args: argparse.Namespace) -> str:
    """The command as typed, for the report (``main`` keeps the argv it parsed)."""
    argv = vars(args).get("argv") or sys.argv[1:]
    return "prefix-router " + " ".join(argv)


# Where a run writes unless told otherwise: a scratch directory, so an ad-hoc or --quick
# run never overwrites the committed reports; only ``--out docs/benchmarks`` writes those.
SCRATCH = Path("bench-results")
COMMITTED = Path("docs/benchmarks")


def out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=SCRATCH,
        help=f"report directory (default {SCRATCH}/, a scratch directory; "
        f"--out {COMMITTED} writes the committed reports)",
    )


def writes_committed_reports(args: argparse.Namespace) -> bool:
    out_dir = vars(args).get("out")
    return out_dir is not None and out_dir.resolve() == COMMITTED.resolve()


def quick(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short smoke run")


def rounds(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds; medians quoted (default 3)"
    )


def duration(default_s: float, meaning: str) -> Flag:
    """``--duration``: unset (None) means ``default_s``, which the runner applies."""

    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--duration", type=float, help=f"{meaning} (default {default_s:g})")

    return add


def paths(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--paths", help="comma-separated subset of paths (default: all of the workload's)"
    )


def split_paths(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))
