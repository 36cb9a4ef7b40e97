"""``prefix-router bench WORKLOAD``: one subcommand per workload, each with its own flags.

The older form ``prefix-router bench --workload WORKLOAD [flags]``, which committed reports
quote, still works: ``upgrade_argv`` rewrites it to the subcommand before parsing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from extproc.cli.bench import components, fleet, reliability, vllm
from extproc.cli.bench.workload import COMMITTED, Workload, writes_committed_reports
from extproc.cli.common import COMMAND_HELP, EXIT_USAGE, Commands

WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (
        *components.WORKLOADS,
        *vllm.WORKLOADS,
        *fleet.WORKLOADS,
        *reliability.WORKLOADS,
    )
}
LEGACY_FLAG = "--workload"


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "bench",
        help=COMMAND_HELP["bench"],
        description="Benchmarks run the alternatives side by side in one run and write a "
        "report. `prefix-router bench WORKLOAD --help` lists the flags WORKLOAD takes; the "
        "form `prefix-router bench --workload WORKLOAD [flags]` works too.",
    )
    # Every workload, and render (the plots), needs the bench extra; ``main`` checks for it.
    parser.set_defaults(needs_extra="bench")
    workloads = parser.add_subparsers(
        dest="workload", required=True, metavar="WORKLOAD", title="workloads"
    )
    for workload in WORKLOADS.values():
        sub = workloads.add_parser(workload.name, help=workload.help, description=workload.help)
        for add_flag in workload.flags:
            add_flag(sub)
        sub.set_defaults(handler=workload.run, check=quick_never_writes_committed)
    render = workloads.add_parser(
        "render",
        help="render reports again from their stored runs (JSON), and the headline page",
        description="Render each report's markdown and plots again from its stored JSON, "
        "then docs/benchmarks/README.md's headline table from all of them. Reports are "
        "never edited by hand: change the generator, then render.",
    )
    render.add_argument(
        "runs",
        nargs="*",
        type=Path,
        help=f"stored runs (*.json) to render (default: every one in {COMMITTED}/)",
    )
    render.set_defaults(handler=_render)


def quick_never_writes_committed(args: argparse.Namespace) -> str | None:
    """Why the command must not run, if it would let a smoke run overwrite the committed
    reports; ``main`` checks it before the handler runs."""
    if getattr(args, "quick", False) and writes_committed_reports(args):
        return (
            f"--quick with --out {COMMITTED}: a smoke run never writes the committed "
            "reports; leave --out at its default (a scratch directory)"
        )
    return None


def _render(args: argparse.Namespace) -> int:
    from extproc.bench import headline, reliability_report, report

    runs: list[Path] = args.runs or sorted(COMMITTED.glob("*.json"))
    pages = set()
    for path in runs:
        if path.stem.startswith("reliability-"):
            pages.add(reliability_report.render(path.parent))
            continue
        if "kind" not in json.loads(path.read_text()):
            print(f"prefix-router: {path} is not a stored run (it names no kind)", file=sys.stderr)
            return EXIT_USAGE
        pages.add(report.rerender(path))
    for directory in {path.parent for path in runs}:
        if directory.resolve() == COMMITTED.resolve():
            pages.add(headline.write(directory))
    for page in sorted(pages):
        print(page)
    return 0


def _is_legacy_flag(token: str) -> bool:
    # argparse took any unambiguous prefix of --workload (bench had no other --w... flag).
    name = token.split("=", 1)[0]
    return len(name) > 2 and LEGACY_FLAG.startswith(name)


def upgrade_argv(argv: list[str]) -> list[str]:
    """``bench --workload NAME [flags]`` as ``bench NAME [flags]``; other argv unchanged.

    Only when no workload subcommand comes first: ``bench NAME --workload ...`` is left for
    argparse to reject.
    """
    if len(argv) < 2 or argv[0] != "bench" or not argv[1].startswith("-"):
        return argv
    rest = argv[1:]
    for at, token in enumerate(rest):
        if token == "--":
            break
        if not _is_legacy_flag(token):
            continue
        if "=" in token:
            return ["bench", token.split("=", 1)[1], *rest[:at], *rest[at + 1 :]]
        if at + 1 < len(rest):
            return ["bench", rest[at + 1], *rest[:at], *rest[at + 2 :]]
    return argv
