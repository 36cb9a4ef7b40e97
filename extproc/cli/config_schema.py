"""``prefix-router config-schema FILE``: the JSON Schema of a config file, for editors."""

from __future__ import annotations

import argparse
import sys

from extproc.cli.common import COMMAND_HELP, Commands


def register(commands: Commands) -> None:
    from extproc.config_reference import SCHEMAS

    parser = commands.add_parser(
        "config-schema",
        help=COMMAND_HELP["config-schema"],
        description="The JSON Schema (draft 2020-12) of a config file, rendered from the "
        "same models that validate it; docs/schema/ holds the committed copies.",
    )
    parser.add_argument("file", choices=sorted(SCHEMAS), help="which config file")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from extproc.config_reference import json_schema_text

    sys.stdout.write(json_schema_text(args.file))
    return 0
