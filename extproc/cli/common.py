"""Parsing helpers the commands share: addresses, enum choices and the routing flags."""

from __future__ import annotations

import argparse
import importlib.util
import socket
import sys
import urllib.parse
from collections.abc import Iterable
from enum import Enum
from typing import Any, TypeAlias

from extproc.config import StreamEnd
from extproc.errors import MissingExtraError, MissingHarnessError
from extproc.picker.decide import Strategy
from extproc.picker.hosts import parse_host_address
from extproc.picker.keys import KeyMode

EXIT_USAGE = 2
# The modules each optional extra of pyproject.toml installs that our commands import (the
# extra's other packages are programs the benchmarks run when they are there). A command
# that needs an extra looks for them before it starts (``require_extra``), so a base
# install names what to install instead of ending in a traceback, maybe half-way through.
EXTRAS: dict[str, tuple[str, ...]] = {"bench": ("matplotlib",)}
# The benchmark harness: the packages the router's image leaves out (docker/Dockerfile,
# .dockerignore), and the commands that run it. No runtime module imports them (the
# harness-only-from-harness import contract); the CLI loads a harness command's module by
# name, after ``require_harness``, so elsewhere ``bench`` is a clear error, not a traceback.
HARNESS_MODULES = ("extproc.bench", "extproc.cli.bench")
HARNESS_COMMANDS = frozenset({"bench"})
# What ``add_subparsers`` returns; each command module's ``register`` adds its parser to it.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


# Each command's one-line help, in the order ``prefix-router --help`` lists them: the
# command's module registers it with this text, and a process that runs another command
# lists it by this text without importing the module (``extproc/cli/__init__.py``).
COMMAND_HELP: dict[str, str] = {
    "up": "run Envoy, the router and a simulated vLLM fleet on loopback",
    "router": "run the ext_proc router (gRPC)",
    "epp": "run the router as a Gateway API Inference Extension endpoint picker",
    "sim": "run simulated vLLM backends",
    "bench": "run a benchmark and write its report (and its stored run, as JSON)",
    "replay": "replay a traffic log through the router's decisions for a grid of settings, "
    "and recommend one",
    "control-plane": "run the xDS control plane (EDS of the healthy vLLM hosts, and the load feed)",
    "envoy-config": "print an Envoy bootstrap",
    "config-reference": "print the configuration reference (docs/configuration.md) from the "
    "config schema",
    "config-schema": "print the JSON Schema of the router's or the control plane's config file",
}


def choices(values: type[Enum] | Iterable[str]) -> list[str]:
    """The values of an enum (or of a tuple of literals), for ``choices=``."""
    return [str(getattr(value, "value", value)) for value in values]


def workers_count(text: str) -> int | str:
    """A --workers value: a number, or auto (one per core, resolved by the config)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def host_address(text: str) -> str:
    """An ``ip:port`` flag (IPv6 in brackets), normalised as the config files have it."""
    try:
        return parse_host_address(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def listen_address(text: str) -> str:
    """A listen flag: ``ip:port`` or ``unix:/absolute/path``."""
    from extproc.schema import parse_listen_address

    try:
        return parse_listen_address(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def router_endpoint(text: str) -> tuple[str, int] | str:
    """A router Envoy connects to: ``ip:port`` as (ip, port), or ``unix:/path`` as the path."""
    from extproc.schema import socket_path

    address = listen_address(text)
    path = socket_path(address)
    return path if path is not None else ip_port(address)


def ip_port(text: str) -> tuple[str, int]:
    """An ``ip:port`` flag as the (ip, port) pair Envoy's socket addresses take."""
    host, _, port = host_address(text).rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def add_host_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """``--host IP:PORT``, repeatable, into ``args.host`` (a list)."""
    parser.add_argument(
        "--host", type=host_address, action="append", default=[], metavar="IP:PORT", help=help
    )


def backend_url(text: str) -> tuple[str, int]:
    """``http://host:port`` (or ``host:port``) resolved to an IP, as Envoy matches on IPs."""
    parsed = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parsed.port or 80
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: port must be 1-65535") from None
    if parsed.scheme != "http" or not parsed.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://host:port")
    host = parsed.hostname
    if ":" in host:  # an IPv6 literal, written [ip]:port
        return ip_port(f"[{host}]:{port}")
    try:
        address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot resolve ({error})") from None
    return str(address[0][4][0]), port


def require_extra(extra: str, needed_by: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise ``MissingExtraError`` for the first of ``modules`` (default: all of ``extra``'s)
    that is not installed; ``needed_by`` (the command) starts the message."""
    for module in EXTRAS[extra] if modules is None else modules:
        if not _installed(module):
            raise MissingExtraError(module, extra, needed_by)


def harness_installed() -> bool:
    """Whether the benchmark harness is here (a source checkout or a full install; not the
    router's image)."""
    return all(_installed(module) for module in HARNESS_MODULES)


def require_harness(needed_by: str) -> None:
    """Raise ``MissingHarnessError`` for the first harness package that is not installed;
    ``needed_by`` (the command) starts the message."""
    for module in HARNESS_MODULES:
        if not _installed(module):
            raise MissingHarnessError(module, needed_by)


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already, by something that left it no __spec__
        return True


def usage_error(command: str, message: str) -> int:
    """Say why the flags given cannot run, as argparse would, and return exit code 2."""
    print(f"prefix-router {command}: {message}", file=sys.stderr)
    return EXIT_USAGE


def add_routing_flags(parser: argparse.ArgumentParser) -> None:
    """The routing settings ``up`` and ``router`` take; unset flags leave the config's."""
    group = parser.add_argument_group("routing (override the config file and environment)")
    group.add_argument(
        "--routing-strategy",
        choices=choices(Strategy),
        help="how to pick the upstream (default PREFIX_AWARE)",
    )
    group.add_argument(
        "--prefix-length",
        type=int,
        help="bytes (native) or characters (openai) of the prompt that form the key, "
        "1024-65536 (default 8192)",
    )
    group.add_argument(
        "--concurrency-threshold",
        type=int,
        help="requests in flight on a host before new ones overflow, 1-1024 (default 32)",
    )
    group.add_argument(
        "--key-mode",
        choices=choices(KeyMode),
        help="openai: message text of the JSON body; native: raw body bytes (default openai)",
    )
    group.add_argument(
        "--stream-end",
        choices=choices(StreamEnd),
        help="response: Envoy keeps each ext_proc stream until the HTTP response ends; "
        "decision: the router closes it once it has answered, and loads come from the "
        "load feed (default response)",
    )


def routing_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "routing_strategy": args.routing_strategy,
        "prefix_length": args.prefix_length,
        "concurrency_threshold": args.concurrency_threshold,
        "key_mode": args.key_mode,
        "stream_end": args.stream_end,
    }
