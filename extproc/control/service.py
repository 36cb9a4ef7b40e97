"""The control-plane process: the fleet loops plus the xDS gRPC server."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from extproc import keepalive, tls
from extproc.control.config import ControlPlaneConfig
from extproc.control.fleet import Fleet
from extproc.control.snapshot import LOAD_SUFFIX, SnapshotStore
from extproc.control.xds_server import XdsServer

log = structlog.get_logger("control_plane")


async def serve(
    config: ControlPlaneConfig, config_path: Path | None = None, stop: asyncio.Event | None = None
) -> None:
    store = SnapshotStore()
    fleet = Fleet(config, store, config_path)
    server = grpc.aio.server(options=keepalive.server_options())
    xds = XdsServer(store, frozenset({config.cluster, config.cluster + LOAD_SUFFIX}))
    server.add_generic_rpc_handlers(xds.handlers())
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = tls.server_credentials(
        config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
    )
    tls.listen(server, config.listen, credentials)
    metrics_host, _, metrics_port = config.metrics_listen.rpartition(":")
    metrics_server, metrics_thread = start_http_server(int(metrics_port), addr=metrics_host)

    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "control_plane_started",
        listen=config.listen,
        cluster=config.cluster,
        tls=tls.server_mode(config.tls_cert_file, config.tls_client_ca_file),
    )

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await fleet.run(stop)
    finally:
        await server.stop(1.0)
        metrics_server.shutdown()
        metrics_thread.join(timeout=5)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        log.info("control_plane_stopped")
