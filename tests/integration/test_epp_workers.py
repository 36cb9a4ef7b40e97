"""``prefix-router epp --workers 2`` on the picker's default ports (9002, 9003, 9090 + i).

A gateway knows one address for its endpoint picker, so both workers bind the gRPC and
health ports (SO_REUSEPORT) and the kernel spreads the gateway's connections over them;
each worker serves its own metrics, on 9090 and 9091. Here, over TLS with the certificate
the supervisor made, connections each on a channel of their own (a TCP connection each)
reach both workers, every answer names a published host, and health answers SERVING
whichever worker takes the probe. Loopback only."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import ports
from extproc.adapter.messages import LB_METADATA_KEY, LB_METADATA_NAMESPACE, ProcessingResponse
from extproc.adapter.service import SERVICE_NAME
from extproc.bench.probes import scrape, total
from extproc.stack.processes import ManagedProcess, wait_until

from ..extproc_messages import request_body, request_headers

HOSTS = ("127.0.0.71:8000", "127.0.0.72:8000", "127.0.0.73:8000")
WORKERS = 2
GRPC = ports.loopback(ports.EPP_GRPC)
HEALTH = ports.loopback(ports.EPP_HEALTH)
METRICS = [ports.EPP_METRICS + i for i in range(WORKERS)]
DEFAULTS = (ports.EPP_GRPC, ports.EPP_HEALTH, *METRICS)
POST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
# Connections to open, at most, until both workers have answered one: the kernel hashes
# each to a worker, so all of 40 landing on one worker has a chance of 2 in 2**40.
MAX_CONNECTIONS = 40
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def picker(tmp_path: Path) -> Iterator[ManagedProcess]:
    # Something else listening there would share the ports (SO_REUSEPORT) or block them.
    busy = [port for port in DEFAULTS if listening(port)]
    if busy:
        pytest.fail(f"the picker's default ports {busy} are taken")
    config = tmp_path / "epp.yaml"
    # Nothing to read KV events from: the hosts are only names here.
    config.write_text("kv_events: false\n")
    argv = [sys.executable, "-m", "extproc", "epp", "--workers", str(WORKERS)]
    argv += ["--bind-address", ports.LOOPBACK, "--config", str(config)]
    argv += [arg for host in HOSTS for arg in ("--host", host)]
    process = ManagedProcess("epp", argv, tmp_path / "epp.log").start()
    try:
        for port in METRICS:
            try:
                wait_until(
                    lambda p=port: hosts_known(p) == len(HOSTS),
                    60,
                    what=f"the worker with metrics on {port} to know the hosts",
                    ignoring=(OSError, httpx.HTTPError),
                )
            except AssertionError as error:
                raise AssertionError(f"{error}\n{process.log_tail(40)}") from None
        yield process
    finally:
        process.stop(timeout=60)


def hosts_known(metrics_port: int) -> float:
    return total(scrape(f"http://{ports.loopback(metrics_port)}/metrics"), "prefix_router_hosts")


def decisions(metrics_port: int) -> float:
    samples = scrape(f"http://{ports.loopback(metrics_port)}/metrics")
    return total(samples, "prefix_router_decisions_total")


def listening(port: int) -> list[str]:
    """``ss``'s lines for the sockets listening on ``port``, with the pids of ours (gRPC
    binds 127.0.0.1 as [::ffff:127.0.0.1])."""
    out = subprocess.run(
        ["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=10
    ).stdout
    return out.splitlines()


def listeners(port: int) -> set[int]:
    """The pids listening on ``port``."""
    pids = set()
    for line in listening(port):
        for part in line.split("pid=")[1:]:
            pids.add(int(part.split(",")[0]))
    return pids


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def chat(doc: int) -> bytes:
    text = f"document {doc} " + "the shared context of this document " * 60
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def ask(channel: grpc.Channel, body: bytes) -> str:
    """One full-duplex ext_proc stream, as a gateway opens it: the endpoint picked."""
    process = channel.stream_stream(
        f"/{SERVICE_NAME}/Process",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=ProcessingResponse.FromString,
    )
    call = process(iter([request_headers(POST, duplex=True), request_body(body)]), timeout=10)
    try:
        first = next(call)
    finally:
        call.cancel()  # a gateway resets the stream once it has what it needs
    header = {
        o.header.key: o.header.raw_value.decode()
        for o in first.request_headers.response.header_mutation.set_headers
    }[LB_METADATA_KEY]
    lb = first.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value
    assert lb.fields[LB_METADATA_KEY].string_value == header
    return header


def tls_channel(credentials: grpc.ChannelCredentials) -> grpc.Channel:
    # A subchannel pool of its own: a new TCP connection, not the process-wide one shared
    # by every channel to the same address.
    options = [
        ("grpc.ssl_target_name_override", "localhost"),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    return grpc.secure_channel(GRPC, credentials, options)


@pytest.mark.timeout(180)
def test_two_workers_share_the_default_ports_and_both_take_the_gateways_connections(picker):
    supervisor = picker.popen
    assert supervisor is not None
    # Two processes, both children of the supervisor, listen on the gRPC and health
    # ports; each worker has a metrics port of its own.
    for port in (ports.EPP_GRPC, ports.EPP_HEALTH):
        pids = listeners(port)
        assert len(pids) == WORKERS, (port, pids)
        assert {parent_of(pid) for pid in pids} == {supervisor.pid}
    metrics_pids = [listeners(port) for port in METRICS]
    assert all(len(pids) == 1 for pids in metrics_pids), metrics_pids
    assert set().union(*metrics_pids) == listeners(ports.EPP_GRPC)

    # Every worker serves the certificate the supervisor made: one handshake's trusts all.
    pem = ssl.get_server_certificate((ports.LOOPBACK, ports.EPP_GRPC), timeout=10)
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    answers: list[str] = []
    connections = 0
    while connections < MAX_CONNECTIONS and not all(decisions(p) > 0 for p in METRICS):
        with tls_channel(credentials) as channel:
            answers += [ask(channel, chat(doc)) for doc in range(3)]
        connections += 1
    per_worker = [decisions(p) for p in METRICS]
    assert all(n > 0 for n in per_worker), (connections, per_worker)
    assert sum(decisions(p) for p in METRICS) == len(answers)
    assert set(answers) <= set(HOSTS)

    # The health port: whichever worker takes the probe, every service the charts probe
    # is SERVING.
    for attempt in range(8):
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(HEALTH, options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "liveness", "readiness", "inference-extension", SERVICE_NAME):
                request = health_pb2.HealthCheckRequest(service=service)
                assert stub.Check(request, timeout=5).status == SERVING, (attempt, service)

    # SIGTERM drains both workers and nothing listens on a default port after.
    assert picker.stop(timeout=60) == 0
    log = picker.log_path.read_text()
    assert log.count('"event": "router_stopped"') == WORKERS, picker.log_tail(40)
    assert not any(listening(port) for port in DEFAULTS)
