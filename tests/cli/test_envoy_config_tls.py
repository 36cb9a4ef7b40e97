"""`prefix-router envoy-config`'s TLS flags: they reach the bootstrap, and flags that do
not go together, or cannot apply, are refused."""

from __future__ import annotations

import pytest
import yaml

from extproc.cli import EXIT_USAGE, main


def bootstrap(capsys, *flags: str) -> dict:
    assert main(["envoy-config", *flags]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def tls_context(config: dict, cluster: str) -> dict:
    (found,) = [c for c in config["static_resources"]["clusters"] if c["name"] == cluster]
    return found["transport_socket"]["typed_config"]


def test_router_and_xds_flags_reach_their_clusters(capsys):
    config = bootstrap(
        capsys,
        "--body-mode", "streamed",
        "--router-tls-ca", "/etc/envoy/tls/ca.pem",
        "--router-tls-cert", "/etc/envoy/tls/envoy.pem",
        "--router-tls-key", "/etc/envoy/tls/envoy.key",
        "--router-tls-server-name", "router.internal",
        "--xds-tls-ca", "/etc/envoy/tls/cp-ca.pem",
    )  # fmt: skip
    for cluster in ("prefix_router", "prefix_router_completions_0"):
        router = tls_context(config, cluster)
        assert router["sni"] == "router.internal"
        common = router["common_tls_context"]
        assert common["validation_context"]["trusted_ca"] == {"filename": "/etc/envoy/tls/ca.pem"}
        (certificate,) = common["tls_certificates"]
        assert certificate["private_key"] == {"filename": "/etc/envoy/tls/envoy.key"}
    xds = tls_context(config, "xds")["common_tls_context"]
    assert xds["validation_context"]["trusted_ca"] == {"filename": "/etc/envoy/tls/cp-ca.pem"}
    assert "tls_certificates" not in xds  # TLS only: no --xds-tls-cert given


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--router-tls-cert", "e.pem", "--router-tls-key", "e.key"), "needs --router-tls-ca"),
        (("--xds-tls-server-name", "cp.internal"), "--xds-tls-server-name needs --xds-tls-ca"),
        (("--router-tls-ca", "ca.pem", "--router-tls-cert", "e.pem"), "go together"),
        (("--xds-tls-ca", "ca.pem", "--xds-tls-key", "e.key"), "go together"),
        (("--xds-tls-ca", "ca.pem", "--static"), "--xds-tls-ca applies with EDS only"),
        (("--xds-tls-ca", "ca.pem", "--mode", "original-dst"), "--xds-tls-ca applies with EDS"),
        (("--router-tls-ca", "ca.pem", "--router", "unix:/run/r.sock"), "needs ip:port routers"),
    ],
)
def test_tls_flags_that_do_not_go_together_are_refused(capsys, flags, message):
    assert main(["envoy-config", *flags]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""
