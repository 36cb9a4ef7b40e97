"""mTLS on all three gRPC links, through the real Envoy binary and real router and
control-plane processes, with certificates made at test time: Envoy to the router
(ext_proc, the completion log, the health checks), Envoy to the control plane (ADS) and
the router to the control plane. A peer with no certificate, or one another CA signed, is
refused."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.stack import prometheus
from extproc.stack.local import LocalStack, StackSpec, envoy_counters, scrape_metric
from extproc.stack.processes import ManagedProcess, free_ports, tcp_open, wait_until
from extproc.stack.upstream_tls import UpstreamTls

from ..reliability.stacks import NEVER_SHED
from ..tls_certs import Identity, Pki, make_pki
from .conftest import SIM_ARGS

pytestmark = pytest.mark.envoy

# Every wait in this module is bounded by this, or by the RPC deadline.
WAIT_S = 20.0
RPC_DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), "ca")


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> Pki:
    """Another CA, with identities of the same names: trusted by nobody here."""
    return make_pki(tmp_path_factory.mktemp("rogue"), "rogue")


def server_settings(identity: Identity, pki: Pki) -> dict[str, str]:
    return {
        "tls_cert_file": str(identity.cert),
        "tls_key_file": str(identity.key),
        "tls_client_ca_file": str(pki.ca),
    }


def envoy_tls(pki: Pki, client: Pki | None = None, **changes: str) -> UpstreamTls:
    """Envoy trusting ``pki``'s CA and presenting ``client``'s Envoy certificate."""
    envoy = (client or pki).envoy
    return UpstreamTls(str(pki.ca), str(envoy.cert), str(envoy.key), **changes)


@pytest.fixture(scope="module")
def stack(pki: Pki) -> Iterator[LocalStack]:
    """mTLS everywhere. Envoy checks the router by a DNS name (router.test, sent as SNI)
    and the control plane by its IP; the router checks the control plane by its IP, as
    gRPC does. STREAMED bodies, so the completion-log clusters carry TLS too."""
    spec = StackSpec.ephemeral(
        3,
        body_mode="streamed",
        sim_args=SIM_ARGS,
        router_settings={
            **server_settings(pki.router, pki),
            "control_plane_ca_file": str(pki.ca),
            "control_plane_cert_file": str(pki.router_client.cert),
            "control_plane_key_file": str(pki.router_client.key),
            "prefix_length": 4096,
            **NEVER_SHED,
        },
        control_plane_settings=server_settings(pki.control_plane, pki),
        envoy_settings={
            "router_tls": envoy_tls(pki, server_name="router.test"),
            "xds_tls": envoy_tls(pki),
        },
    )
    with LocalStack(spec) as running:
        # Raises unless every Envoy worker opened its access log stream over mTLS.
        running.open_completion_logs()
        yield running


def decisions(metrics_url: str) -> float:
    """The router's decisions so far, over all strategies and outcomes."""
    return prometheus.total(prometheus.scrape(metrics_url), "prefix_router_decisions_total")


def chat(text: str) -> dict:
    return {
        "model": "sim-model",
        "max_tokens": 1,
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": "q"}],
    }


def document(n: int) -> str:
    return f"document {n}: " + "lorem ipsum dolor sit amet " * 200  # > prefix_length


def route_documents(url: str, documents: int = 6, questions: int = 3) -> dict[int, set[str]]:
    """Each document's prompts, sent ``questions`` times: the hosts that served each."""
    placements: dict[int, set[str]] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for question in range(questions):
            for doc in range(documents):
                body = chat(document(doc) + f" question {question}")
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                assert response.headers["x-upstream-host"] == response.headers["x-served-by"]
                placements.setdefault(doc, set()).add(response.headers["x-served-by"])
    return placements


def test_requests_are_routed_by_the_router_over_mtls(stack: LocalStack):
    before = decisions(stack.router_metrics_url)
    placements = route_documents(stack.url)
    assert all(len(hosts) == 1 for hosts in placements.values()), placements
    assert len(set().union(*placements.values())) >= 2
    assert decisions(stack.router_metrics_url) - before == 18  # each one decided by it
    ext_proc = envoy_counters(stack.admin_url, "http.ingress.ext_proc.")
    assert ext_proc["failure_mode_allowed"] == ext_proc["streams_failed"] == 0
    # Each link shook hands over TLS 1.3 (Envoy's upstream default stops at 1.2).
    for cluster in ("prefix_router", "prefix_router_completions_0", "xds"):
        ssl = envoy_counters(stack.admin_url, f"cluster.{cluster}.ssl.")
        assert ssl["handshake"] >= 1, (cluster, ssl)
        assert ssl.get("versions.TLSv1.3", 0) >= 1, (cluster, ssl)
        assert ssl.get("connection_error", 0) == 0, (cluster, ssl)
    router = envoy_counters(stack.admin_url, "cluster.prefix_router.")
    assert router["membership_healthy"] == 1  # the gRPC health checks pass over mTLS
    assert envoy_counters(stack.admin_url, "control_plane.")["connected_state"] == 1
    assert stack.router_metric("prefix_router_control_plane_connected") == 1
    assert stack.control_plane_metric("prefix_router_cp_xds_streams") == 2  # Envoy, router


