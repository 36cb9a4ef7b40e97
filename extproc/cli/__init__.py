"""The ``prefix-router`` command. The only place errors become exit codes.

Each command is a module here that declares its own flags and handler (``register``);
``main`` parses, then calls the handler the chosen command set. Modules are loaded by
name, only for the command that runs: the benchmark harness's (``bench``) is not in the
router's image, where ``bench`` says so and every other command runs without it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import httpx

from extproc.cli.common import (
    COMMAND_HELP,
    EXIT_USAGE,
    HARNESS_COMMANDS,
    harness_installed,
    require_extra,
    require_harness,
)
from extproc.errors import ConfigError, MissingHarnessError, RouterError

__all__ = ["EXIT_USAGE", "build_parser", "main", "parse_args"]

# Each command's module, in COMMAND_HELP's order (``prefix-router --help``).
COMMAND_MODULES = {
    "up": "extproc.cli.up",
    "router": "extproc.cli.router",
    "epp": "extproc.cli.epp",
    "sim": "extproc.cli.sim",
    "bench": "extproc.cli.bench",
    "replay": "extproc.cli.replay",
    "control-plane": "extproc.cli.control_plane",
    "envoy-config": "extproc.cli.envoy_config",
    "config-reference": "extproc.cli.config_reference",
    "config-schema": "extproc.cli.config_schema",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command with its flags; or, given ``command``, that one with its flags and
    the others by name and help only, so a process imports the modules of its own command
    alone (``prefix-router router`` loads nothing of the benchmark harness). Without the
    harness (the router's image), its commands are listed by name and help only."""
    parser = argparse.ArgumentParser(
        prog="prefix-router",
        description="Prefix-aware routing for vLLM fleets behind Envoy (ext_proc).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    harness = harness_installed()
    for name, module in COMMAND_MODULES.items():
        if (command is None or name == command) and (harness or name not in HARNESS_COMMANDS):
            importlib.import_module(module).register(commands)
        else:
            commands.add_parser(name, help=COMMAND_HELP[name])
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default: the process's), accepting ``bench --workload NAME`` too;
    the namespace keeps the argv as given, for reports that quote their command. A harness
    command raises ``MissingHarnessError`` where the harness is not installed."""
    given = list(sys.argv[1:] if argv is None else argv)
    command = given[0] if given and given[0] in COMMAND_MODULES else None
    parsed = given
    if command in HARNESS_COMMANDS:
        require_harness(command)
        # bench rewrites its older ``--workload NAME`` form to the subcommand first.
        parsed = importlib.import_module(COMMAND_MODULES[command]).upgrade_argv(given)
    args = build_parser(command).parse_args(parsed)
    args.argv = given
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except MissingHarnessError as error:
        print(f"prefix-router: {error}", file=sys.stderr)
        return 1
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
    except httpx.HTTPError as error:
        # A request to a process the command drives (a simulator, a peer, Envoy's admin)
        # found nothing there, or a wrong answer: a line naming it, not a traceback.
        print(f"prefix-router: {_described(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _described(error: httpx.HTTPError) -> str:
    """``error`` with the request it failed on, where httpx knows it."""
    try:
        request = error.request
    except RuntimeError:  # raised outside a request: httpx has none to name
        return str(error) or type(error).__name__
    return f"{request.method} {request.url}: {str(error) or type(error).__name__}"
