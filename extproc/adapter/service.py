"""The gRPC edge: the ExternalProcessor service, the health service and their lifecycle."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from extproc import metrics
from extproc.adapter import messages
from extproc.adapter.phases import RequestStream
from extproc.adapter.routing import Router
from extproc.config import RouterConfig

log = structlog.get_logger("server")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
# How long SIGTERM waits for open streams (in-flight requests) before cancelling them.
DRAIN_SECONDS = 30.0


class ExternalProcessor:
    def __init__(self, router: Router) -> None:
        self.router = router

    async def process(
        self,
        requests: AsyncIterator[messages.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[messages.ProcessingResponse]:
        stream = RequestStream(self.router)
        metrics.STREAMS.inc()
        try:
            async for request in requests:
                try:
                    response = stream.on_message(request)
                except Exception:  # a bug must cost one request, not the router
                    metrics.PROTOCOL_ERRORS.labels("internal_error").inc()
                    log.exception("internal_error")
                    response = messages.unavailable("prefix_router_internal_error")
                if response is not None:
                    yield response
        finally:
            # Runs when the HTTP request completes or the client aborts: Envoy ends the
            # stream then, so the in-flight slot is released exactly once.
            stream.close()
            metrics.STREAMS.dec()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.process,
                    request_deserializer=messages.ProcessingRequest.FromString,
                    response_serializer=messages.ProcessingResponse.SerializeToString,
                )
            },
        )


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Run the router until ``stop`` is set (or SIGINT/SIGTERM), then drain and exit."""
    router = Router(config)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((ExternalProcessor(router).handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    metrics_host, _, metrics_port = config.metrics_listen.rpartition(":")
    metrics_server, metrics_thread = start_http_server(int(metrics_port), addr=metrics_host)
    await server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set("", serving)
    await health_servicer.set(SERVICE_NAME, serving)
    log.info(
        "router_started",
        listen=config.listen,
        metrics=config.metrics_listen,
        strategy=config.routing_strategy.value,
        hosts=len(router.hosts),
    )

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        # Tell Envoy's health checks first, then let open streams finish.
        await health_servicer.enter_graceful_shutdown()
        log.info("router_draining", open_streams=router.in_flight.total())
        await server.stop(DRAIN_SECONDS)
        metrics_server.shutdown()
        metrics_thread.join(timeout=5)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        log.info("router_stopped")
