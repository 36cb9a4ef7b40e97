"""Router configuration: a frozen object, validated once, from YAML plus environment.

Precedence, lowest first: defaults, the YAML file, ``PREFIX_ROUTER_<FIELD>`` environment
variables, then explicit overrides (the CLI's flags). Every error names the field, the
value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.errors import ConfigError
from extproc.picker.decide import Strategy
from extproc.picker.hosts import parse_host_address
from extproc.picker.keys import KeyMode

ENV_PREFIX = "PREFIX_ROUTER_"

PREFIX_LENGTH_RANGE = (1024, 65536)
CONCURRENCY_THRESHOLD_RANGE = (1, 1024)
FAILOVER_HOSTS_RANGE = (0, 8)


LOG_LEVELS = ("debug", "info", "warning", "error")


def doc(text: str, **constraints: Any) -> dict[str, Any]:
    """Field metadata that documents a config field where it is declared.

    ``text`` says what the field does; ``range=(low, high)`` (a bound may name a sibling
    field) or ``allowed="..."`` say which values it accepts. docs/configuration.md is
    rendered from this metadata (``prefix-router config-reference``), and a test checks
    every ``range`` against the validation, so the reference cannot drift from the schema.
    """
    return {"doc": text, **constraints}


def _check_range(name: str, value: Any, bounds: tuple[int, int]) -> int:
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(name, value, f"an integer from {low} to {high}")
    return value


def _check_listen(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(name, value, "an ip:port string")
    try:
        return parse_host_address(value)
    except ValueError:
        raise ConfigError(name, value, "an ip:port string with a port from 1 to 65535") from None


def _check_enum(name: str, value: Any, enum: type[Strategy] | type[KeyMode]) -> Any:
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum)
        raise ConfigError(name, value, f"one of {allowed}") from None


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs; the names follow SageMaker's PREFIX_AWARE routing."""

    routing_strategy: Strategy = field(
        default=Strategy.PREFIX_AWARE,
        metadata=doc(
            "How to pick the upstream: PREFIX_AWARE places each prompt prefix on a "
            "consistent host; RANDOM and LEAST_OUTSTANDING_REQUESTS ignore the prompt."
        ),
    )
    prefix_length: int = field(
        default=8192,
        metadata=doc(
            "How much of the prompt forms the routing key: characters of message text "
            "(openai) or bytes of the raw body (native).",
            range=PREFIX_LENGTH_RANGE,
        ),
    )
    concurrency_threshold: int = field(
        default=32,
        metadata=doc(
            "Requests in flight on a host at which new requests for its prefixes overflow "
            "to the prefix's next host.",
            range=CONCURRENCY_THRESHOLD_RANGE,
        ),
    )
    balance_factor: float | None = field(
        default=1.5,
        metadata=doc(
            "PREFIX_AWARE also overflows a host whose load reaches this multiple of the "
            "fleet's mean (bounded-load consistent hashing; never below 2 in flight). "
            "null turns it off.",
            range=(1.0, 10),
        ),
    )
    key_mode: KeyMode = field(
        default=KeyMode.OPENAI,
        metadata=doc(
            "openai: the key is the message text of an OpenAI chat or completions body; "
            "native: the first bytes of the raw body."
        ),
    )
    hosts: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "The static host set, for running without a control plane.",
            allowed="ip:port entries; empty when control_plane is set",
        ),
    )
    control_plane: str | None = field(
        default=None,
        metadata=doc(
            "The control plane's xDS address; the host set and the load feed come from it.",
            allowed="ip:port",
        ),
    )
    cluster: str = field(
        default="vllm",
        metadata=doc(
            "The cluster (EDS resource) the control plane publishes the fleet as.",
            allowed="a non-empty name",
        ),
    )
    load_feed_max_age_s: float = field(
        default=2.0,
        metadata=doc(
            "A load feed older than this is ignored, and overflow uses this router's own "
            "in-flight counts only.",
            range=(0.1, 600),
        ),
    )
    failover_hosts: int = field(
        default=2,
        metadata=doc(
            "Extra hosts in the target list, tried in turn by Envoy's retries "
            "(override-host mode).",
            range=FAILOVER_HOSTS_RANGE,
        ),
    )
    listen: str = field(
        default="127.0.0.1:50051", metadata=doc("The gRPC (ext_proc) address.", allowed="ip:port")
    )
    metrics_listen: str = field(
        default="127.0.0.1:9102", metadata=doc("The Prometheus metrics address.", allowed="ip:port")
    )
    log_level: str = field(
        default="info", metadata=doc("The lowest level logged.", allowed=", ".join(LOG_LEVELS))
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(
            self,
            "routing_strategy",
            _check_enum("routing_strategy", self.routing_strategy, Strategy),
        )
        set_(self, "key_mode", _check_enum("key_mode", self.key_mode, KeyMode))
        _check_range("prefix_length", self.prefix_length, PREFIX_LENGTH_RANGE)
        _check_range(
            "concurrency_threshold", self.concurrency_threshold, CONCURRENCY_THRESHOLD_RANGE
        )
        _check_range("failover_hosts", self.failover_hosts, FAILOVER_HOSTS_RANGE)
        set_(self, "listen", _check_listen("listen", self.listen))
        set_(self, "metrics_listen", _check_listen("metrics_listen", self.metrics_listen))
        if isinstance(self.hosts, str) or not isinstance(self.hosts, (list, tuple)):
            raise ConfigError("hosts", self.hosts, "a list of ip:port strings")
        normalised = []
        for index, host in enumerate(self.hosts):
            try:
                normalised.append(parse_host_address(str(host)))
            except ValueError as error:
                raise ConfigError(f"hosts[{index}]", host, f"ip:port ({error})") from None
        set_(self, "hosts", tuple(normalised))
        if self.control_plane is not None:
            set_(self, "control_plane", _check_listen("control_plane", self.control_plane))
            if self.hosts:
                raise ConfigError(
                    "hosts", self.hosts, "empty when control_plane is set (it supplies the hosts)"
                )
        if not isinstance(self.cluster, str) or not self.cluster:
            raise ConfigError("cluster", self.cluster, "a non-empty cluster name")
        factor = self.balance_factor
        if factor is not None and (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not 1.0 <= factor <= 10
        ):
            raise ConfigError("balance_factor", factor, "a number from 1.0 to 10, or null")
        feed_age = self.load_feed_max_age_s
        if (
            isinstance(feed_age, bool)
            or not isinstance(feed_age, (int, float))
            or not (0.1 <= feed_age <= 600)
        ):
            raise ConfigError("load_feed_max_age_s", feed_age, "a number from 0.1 to 600")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", self.log_level, f"one of {', '.join(LOG_LEVELS)}")


FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
_INT_FIELDS = {"prefix_length", "concurrency_threshold", "failover_hosts"}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in FIELDS:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name in _INT_FIELDS:
            try:
                values[name] = int(raw)
            except ValueError:
                raise ConfigError(name, raw, "an integer") from None
        elif name == "balance_factor":
            try:
                values[name] = None if raw.lower() in ("", "none", "null", "off") else float(raw)
            except ValueError:
                raise ConfigError(name, raw, "a number or off") from None
        elif name == "load_feed_max_age_s":
            try:
                values[name] = float(raw)
            except ValueError:
                raise ConfigError(name, raw, "a number") from None
        elif name == "hosts":
            values[name] = [h for h in (p.strip() for p in raw.split(",")) if h]
        else:
            values[name] = raw
    return values


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ConfigError on a missing or malformed file."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError("config file", str(path), f"a readable file ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise ConfigError("config file", str(path), f"valid YAML ({error})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError("config file", str(path), "a YAML mapping of field: value")
    return loaded


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RouterConfig:
    values: dict[str, Any] = read_config_file(path) if path else {}
    values.update(_from_env(os.environ if env is None else env))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ConfigError(unknown[0], values[unknown[0]], f"a known field: {', '.join(FIELDS)}")
    if isinstance(values.get("hosts"), list):
        values["hosts"] = tuple(values["hosts"])
    return RouterConfig(**values)
