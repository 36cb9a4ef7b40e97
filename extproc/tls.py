"""TLS and mTLS on the gRPC links, with gRPC's own credentials.

Three links can run over TLS: Envoy to the router (ext_proc, the completion log and the
health checks share the router's one port), Envoy to the control plane (ADS) and each
router to the control plane. A server given a client CA requires a client certificate
that chains to it, so a peer with none, or with one another CA signed, is refused in the
handshake. The files are read once, at start: a renewed certificate needs a restart.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc


def server_credentials(
    cert_file: str | None, key_file: str | None, client_ca_file: str | None
) -> grpc.ServerCredentials | None:
    """The credentials a server listens with: None (plaintext) without a certificate;
    with ``client_ca_file``, mTLS (a client certificate is required)."""
    if cert_file is None or key_file is None:
        return None
    pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    client_ca = Path(client_ca_file).read_bytes() if client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def server_mode(cert_file: str | None, client_ca_file: str | None) -> str:
    """``off``, ``tls`` or ``mtls``: how a server listens, for its start-up log line."""
    if cert_file is None:
        return "off"
    return "tls" if client_ca_file is None else "mtls"


def channel_credentials(
    ca_file: str, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """A client's credentials: trust ``ca_file`` only, and present ``cert_file`` (mTLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes(),
        private_key=Path(key_file).read_bytes() if key_file is not None else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file is not None else None,
    )


def server_name_options(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options that verify the server's certificate by ``server_name`` (also sent
    as SNI) instead of the target's IP."""
    return [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]


def listen(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Bind ``address`` in plaintext or over TLS; raise OSError if it cannot be bound."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as error:  # grpc.aio raises instead of returning 0
        mode = "in plaintext" if credentials is None else "over TLS"
        raise OSError(f"cannot listen on {address} {mode} ({error})") from None
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


def write_self_signed(
    directory: Path, names: tuple[str, ...] = ("localhost",)
) -> tuple[Path, Path]:
    """A new self-signed certificate and its key (EC P-256, a year) in ``directory``, as
    ``tls.crt`` and ``tls.key``: what an endpoint picker serves when given no certificate
    (gateways that call it over TLS do not verify it). ``names``: DNS names or IPs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prefix-router-epp")])
    now = datetime.datetime.now(datetime.UTC)
    alternatives: list[x509.GeneralName] = []
    for name in names:
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternatives.append(x509.DNSName(name))
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    key_file.touch(mode=0o600)
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return cert_file, key_file
