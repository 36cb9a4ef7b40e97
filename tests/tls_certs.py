"""Certificates made at test time (trustme): a CA and the identities each link presents."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Identity:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """One CA and what it signed: the servers name 127.0.0.1 (the stacks' loopback
    address) and a DNS name; the clients are Envoy and the router."""

    ca: Path
    router: Identity
    control_plane: Identity
    envoy: Identity
    router_client: Identity


def _write(directory: Path, name: str, cert: trustme.LeafCert) -> Identity:
    identity = Identity(directory / f"{name}.pem", directory / f"{name}.key")
    identity.cert.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(identity.key))
    return identity


def make_pki(directory: Path, name: str = "ca") -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name=name)
    ca_path = directory / f"{name}.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    return Pki(
        ca=ca_path,
        router=_write(directory, f"{name}-router", ca.issue_cert("127.0.0.1", "router.test")),
        control_plane=_write(
            directory, f"{name}-control-plane", ca.issue_cert("127.0.0.1", "control-plane.test")
        ),
        envoy=_write(directory, f"{name}-envoy", ca.issue_cert("envoy.test")),
        router_client=_write(directory, f"{name}-router-client", ca.issue_cert("router.test")),
    )
