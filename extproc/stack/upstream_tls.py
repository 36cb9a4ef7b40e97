"""Envoy's TLS to its gRPC upstreams: the routers and the control plane.

An ``envoy.transport_sockets.tls`` UpstreamTlsContext that trusts one CA bundle, presents a
client certificate when the server asks for one (mTLS), and checks the server's name: the
DNS name ``server_name`` (also sent as SNI) when given, else the IP of the endpoint it
connected to, as gRPC's own clients (the router's xDS client) check it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_TLS_CONTEXT = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


@dataclass(frozen=True)
class UpstreamTls:
    # The CA certificates the server's certificate must chain to (PEM).
    ca_file: str
    # The certificate chain and key Envoy presents (PEM): both, or neither for TLS only.
    cert_file: str | None = None
    key_file: str | None = None
    # The DNS name the server's certificate must carry; None: the endpoint's IP.
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("an upstream TLS client certificate needs its key, and the reverse")


def _names(tls: UpstreamTls, ips: tuple[str, ...]) -> list[dict[str, Any]]:
    if tls.server_name is not None:
        return [{"san_type": "DNS", "matcher": {"exact": tls.server_name}}]
    return [{"san_type": "IP_ADDRESS", "matcher": {"exact": ip}} for ip in dict.fromkeys(ips)]


def transport_socket(tls: UpstreamTls, ips: tuple[str, ...]) -> dict[str, Any]:
    """The transport socket of a cluster whose endpoints are at ``ips``."""
    common: dict[str, Any] = {
        # A gRPC server closes a TLS connection that did not pick h2 by ALPN: without it
        # every health check and stream fails after the handshake.
        "alpn_protocols": ["h2"],
        # Envoy's upstream default stops at TLS 1.2.
        "tls_params": {"tls_maximum_protocol_version": "TLSv1_3"},
        "validation_context": {
            "trusted_ca": {"filename": tls.ca_file},
            "match_typed_subject_alt_names": _names(tls, ips),
        },
    }
    if tls.cert_file is not None and tls.key_file is not None:
        common["tls_certificates"] = [
            {
                "certificate_chain": {"filename": tls.cert_file},
                "private_key": {"filename": tls.key_file},
            }
        ]
    context: dict[str, Any] = {"@type": _TLS_CONTEXT, "common_tls_context": common}
    if tls.server_name is not None:
        context["sni"] = tls.server_name
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}
