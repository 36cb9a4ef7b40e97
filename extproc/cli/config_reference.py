"""``prefix-router config-reference``: docs/configuration.md, from the config schema."""

from __future__ import annotations

import argparse
import sys

from extproc.cli.common import COMMAND_HELP, Commands


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "config-reference",
        help=COMMAND_HELP["config-reference"],
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from extproc.config_reference import render

    sys.stdout.write(render())
    return 0
