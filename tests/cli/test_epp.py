"""``prefix-router epp``: the reference chart's flags, its ports, TLS and plaintext."""

from __future__ import annotations

import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.cli import build_parser
from extproc.cli.epp import go_bool, overrides_of
from extproc.config import load_config
from extproc.stack.processes import ManagedProcess, free_ports, wait_until

CHART_ARGS = [
    "epp",
    "--pool-name",
    "vllm-pool",
    "--pool-namespace",
    "default",
    "--pool-group",
    "inference.networking.k8s.io",
    "--zap-encoder",
    "json",
    "--config-file",
    "/config/default-plugins.yaml",
    "--v",
    "1",
    "--tracing=false",
    "--metrics-endpoint-auth=false",
    "--ha-enable-leader-election",
]


def test_the_reference_charts_flags_parse_and_give_its_ports():
    args = build_parser().parse_args(CHART_ARGS)
    overrides = overrides_of(args, None)
    assert overrides["listen"] == "0.0.0.0:9002"
    assert overrides["health_listen"] == "0.0.0.0:9003"
    assert overrides["metrics_listen"] == "0.0.0.0:9090"
    assert overrides["epp"] is True and args.secure_serving is True
    assert args.ignored_pool_name == "vllm-pool"


def test_workers_default_to_one_and_always_share_the_grpc_and_health_ports():
    default = overrides_of(build_parser().parse_args(["epp"]), None)
    assert default["workers"] is None  # the config's: 1 unless it says otherwise
    assert default["workers_share_listen"] is True
    overrides = overrides_of(build_parser().parse_args(["epp", "--workers", "4"]), None)
    assert overrides["workers"] == 4 and overrides["workers_share_listen"] is True


def test_the_config_files_decision_exchange_reaches_a_lone_picker(tmp_path):
    # Replicas of the picker (separate processes, not one supervisor's workers) share
    # decisions as routers do: the flags leave the file's exchange settings alone, and
    # serve() starts the exchange from them (tests/integration/test_epp_replicas.py).
    config = tmp_path / "epp.yaml"
    config.write_text(
        "decision_exchange_bind: tcp://127.0.0.1:7001\n"
        "decision_exchange_peers: [tcp://127.0.0.1:7002]\n"
    )
    args = build_parser().parse_args(["epp", "--config", str(config)])
    loaded = load_config(args.config, overrides=overrides_of(args, None))
    assert loaded.epp is True and loaded.workers == 1
    assert loaded.decision_exchange_bind == "tcp://127.0.0.1:7001"
    assert loaded.decision_exchange_peers == ("tcp://127.0.0.1:7002",)


@pytest.mark.parametrize(("text", "value"), [("true", True), ("False", False), ("1", True)])
def test_go_booleans(text, value):
    assert go_bool(text) is value


def test_a_bad_boolean_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["epp", "--secure-serving=maybe"])
    assert "--secure-serving" in capsys.readouterr().err


def _health(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service)
    return stub.Check(request, timeout=2).status


@pytest.mark.parametrize("secure", [True, False])
def test_it_serves_ext_proc_over_tls_by_default_or_plaintext_and_health_on_its_own_port(
    tmp_path, secure
):
    grpc_port, health_port, metrics_port = free_ports(3)
    argv = [sys.executable, "-m", "extproc", "epp", "--bind-address", "127.0.0.1"]
    argv += ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port)]
    argv += ["--metrics-port", str(metrics_port), "--host", "127.0.0.11:8000"]
    if not secure:
        argv.append("--secure-serving=false")
    picker = ManagedProcess("epp", argv, tmp_path / "epp.log").start()
    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        health_address = f"127.0.0.1:{health_port}"

        def ready() -> bool:
            try:
                with grpc.insecure_channel(health_address) as channel:
                    return _health(channel, "readiness") == serving
            except grpc.RpcError:
                return False

        wait_until(ready, 30, "epp", picker)
        with grpc.insecure_channel(health_address) as channel:
            for service in ("liveness", "inference-extension", ""):
                assert _health(channel, service) == serving
        address = f"127.0.0.1:{grpc_port}"
        if secure:
            # The self-signed certificate: trusted here by taking it from the handshake.
            import ssl

            pem = ssl.get_server_certificate(("127.0.0.1", grpc_port))
            credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
            options = [("grpc.ssl_target_name_override", "localhost")]
            with grpc.secure_channel(address, credentials, options) as channel:
                assert _health(channel, "envoy.service.ext_proc.v3.ExternalProcessor") == serving
            with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError):
                _health(channel, "")
        else:
            with grpc.insecure_channel(address) as channel:
                assert _health(channel, "envoy.service.ext_proc.v3.ExternalProcessor") == serving
    finally:
        picker.stop()
    assert "epp_flags_ignored" not in (tmp_path / "epp.log").read_text()
