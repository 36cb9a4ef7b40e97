"""The gRPC edge of the control plane: ADS and plain EDS over one protocol core."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog

from extproc.control import metrics
from extproc.control.snapshot import SnapshotStore
from extproc.control.xds_protocol import DiscoveryRequest, DiscoveryResponse, XdsStream

log = structlog.get_logger("xds")

ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
EDS_SERVICE = "envoy.service.endpoint.v3.EndpointDiscoveryService"


class XdsServer:
    def __init__(self, store: SnapshotStore, default_resources: frozenset[str]) -> None:
        self._store = store
        self._default_resources = default_resources

    async def stream(
        self,
        requests: AsyncIterator[DiscoveryRequest],
        context: grpc.aio.ServicerContext[DiscoveryRequest, DiscoveryResponse],
    ) -> AsyncIterator[DiscoveryResponse]:
        protocol = XdsStream(self._store, self._default_resources)
        # One queue, one consumer: requests and store changes are handled in order, so the
        # protocol state needs no locks.
        events: asyncio.Queue[DiscoveryRequest | None] = asyncio.Queue()

        async def read() -> None:
            async for request in requests:
                await events.put(request)

        async def watch() -> None:
            generation = self._store.generation
            while True:
                generation = await self._store.wait_past(generation)
                await events.put(None)

        reader = asyncio.create_task(read())
        watcher = asyncio.create_task(watch())
        metrics.XDS_STREAMS.inc()
        try:
            while not reader.done() or not events.empty():
                getter = asyncio.create_task(events.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    continue
                event = getter.result()
                response = protocol.pending() if event is None else protocol.on_request(event)
                if response is not None:
                    yield response
        finally:
            metrics.XDS_STREAMS.dec()
            for task in (reader, watcher):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            log.info("xds_stream_closed", node=protocol.state.node)

    def handlers(self) -> tuple[grpc.GenericRpcHandler, ...]:
        def handler(service: str, method: str) -> grpc.GenericRpcHandler:
            return grpc.method_handlers_generic_handler(
                service,
                {
                    method: grpc.stream_stream_rpc_method_handler(
                        self.stream,
                        request_deserializer=DiscoveryRequest.FromString,
                        response_serializer=DiscoveryResponse.SerializeToString,
                    )
                },
            )

        return (
            handler(ADS_SERVICE, "StreamAggregatedResources"),
            handler(EDS_SERVICE, "StreamEndpoints"),
        )
