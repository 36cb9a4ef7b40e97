"""The ``prefix-router`` command. The only place errors become exit codes.

Each command is a module here that declares its own flags and handler (``register``);
``main`` parses, then calls the handler the chosen command set.
"""

from __future__ import annotations

import argparse
import sys

from extproc.cli import (
    bench,
    config_reference,
    config_schema,
    control_plane,
    envoy_config,
    epp,
    replay,
    router,
    sim,
    up,
)
from extproc.cli.common import EXIT_USAGE, require_extra
from extproc.errors import ConfigError, RouterError

__all__ = ["EXIT_USAGE", "build_parser", "main", "parse_args"]

# In the order ``prefix-router --help`` lists them.
COMMANDS = (
    up,
    router,
    epp,
    sim,
    bench,
    replay,
    control_plane,
    envoy_config,
    config_reference,
    config_schema,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-router",
        description="Prefix-aware routing for vLLM fleets behind Envoy (ext_proc).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default: the process's), accepting ``bench --workload NAME`` too;
    the namespace keeps the argv as given, for reports that quote their command."""
    given = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(bench.upgrade_argv(given))
    args.argv = given
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A command may refuse a combination of flags that each parse on their own.
    refusal = vars(args).get("check", lambda _args: None)(args)
    if refusal:
        print(f"prefix-router: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    try:
        # A command that needs an optional extra (``bench``) says so before it starts.
        extra = vars(args).get("needs_extra")
        if extra is not None:
            require_extra(extra, args.command)
        return int(args.handler(args))
    except ConfigError as error:
        print(f"prefix-router: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (RouterError, OSError) as error:
        print(f"prefix-router: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
