"""Router configuration: a frozen object, validated once, from YAML plus environment.

Precedence, lowest first: defaults, the YAML file, ``PREFIX_ROUTER_<FIELD>`` environment
variables, then explicit overrides (the CLI's flags). Every error names the field, the
value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
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

    routing_strategy: Strategy = Strategy.PREFIX_AWARE
    # Bytes of the raw body (native) or characters of message text (openai) that form the key.
    prefix_length: int = 8192
    # Requests in flight on a host at which new requests overflow to the next host.
    concurrency_threshold: int = 32
    # PREFIX_AWARE also overflows a host whose load reaches this multiple of the fleet's
    # mean (bounded-load consistent hashing; never below 2 in flight). None turns it off.
    balance_factor: float | None = 1.5
    key_mode: KeyMode = KeyMode.OPENAI
    # The static host set (ip:port), for running without a control plane.
    hosts: tuple[str, ...] = ()
    # The control plane's xDS address (ip:port); the host set and load feed come from it.
    control_plane: str | None = None
    # The cluster (EDS resource) the control plane publishes the fleet as.
    cluster: str = "vllm"
    # A load feed older than this is ignored: overflow uses local in-flight counts only.
    load_feed_max_age_s: float = 2.0
    # Extra hosts in the target list for Envoy's retries (override-host mode).
    failover_hosts: int = 2
    listen: str = "127.0.0.1:50051"
    metrics_listen: str = "127.0.0.1:9102"
    log_level: str = "info"

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
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError("log_level", self.log_level, "one of debug, info, warning, error")


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
