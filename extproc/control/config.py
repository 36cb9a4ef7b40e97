"""Control-plane configuration: frozen pydantic models, loaded from YAML (hot-reloadable).

Each field's description, type, default and range are declared once, here:
docs/configuration.md and the JSON Schema are rendered from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    Field,
    Strict,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from extproc import ports
from extproc.control.rates import PRESSURE_FACTOR
from extproc.schema import (
    PEM_FILE,
    Address,
    DnsName,
    FrozenModel,
    LogLevel,
    Name,
    Number,
    PemFile,
    check_at_most,
    check_ca,
    check_key_pair,
    check_needs,
    described,
    finite,
    read_config_file,
    validated,
)


class HealthSettings(FrozenModel):
    interval_s: Number = described(
        "Seconds between health rounds (GET /health and GET /v1/models on every host).",
        1.0,
        ge=0.05,
        le=300,
    )
    timeout_s: Number = described(
        "Seconds one probe may take.", 0.5, at_most="interval_s", ge=0.01, le=300
    )
    unhealthy_threshold: StrictInt = described(
        "Failed probes in a row that take a host out of the published set.", 2, ge=1, le=100
    )
    healthy_threshold: StrictInt = described(
        "Passed probes in a row that put a host (back) in.", 2, ge=1, le=100
    )

    @field_validator("timeout_s")
    @classmethod
    def _within_interval(cls, value: float, info: ValidationInfo) -> float:
        return check_at_most(cls, "timeout_s", value, info.data)


# Optional, so its range sits inside the Annotated (JSON Schema then shows it).
PressureFactor = Annotated[float, Strict(), Field(ge=1.1, le=10), AfterValidator(finite)]


class LoadFeedSettings(FrozenModel):
    interval_s: Number = described(
        "Seconds between scrapes of every published host's /metrics.", 0.25, ge=0.05, le=60
    )
    timeout_s: Number = described(
        "Seconds one scrape may take.", 0.2, at_most="interval_s", ge=0.01, le=60
    )
    rate_time_constant_s: Number = described(
        "Seconds over which each host's prompt-token rate (its cache pressure, which "
        "steers where routers place new prefixes) is smoothed.",
        10.0,
        ge=1,
        le=3600,
    )
    pressure_factor: PressureFactor | None = described(
        "A host taking in less than 1/pressure_factor of the fleet's mean prompt-token "
        "rate draws new prefixes (placement weight 4), one taking in more than "
        "pressure_factor times it repels them (1/4); null gives every host weight 1, so "
        "placement is by hash alone.",
        PRESSURE_FACTOR,
    )

    @field_validator("timeout_s")
    @classmethod
    def _within_interval(cls, value: float, info: ValidationInfo) -> float:
        return check_at_most(cls, "timeout_s", value, info.data)


class ControlPlaneConfig(FrozenModel):
    listen: Address = described(
        "The xDS address (ADS and plain EDS).",
        ports.loopback(ports.CONTROL_PLANE_XDS),
        allowed="ip:port",
        restart=True,
    )
    metrics_listen: Address = described(
        "The Prometheus metrics address.",
        ports.loopback(ports.CONTROL_PLANE_METRICS),
        allowed="ip:port",
        restart=True,
    )
    cluster: Name = described(
        "The Envoy cluster (and EDS resource) the fleet is published as.",
        "vllm",
        allowed="a non-empty name",
        restart=True,
    )
    hosts: tuple[Address, ...] = described(
        "Static discovery: the vLLM hosts. Edits apply without a restart.",
        (),
        allowed="ip:port entries",
    )
    dns: tuple[DnsName, ...] = described(
        "DNS discovery: names re-resolved on every health round; one name may stand for "
        "many A records.",
        (),
        allowed="host:port entries",
    )
    draining: tuple[Address, ...] = described(
        "Hosts that take no new requests but finish the ones in flight.",
        (),
        allowed="ip:port entries",
    )
    zones: dict[Address, str] = described(
        "Optional locality per host, published in EDS.",
        default_factory=dict,
        allowed="ip:port: zone name",
    )
    health: HealthSettings = described(
        "Health checking; see below.",
        default_factory=HealthSettings,
        restart=True,
    )
    load_feed: LoadFeedSettings = described(
        "The load feed scraped from vLLM's /metrics; see below.",
        default_factory=LoadFeedSettings,
        restart=True,
    )
    tls_cert_file: PemFile | None = described(
        "TLS on listen (xDS to Envoy and to the routers): the certificate chain this "
        "control plane presents, PEM; with tls_key_file. Its clients verify it: Envoy "
        "with `envoy-config --xds-tls-ca`, routers with control_plane_ca_file. null: "
        "plaintext.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    tls_key_file: PemFile | None = described(
        "The private key of tls_cert_file, PEM.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    tls_client_ca_file: PemFile | None = described(
        "mTLS on listen: the CA certificates a client's certificate must chain to. Set, "
        "a client (Envoy, a router) that presents no certificate, or one these CAs did "
        "not sign, is refused in the TLS handshake. Needs tls_cert_file.",
        None,
        allowed=PEM_FILE,
        restart=True,
    )
    log_level: LogLevel = described(
        "The lowest level logged.",
        "info",
    )

    @field_validator("hosts", "draining", "health", "load_feed", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        # An empty YAML key (``hosts:``) reads as null: the default, not an error.
        if value is None:
            return () if info.field_name in ("hosts", "draining") else {}
        return value

    @model_validator(mode="after")
    def _tls_settings_agree(self) -> ControlPlaneConfig:
        check_key_pair(self, "tls_cert_file", "tls_key_file")
        check_needs(
            self,
            "tls_client_ca_file",
            "tls_cert_file",
            "a client certificate is asked for in a TLS handshake",
        )
        check_ca(self, "tls_client_ca_file")
        return self


def load_control_plane_config(
    path: Path | None, overrides: Mapping[str, Any] | None = None
) -> ControlPlaneConfig:
    values: dict[str, Any] = read_config_file(path) if path else {}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return validated(ControlPlaneConfig, values)
