"""The floor of any grpc.aio ext_proc server: one that answers every message with "go on".

The overhead benchmark runs it behind its own Envoy, in the router's BUFFERED_PARTIAL
mode, on the router's default event loop and with its gRPC server options and health
service, so the difference between it and the router is what routing costs, and the
difference between it and plain Envoy is what a Python ext_proc server costs before it
does anything. It reads nothing, decides
nothing and sets no metadata: Envoy places each request by its fallback policy.

    python -m extproc.bench.noop_processor --listen 127.0.0.1:50099
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.adapter import messages
from extproc.adapter.service import SERVICE_NAME, loop_factory, server_options
from extproc.config import RouterConfig


async def process(
    requests: AsyncIterator[messages.ProcessingRequest],
    context: grpc.aio.ServicerContext[messages.ProcessingRequest, messages.ProcessingResponse],
) -> AsyncIterator[messages.ProcessingResponse]:
    async for request in requests:
        kind = request.WhichOneof("request")
        if kind is not None:
            yield messages.continue_for(kind)


async def serve(listen: str) -> None:
    server = grpc.aio.server(options=server_options())
    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                process,
                request_deserializer=messages.ProcessingRequest.FromString,
                response_serializer=messages.ProcessingResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
    # Envoy's health checks keep the ext_proc cluster's only host healthy.
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(listen)
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="ip:port")
    listen = parser.parse_args().listen
    # On the router's default event loop, so the two differ only in what they do.
    with asyncio.Runner(loop_factory=loop_factory(RouterConfig().event_loop)) as runner:
        runner.run(serve(listen))


if __name__ == "__main__":
    main()
