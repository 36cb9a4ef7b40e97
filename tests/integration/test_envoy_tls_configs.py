"""Bootstraps with TLS to the routers and to the control plane: where the transport sockets
go, what they check, and that the real Envoy binary loads them (``--mode validate`` opens
every certificate file, so the files are made here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.stack.bootstrap import (
    BODY_MODES,
    BootstrapParams,
    build_bootstrap,
    render,
)
from extproc.stack.upstream_tls import UpstreamTls

from ..tls_certs import Pki, make_pki
from .test_envoy_configs import validate_in_envoy

ROUTERS = (("127.0.0.1", 50051), ("127.0.0.2", 50051), ("127.0.0.2", 50052))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls(pki: Pki, client: bool = True, server_name: str | None = None) -> UpstreamTls:
    cert, key = (str(pki.envoy.cert), str(pki.envoy.key)) if client else (None, None)
    return UpstreamTls(str(pki.ca), cert, key, server_name)


def clusters(params: BootstrapParams) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in build_bootstrap(params)["static_resources"]["clusters"]}


def context(cluster: dict[str, Any]) -> dict[str, Any]:
    socket = cluster["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    return socket["typed_config"]


def test_tls_goes_on_the_router_completion_log_and_xds_clusters_only(pki: Pki):
    params = BootstrapParams(
        routers=ROUTERS, body_mode="streamed", router_tls=tls(pki), xds_tls=tls(pki)
    )
    by_name = clusters(params)
    with_tls = {name for name, c in by_name.items() if "transport_socket" in c}
    assert with_tls == {
        "prefix_router",
        "prefix_router_completions_0",
        "prefix_router_completions_1",
        "prefix_router_completions_2",
        "xds",
    }
    assert "transport_socket" not in by_name["vllm"]  # the backends stay plain HTTP/1


def test_plaintext_by_default():
    params = BootstrapParams(body_mode="streamed")
    assert not any("transport_socket" in c for c in clusters(params).values())


def test_the_context_offers_h2_presents_the_certificate_and_checks_the_ip(pki: Pki):
    by_name = clusters(BootstrapParams(routers=ROUTERS, router_tls=tls(pki), xds_tls=tls(pki)))
    common = context(by_name["prefix_router"])["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]  # a gRPC server refuses a connection without
    assert common["tls_params"]["tls_maximum_protocol_version"] == "TLSv1_3"
    assert common["validation_context"]["trusted_ca"] == {"filename": str(pki.ca)}
    (certificate,) = common["tls_certificates"]
    assert certificate["certificate_chain"] == {"filename": str(pki.envoy.cert)}
    assert certificate["private_key"] == {"filename": str(pki.envoy.key)}
    # No server name given: the certificate must carry an IP of the cluster's endpoints.
    names = common["validation_context"]["match_typed_subject_alt_names"]
    assert names == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}},
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.2"}},
    ]
    assert "sni" not in context(by_name["prefix_router"])
    xds_names = context(by_name["xds"])["common_tls_context"]["validation_context"]
    assert xds_names["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}
    ]


def test_a_server_name_is_checked_and_sent_as_sni(pki: Pki):
    params = BootstrapParams(router_tls=tls(pki, server_name="router.test"))
    router = context(clusters(params)["prefix_router"])
    assert router["sni"] == "router.test"
    names = router["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
    assert names == [{"san_type": "DNS", "matcher": {"exact": "router.test"}}]


def test_tls_without_a_client_certificate(pki: Pki):
    params = BootstrapParams(router_tls=tls(pki, client=False))
    assert (
        "tls_certificates" not in context(clusters(params)["prefix_router"])["common_tls_context"]
    )


def test_a_certificate_needs_its_key():
    with pytest.raises(ValueError, match="needs its key"):
        UpstreamTls("ca.pem", cert_file="envoy.pem")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"routers": ("/run/router.sock",)}, "Unix sockets"),
        ({"control_plane": None, "xds_tls": "tls"}, "needs the control plane"),
        ({"mode": "original-dst", "xds_tls": "tls"}, "needs the control plane"),
    ],
)
def test_tls_that_cannot_apply_is_refused(pki: Pki, changes, message):
    changes = {k: tls(pki) if v == "tls" else v for k, v in changes.items()}
    params = BootstrapParams(**{"router_tls": tls(pki), **changes})
    with pytest.raises(ValueError, match=message):
        build_bootstrap(params)


@pytest.mark.envoy
@pytest.mark.parametrize("body_mode", BODY_MODES)
@pytest.mark.parametrize(
    ("client", "server_name"), [(True, None), (True, "router.test"), (False, None)]
)
def test_bootstrap_with_tls_validates_in_envoy(
    tmp_path: Path, pki: Pki, body_mode, client, server_name
):
    path = tmp_path / "bootstrap.yaml"
    upstream = tls(pki, client, server_name)
    path.write_text(
        render(
            BootstrapParams(
                routers=ROUTERS, body_mode=body_mode, router_tls=upstream, xds_tls=upstream
            )
        )
    )
    validate_in_envoy(path)


@pytest.mark.envoy
def test_envoy_refuses_a_bootstrap_whose_certificate_is_missing(tmp_path: Path, pki: Pki):
    path = tmp_path / "bootstrap.yaml"
    missing = UpstreamTls(str(tmp_path / "no-such-ca.pem"))
    path.write_text(render(BootstrapParams(router_tls=missing)))
    with pytest.raises(AssertionError, match=r"no-such-ca\.pem"):
        validate_in_envoy(path)
