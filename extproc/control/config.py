"""Control-plane configuration: frozen, validated, loaded from YAML (hot-reloadable)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.config import LOG_LEVELS, doc, read_config_file
from extproc.errors import ConfigError
from extproc.picker.hosts import parse_host_address


def _number(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigError(name, value, f"a number from {low:g} to {high:g}")
    return float(value)


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(name, value, f"an integer from {low} to {high}")
    return value


def _addresses(name: str, values: Any) -> tuple[str, ...]:
    if values is None:
        return ()
    if not isinstance(values, (list, tuple)):
        raise ConfigError(name, values, "a list of ip:port strings")
    result = []
    for index, value in enumerate(values):
        try:
            result.append(parse_host_address(str(value)))
        except ValueError as error:
            raise ConfigError(f"{name}[{index}]", value, f"ip:port ({error})") from None
    return tuple(result)


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = field(
        default=1.0,
        metadata=doc(
            "Seconds between health rounds (GET /health and GET /v1/models on every host).",
            range=(0.05, 300),
        ),
    )
    timeout_s: float = field(
        default=0.5, metadata=doc("Seconds one probe may take.", range=(0.01, "interval_s"))
    )
    unhealthy_threshold: int = field(
        default=2,
        metadata=doc(
            "Failed probes in a row that take a host out of the published set.", range=(1, 100)
        ),
    )
    healthy_threshold: int = field(
        default=2, metadata=doc("Passed probes in a row that put a host (back) in.", range=(1, 100))
    )

    def __post_init__(self) -> None:
        _number("health.interval_s", self.interval_s, 0.05, 300)
        _number("health.timeout_s", self.timeout_s, 0.01, self.interval_s)
        _integer("health.unhealthy_threshold", self.unhealthy_threshold, 1, 100)
        _integer("health.healthy_threshold", self.healthy_threshold, 1, 100)


@dataclass(frozen=True)
class LoadFeedSettings:
    interval_s: float = field(
        default=0.25,
        metadata=doc(
            "Seconds between scrapes of every published host's /metrics.", range=(0.05, 60)
        ),
    )
    timeout_s: float = field(
        default=0.2, metadata=doc("Seconds one scrape may take.", range=(0.01, "interval_s"))
    )
    rate_time_constant_s: float = field(
        default=10.0,
        metadata=doc(
            "Seconds over which each host's prompt-token rate (its cache pressure, which "
            "steers where routers place new prefixes) is smoothed.",
            range=(1, 3600),
        ),
    )

    pressure_factor: float | None = field(
        default=1.5,
        metadata=doc(
            "A host taking in less than 1/pressure_factor of the fleet's mean prompt-token "
            "rate draws new prefixes (placement weight 4), one taking in more than "
            "pressure_factor times it repels them (1/4); null gives every host weight 1, so "
            "placement is by hash alone.",
            range=(1.1, 10),
        ),
    )

    def __post_init__(self) -> None:
        _number("load_feed.interval_s", self.interval_s, 0.05, 60)
        _number("load_feed.timeout_s", self.timeout_s, 0.01, self.interval_s)
        _number("load_feed.rate_time_constant_s", self.rate_time_constant_s, 1, 3600)
        if self.pressure_factor is not None:
            _number("load_feed.pressure_factor", self.pressure_factor, 1.1, 10)


@dataclass(frozen=True)
class ControlPlaneConfig:
    listen: str = field(
        default="127.0.0.1:18000",
        metadata=doc("The xDS address (ADS and plain EDS).", allowed="ip:port"),
    )
    metrics_listen: str = field(
        default="127.0.0.1:9103", metadata=doc("The Prometheus metrics address.", allowed="ip:port")
    )
    cluster: str = field(
        default="vllm",
        metadata=doc(
            "The Envoy cluster (and EDS resource) the fleet is published as.",
            allowed="a non-empty name",
        ),
    )
    hosts: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "Static discovery: the vLLM hosts. Edits apply without a restart.",
            allowed="ip:port entries",
        ),
    )
    dns: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "DNS discovery: names re-resolved on every health round; one name may stand for "
            "many A records.",
            allowed="host:port entries",
        ),
    )
    draining: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "Hosts that take no new requests but finish the ones in flight.",
            allowed="ip:port entries",
        ),
    )
    zones: Mapping[str, str] = field(
        default_factory=dict,
        metadata=doc("Optional locality per host, published in EDS.", allowed="ip:port: zone name"),
    )
    health: HealthSettings = field(
        default_factory=HealthSettings, metadata=doc("Health checking; see below.")
    )
    load_feed: LoadFeedSettings = field(
        default_factory=LoadFeedSettings,
        metadata=doc("The load feed scraped from vLLM's /metrics; see below."),
    )
    log_level: str = field(
        default="info",
        metadata=doc(
            "The lowest level logged (checked when logging starts, not when the file loads).",
            allowed=", ".join(LOG_LEVELS),
        ),
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("listen", "metrics_listen"):
            value = getattr(self, name)
            try:
                set_(self, name, parse_host_address(str(value)))
            except ValueError:
                raise ConfigError(name, value, "an ip:port string") from None
        if not isinstance(self.cluster, str) or not self.cluster:
            raise ConfigError("cluster", self.cluster, "a non-empty cluster name")
        set_(self, "hosts", _addresses("hosts", self.hosts))
        set_(self, "draining", _addresses("draining", self.draining))
        if not isinstance(self.dns, (list, tuple)):
            raise ConfigError("dns", self.dns, "a list of host:port names")
        for index, name in enumerate(self.dns):
            host, _, port = str(name).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"dns[{index}]", name, "host:port with a port from 1 to 65535")
        set_(self, "dns", tuple(self.dns))
        if not isinstance(self.zones, Mapping):
            raise ConfigError("zones", self.zones, "a mapping of ip:port to zone name")
        zones = {}
        for key, zone in self.zones.items():
            try:
                zones[parse_host_address(str(key))] = str(zone)
            except ValueError:
                raise ConfigError(f"zones[{key!r}]", key, "an ip:port key") from None
        set_(self, "zones", zones)


def _section(name: str, cls: type, values: Any) -> Any:
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise ConfigError(name, values, "a mapping")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}", values[unknown[0]], f"one of {sorted(known)}")
    return cls(**values)


def load_control_plane_config(
    path: Path | None, overrides: Mapping[str, Any] | None = None
) -> ControlPlaneConfig:
    values: dict[str, Any] = read_config_file(path) if path else {}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = set(ControlPlaneConfig.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            unknown[0], values[unknown[0]], f"a known field: {', '.join(sorted(known))}"
        )
    values["health"] = _section("health", HealthSettings, values.get("health"))
    values["load_feed"] = _section("load_feed", LoadFeedSettings, values.get("load_feed"))
    return ControlPlaneConfig(**values)