# --- refusals: a gRPC client with no certificate, or a stranger's ----------------------


def health_check(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    """The health service's answer at ``address``; grpc.RpcError if the call fails."""
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        return int(stub.Check(request, timeout=RPC_DEADLINE_S).status)


def credentials(pki: Pki, client: Identity | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )


def listen_addresses(stack: LocalStack) -> dict[str, str]:
    assert stack.spec.control_plane is not None
    return {
        "router": "{}:{}".format(*stack.spec.router),
        "control-plane": "{}:{}".format(*stack.spec.control_plane),
    }


@pytest.mark.parametrize("server", ["router", "control-plane"])
def test_a_client_with_the_right_certificate_is_served(stack: LocalStack, pki: Pki, server):
    address = listen_addresses(stack)[server]
    answer = health_check(address, credentials(pki, pki.envoy))
    assert answer == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("server", ["router", "control-plane"])
@pytest.mark.parametrize("client", ["plaintext", "no-certificate", "another-cas-certificate"])
def test_a_client_without_a_trusted_certificate_is_refused(
    stack: LocalStack, pki: Pki, rogue: Pki, server, client
):
    address = listen_addresses(stack)[server]
    presented = {
        "plaintext": None,
        "no-certificate": credentials(pki, None),
        # Trusts the server, but presents a certificate the server's CA did not sign.
        "another-cas-certificate": credentials(pki, rogue.envoy),
    }[client]
    with pytest.raises(grpc.RpcError) as caught:
        health_check(address, presented)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE, caught.value.details()


# --- refusals between Envoy and the router, and Envoy and the control plane ----------


@pytest.mark.parametrize(
    ("case", "ssl_stat"),
    [
        # The router refuses Envoy.
        pytest.param("presents-another-cas-certificate", None, id="envoy-of-another-ca"),
        pytest.param("presents-no-certificate", None, id="envoy-without-certificate"),
        # Envoy refuses the router.
        pytest.param("trusts-another-ca", "fail_verify_error", id="router-of-another-ca"),
        pytest.param("expects-another-name", "fail_verify_san", id="router-named-otherwise"),
    ],
)
def test_router_and_envoy_refuse_an_untrusted_peer(
    stack: LocalStack, pki: Pki, rogue: Pki, tmp_path, case, ssl_stat
):
    """Envoy's health checks fail, so the router is out of its cluster, and requests fail
    open (override-host) without a decision."""
    router_tls = {
        "presents-another-cas-certificate": envoy_tls(pki, rogue),
        "presents-no-certificate": UpstreamTls(str(pki.ca)),
        "trusts-another-ca": UpstreamTls(str(rogue.ca), str(pki.envoy.cert), str(pki.envoy.key)),
        "expects-another-name": envoy_tls(pki, server_name="elsewhere.test"),
    }[case]
    before = decisions(stack.router_metrics_url)
    envoy, url, admin = stack.start_envoy_beside(
        "envoy-refused", tmp_path, body_mode="buffered-partial", router_tls=router_tls
    )
    try:
        wait_until(
            lambda: envoy_counters(admin, "cluster.prefix_router.health_check.")["failure"] >= 2,
            WAIT_S,
            "Envoy's health checks of the router to fail",
            envoy,
        )
        with httpx.Client(base_url=url, timeout=30) as client:
            response = client.post("/v1/chat/completions", json=chat(document(1)))
        assert response.status_code == 200  # failed open to least-request
        router = envoy_counters(admin, "cluster.prefix_router.")
        assert router["membership_healthy"] == 0
        assert router["health_check.success"] == 0
        if ssl_stat is not None:
            assert router[f"ssl.{ssl_stat}"] >= 1, router
        assert envoy_counters(admin, "http.ingress.ext_proc.")["failure_mode_allowed"] == 1
        assert decisions(stack.router_metrics_url) == before
    finally:
        envoy.stop()


def test_envoy_without_a_trusted_certificate_is_refused_by_the_control_plane(
    stack: LocalStack, pki: Pki, rogue: Pki, tmp_path
):
    """It never receives the fleet: its ADS stream never comes up."""
    envoy, _, admin = stack.start_envoy_beside(
        "envoy-rogue-xds", tmp_path, body_mode="buffered-partial", xds_tls=envoy_tls(pki, rogue)
    )
    try:
        # start_envoy_beside returned once Envoy was ready: past EDS's 5 s initial fetch
        # timeout, so the stream has been tried and refused by then.
        assert envoy_counters(admin, "control_plane.")["connected_state"] == 0
        assert stack.envoy_hosts(admin_url=admin) == set()
        assert stack.control_plane_metric("prefix_router_cp_xds_streams") == 2  # as before
    finally:
        envoy.stop()


def test_envoy_over_mtls_with_buffered_partial_bodies(stack: LocalStack, pki: Pki, tmp_path):
    """The same certificates, the default body mode: the router decides every request."""
    before = decisions(stack.router_metrics_url)
    envoy, url, admin = stack.start_envoy_beside(
        "envoy-buffered", tmp_path, body_mode="buffered-partial"
    )
    try:
        wait_until(
            lambda: envoy_counters(admin, "cluster.prefix_router.")["membership_healthy"] == 1,
            WAIT_S,
            "the router to pass Envoy's health checks over mTLS",
            envoy,
        )
        placements = route_documents(url, documents=4, questions=2)
        assert all(len(hosts) == 1 for hosts in placements.values()), placements
        assert decisions(stack.router_metrics_url) - before == 8
        assert envoy_counters(admin, "http.ingress.ext_proc.")["failure_mode_allowed"] == 0
    finally:
        envoy.stop()


# --- refusals between the router's xDS client and the control plane ------------------


def _start_control_plane(
    work_dir: Path, identity: Identity, pki: Pki, hosts: list[str]
) -> tuple[ManagedProcess, str, str]:
    listen, metrics = free_ports(2)
    config = work_dir / "control-plane.yaml"
    settings = {
        "listen": f"127.0.0.1:{listen}",
        "metrics_listen": f"127.0.0.1:{metrics}",
        "hosts": hosts,
        **server_settings(identity, pki),
    }
    config.write_text(yaml.safe_dump(settings))
    argv = [sys.executable, "-m", "extproc", "control-plane", "--config", str(config)]
    process = ManagedProcess("control-plane", argv, work_dir / "control-plane.log").start()
    wait_until(lambda: tcp_open("127.0.0.1", listen), WAIT_S, "the control plane", process)
    return process, f"127.0.0.1:{listen}", f"http://127.0.0.1:{metrics}/metrics"


@pytest.mark.parametrize(
    ("case", "server_name", "reason"),
    [
        # The router refuses: CERTIFICATE_VERIFY_FAILED, or Hostname Verification Check
        # failed, in its log.
        pytest.param(
            "control-plane-signed-by-another-ca", None, r"(?i)verif", id="cp-of-another-ca"
        ),
        pytest.param(
            "control-plane-named-otherwise", "elsewhere.test", r"(?i)verif", id="cp-named-otherwise"
        ),
        # The control plane refuses: the router only sees the connection closed.
        pytest.param(
            "router-signed-by-another-ca", None, r"UNAVAILABLE", id="router-of-another-ca"
        ),
    ],
)
def test_router_and_control_plane_refuse_an_untrusted_peer(
    stack: LocalStack, pki: Pki, rogue: Pki, tmp_path, case, server_name, reason
):
    """The router's xDS client takes no fleet from a control plane whose certificate
    another CA signed, or that does not carry the name it expects; and the control plane
    serves no router whose certificate another CA signed."""
    server = rogue.control_plane if case == "control-plane-signed-by-another-ca" else None
    client = rogue.router_client if case == "router-signed-by-another-ca" else pki.router_client
    control_plane, address, cp_metrics = _start_control_plane(
        tmp_path, server or pki.control_plane, pki, stack.backend_addresses
    )
    listen, metrics = free_ports(2)
    settings = {
        "listen": f"127.0.0.1:{listen}",
        "metrics_listen": f"127.0.0.1:{metrics}",
        "control_plane": address,
        "control_plane_ca_file": str(pki.ca),
        "control_plane_cert_file": str(client.cert),
        "control_plane_key_file": str(client.key),
        **({"control_plane_server_name": server_name} if server_name else {}),
    }
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump(settings))
    log = tmp_path / "router.log"
    argv = [sys.executable, "-m", "extproc", "router", "--config", str(config)]
    router = ManagedProcess("router", argv, log).start()
    try:
        wait_until(
            lambda: log.read_text().count("control_plane_unreachable") >= 2,
            WAIT_S,
            "the router to give up on the control plane twice",
            router,
        )
        url = f"http://127.0.0.1:{metrics}/metrics"
        assert scrape_metric(url, "prefix_router_control_plane_connected") == 0
        assert scrape_metric(url, "prefix_router_hosts") == 0
        assert scrape_metric(cp_metrics, "prefix_router_cp_xds_streams") == 0
        unreachable = [line for line in log.read_text().splitlines() if "unreachable" in line]
        assert re.search(reason, unreachable[-1]), unreachable[-1]
    finally:
        router.stop()
        control_plane.stop()
